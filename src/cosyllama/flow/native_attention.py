"""The flow's bf16 attention kernel for CPUs with AVX512-BF16 (``kernels/attention_bf16.cpp``).

PyTorch's CPU flash kernel runs bfloat16 attention no faster than float32 where the CPU has AVX512-BF16 but
no AMX: on 2 Zen 4 cores ~30 ms per attention of the flow's real size (2 CFG rows x 16 heads x 650 frames)
against ~12 ms for this kernel, which computes both products with the CPU's bf16 dot products and keeps the
softmax in float32 (its arithmetic, and an error the size of PyTorch's on the same inputs, are described in
the source). On Intel AMX PyTorch's kernel runs on the tiles and may be the faster one, so which runs is
measured, not assumed (:func:`choice`).

The kernel is C++ with a plain C ABI, called through ctypes. It is compiled on first use with the system's
C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``; under a second) into the cache directory, under a
name that hashes the source and the flags, so a changed kernel is built again; ``python -m
cosyllama.flow.native_attention`` builds it beside its source instead, for installs whose runs have no compiler
(the container image does this at build time). Without a compiler or a built kernel, on a CPU without
AVX512-BF16 (as PyTorch sees it: an emulator or a hypervisor that hides it counts), or with
``COSYLLAMA_ATTENTION=pytorch``, PyTorch's attention runs, and the CPU line says why.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..defaults import AUTO_CPU_SHARE_MIN
from ..timing import timed

SOURCE = Path(__file__).with_name("kernels") / "attention_bf16.cpp"
PREBUILT = SOURCE.parent  # where `python -m cosyllama.flow.native_attention` puts the kernel by default
FLAGS = ("-O3", "-std=c++17", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fPIC",
         "-shared", "-pthread")
NEEDS = {"avx512f": "AVX-512", "avx512bw": "AVX512-BW", "avx512vl": "AVX512-VL", "avx512_bf16": "AVX512-BF16"}
ABI_VERSION = 3
ENV = "COSYLLAMA_ATTENTION"  # auto (default): measured; kernel: whenever it can run; pytorch: never
MODES = ("auto", "kernel", "pytorch")
# The kernel replaces PyTorch's attention only when it is at least this much faster at the timed size: a
# kernel that merely ties is not worth a second code path in the run.
MIN_GAIN = 1.1
# A timing is kept (cached) only if the process got this share of the CPU its threads asked for meanwhile: the
# same rule as the flow's auto timing (cosyllama.flow.auto.CPU_SHARE_MIN). The two calls are timed in turns, so
# a busy machine slows both, but a verdict kept for good should not rest on a disturbed run.
CPU_SHARE_MIN = AUTO_CPU_SHARE_MIN
# The attention the choice is timed on: both CFG rows over 650 frames, a 3 s prompt + 10 s of speech (the
# size `auto` projects to, cosyllama.flow.auto.REAL_PROMPT_TOKENS / REAL_TOKENS).
TIMED_FRAMES = 650
TIMED_ROUNDS = 3
COMPILE_TIMEOUT_S = 120

# PyTorch's attention (where the kernel does not run): the keys are padded with zero frames to a whole number of
# KEY_ALIGN, the padding hidden by the mask: a hidden key adds exp(-inf) = 0 to each softmax sum and 0 x 0 to each
# output. PyTorch's CPU flash attention hands its two products to the BLAS, whose bf16 kernels on AMX take a slower
# path when the key count is not a multiple of 16: 2 x 16 heads, 106 query frames, bf16, 2 threads of the AMX class:
# 206 keys 0.96 ms, 208 keys 0.49 ms (float32: 1.31, 1.12); 606 against 608 keys with 56 queries 1.17 against 1.02
# ms (docs/amx.md, "Keys padded to 16"). A streaming call has its mask anyway; an unmasked (whole) call gets one
# only where the activations are bf16 and the keys fall short of a multiple: there the padded call with its mask is
# 2-18 % faster on average over the key counts at 400-915 frames; in float32 the mask costs what the padding gains.
# CPU only.
KEY_ALIGN = 16
PROFILE_NAME = "cosyllama::attention_bf16"  # the kernel's calls in torch.profiler's tables


def mode() -> str:
    """``COSYLLAMA_ATTENTION``: ``auto``, ``kernel`` or ``pytorch`` (an unknown value is an error)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        from ..errors import InputError

        raise InputError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def cpu_problem() -> str | None:
    """Why this CPU cannot run the kernel (None: it can), from the instruction sets PyTorch's kernels see."""
    from ..cpu import kernel_flags

    flags = kernel_flags()
    missing = [name for flag, name in NEEDS.items() if flag not in flags]
    return f"the CPU has no {', '.join(missing)}" if missing else None


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or None
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def library_name() -> str:
    """The compiled kernel's file name: it hashes the source and the flags, so a changed kernel is built again."""
    digest = hashlib.sha256(SOURCE.read_bytes() + "\0".join(FLAGS).encode()).hexdigest()[:16]
    return f"attention_bf16-{digest}.so"


def build(where: Path, cxx: str) -> Path:
    """Compile the kernel into ``where`` with ``cxx`` (unless it is there already); raises OSError, RuntimeError
    or subprocess.SubprocessError. Any x86-64 host builds it: the flags name the instructions, not the host."""
    where.mkdir(parents=True, exist_ok=True)
    target = where / library_name()
    if target.exists():
        return target
    tmp = where / f".{target.name}.{os.getpid()}.tmp"
    done = subprocess.run([cxx, *FLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True,
                          timeout=COMPILE_TIMEOUT_S)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip()[:200])
        raise RuntimeError(f"the C++ compiler failed: {first}")
    os.replace(tmp, target)  # atomic: a process racing this one loads either file, never half of one
    return target


def _cache_folder() -> Path:
    """``<cache dir>/kernels``, or a private temporary folder where the cache cannot be written."""
    from ..cachedir import cache_dir

    where = cache_dir() / "kernels"
    try:
        where.mkdir(parents=True, exist_ok=True)
        probe = where / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
        return where
    except OSError:  # a read-only cache: build into a private temporary folder, every run
        return Path(tempfile.mkdtemp(prefix="cosyllama-kernels-"))


def _find_or_build() -> Path:
    """The kernel built beside its source at install time (a container image does that: the run has no
    compiler), else in the cache directory, else built there now; raises where none is and none can be built."""
    if not SOURCE.is_file():
        raise RuntimeError("its source is not in this install")
    cache = _cache_folder()
    for where in (PREBUILT, cache):
        if (where / library_name()).exists():
            return where / library_name()
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler to build it (install g++)")
    return build(cache, cxx)


@functools.lru_cache(maxsize=None)
def library() -> tuple[ctypes.CDLL | None, str | None]:
    """The loaded kernel and None, or None and why it cannot run here."""
    problem = cpu_problem()
    if problem:
        return None, problem
    try:
        lib = ctypes.CDLL(str(_find_or_build()))
        if lib.cosyllama_attention_version() != ABI_VERSION:
            return None, "the built kernel answers another interface version"
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, str(e) or type(e).__name__
    fn = lib.cosyllama_attention_bf16
    fn.restype = ctypes.c_int
    return lib, None


_I64x3 = ctypes.c_int64 * 3


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_len: torch.Tensor | None = None,
              scale: float | None = None,
              before: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """softmax(q k^T scale) v over bf16 ``q (B, H, M, D)``, ``k``, ``v (B, H, N, D)`` (any strides but a unit
    channel stride), query row ``i`` seeing keys ``0 .. row_len[i]-1`` (int32 ``(M,)``; None: all N). ``before``:
    keys and values ``(B, H, N0, D)`` that come before ``k`` and ``v`` (read in place: a streaming call's cached
    frames, not joined to the new ones by a copy), so N = N0 + ``k``'s frames. Returns ``(B, H, M, D)`` bf16, laid
    out M-major as PyTorch's attention returns it (so ``.transpose(1, 2)`` is contiguous); None where the kernel
    cannot take these tensors or cannot run here (call PyTorch's)."""
    lib, _ = library()
    if lib is None:
        return None
    b, h, m, d = q.shape
    k0, v0 = before if before is not None else (k[:, :, :0], v[:, :, :0])
    n0 = k0.shape[2]
    n = n0 + k.shape[2]
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.stride(3) != 1 for t in (q, k, v, k0, v0)):
        return None
    if (k.shape[:2] != (b, h) or k.shape[3] != d or v.shape != k.shape or k0.shape != (b, h, n0, d)
            or v0.shape != k0.shape or d % 16 or min(b, h, m, n) == 0):
        return None
    if row_len is not None:
        row_len = row_len.to(torch.int32).contiguous()
        if row_len.shape != (m,):
            return None
    out = torch.empty(b, m, h, d, dtype=torch.bfloat16)
    view = out.transpose(1, 2)
    with torch.profiler.record_function(PROFILE_NAME):  # so `bench --profile` counts it as attention
        rc = lib.cosyllama_attention_bf16(
            *(ctypes.c_void_p(t.data_ptr()) for t in (q, k0, v0, k, v, out)), b, h, m, n0, n, d,
            *(_I64x3(*t.stride()[:3]) for t in (q, k0, v0, k, v, view)),
            None if row_len is None else ctypes.c_void_p(row_len.data_ptr()),
            ctypes.c_float(d ** -0.5 if scale is None else scale), max(1, torch.get_num_threads()),
            ctypes.c_void_p(_team()))
    return view if rc == 0 else None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           row_len: torch.Tensor | None, kernel: bool,
           before: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The flow solver's attention: on the kernel where ``kernel`` (with ``row_len``, :func:`attention`) and it takes
    these tensors, else PyTorch's with ``mask`` (the same visible keys, as an additive mask or None). ``before``:
    keys and values in front of ``k`` and ``v`` (see :func:`attention`; joined for PyTorch's)."""
    import torch.nn.functional as F

    o = attention(q, k, v, row_len, before=before) if kernel else None
    if o is not None:
        return o
    if before is not None:
        k, v = torch.cat([before[0], k], dim=2), torch.cat([before[1], v], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@functools.lru_cache(maxsize=None)
def _team() -> int | None:
    """The address of libgomp's ``GOMP_parallel`` in the copy PyTorch's parallel regions run on, so the kernel
    works on PyTorch's own OpenMP team (see the source); None where PyTorch is not on libgomp (the kernel then
    starts threads of its own)."""
    from ..openmp import _loaded_libgomp

    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    for path in _loaded_libgomp():
        try:
            return ctypes.cast(ctypes.CDLL(path).GOMP_parallel, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
    return None


def chunk_row_lengths(n: int, start: int, chunk: int) -> torch.Tensor:
    """Per query frame ``start .. n-1`` the keys the block-causal chunk mask lets it see (a prefix: its own
    ``chunk``-frame block and every earlier one; cosyllama.flow.dit.chunk_attention_mask)."""
    pos = torch.arange(start, n)
    return torch.clamp((pos // chunk + 1) * chunk, max=n).to(torch.int32)


def _inputs(frames: int, heads: int, dim_head: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    # laid out as the solver's q/k/v: head-split views of one (B, frames, 3 x heads x dim_head) projection
    qkv = torch.randn(2, frames, 3, heads, dim_head, generator=g).to(torch.bfloat16)
    return tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))


def pytorch_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """A callable that runs PyTorch's attention on these bf16 tensors as the solver calls it on the CPU (keys
    padded to :data:`KEY_ALIGN` under an additive mask)."""
    import torch.nn.functional as F

    frames = k.shape[2]
    pad = (-frames) % KEY_ALIGN
    mask = None
    if pad:
        k, v = (F.pad(t, (0, 0, 0, pad)) for t in (k, v))
        mask = torch.zeros(q.shape[2], frames + pad, dtype=q.dtype)
        mask[:, frames:] = float("-inf")
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def timed_calls(frames: int, heads: int, dim_head: int, rounds: int = TIMED_ROUNDS,
                which: tuple[str, ...] = ("pytorch", "kernel"), shares: list | None = None) -> dict[str, float]:
    """Best-of-``rounds`` seconds of one bf16 attention over ``frames`` frames (both CFG rows) by PyTorch
    (``"pytorch"``) and, where it runs here, by the kernel (``"kernel"``), timed in alternation so a machine
    that slows down meanwhile slows both. ``shares``: gets the share of the CPU the process had over the timed
    rounds (CPU seconds over wall seconds x PyTorch's threads) appended."""
    q, k, v = _inputs(frames, heads, dim_head)
    calls = {"pytorch": pytorch_call(q, k, v)} if "pytorch" in which else {}
    if "kernel" in which and attention(q, k, v) is not None:  # None where it cannot run or take them
        calls["kernel"] = lambda: attention(q, k, v)
    best = {name: float("inf") for name in calls}
    for name in calls:
        calls[name]()
    wall = cpu = 0.0
    for _ in range(rounds):
        for name, call in calls.items():
            w, c, _ = timed(call)
            best[name] = min(best[name], w)
            wall, cpu = wall + w, cpu + c
    if shares is not None:  # as the flow's auto timing sums its solves (cosyllama.flow.auto.measure)
        shares.append(cpu / (wall * torch.get_num_threads()) if wall > 0 else 0.0)
    return best


@dataclass(frozen=True)
class Choice:
    """Which bf16 attention the flow runs on this CPU and why; ``seconds`` as timed (empty: not timed)."""

    kernel: bool
    why: str
    seconds: tuple[tuple[str, float], ...] = ()

    def words(self) -> str:
        """For the CPU line: ``attention bf16 kernel (...)`` or ``attention PyTorch's (...)``."""
        name = "bf16 kernel" if self.kernel else "PyTorch's"
        return f"attention {name} ({self.why})"


def _key(heads: int, dim_head: int, threads: int) -> str:
    from ..cpu import cpu_model

    return "|".join(str(x) for x in ("attention", cpu_model(), torch.__version__, threads, heads, dim_head,
                                     hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]))


_choices: dict[tuple[int, int, int, str], Choice] = {}


def for_flow(flow) -> Choice | None:
    """:func:`choice` for a loaded flow's head shape; None off the CPU or where its shape cannot be read."""
    try:
        attn = flow.decoder.estimator.transformer_blocks[0].attn
        heads, dim_head = attn.heads, attn.to_q.out_features // attn.heads
        on_cpu = flow.device.type == "cpu"
    except (AttributeError, IndexError, TypeError):
        return None
    return choice(heads, dim_head) if on_cpu else None


def choice(heads: int, dim_head: int, threads: int | None = None) -> Choice:
    """Whether the flow's bf16 attention runs on the kernel here: ``COSYLLAMA_ATTENTION`` decides where set to
    ``kernel`` or ``pytorch``; under ``auto`` (the default) both are timed once at :data:`TIMED_FRAMES` frames
    with these heads and the kernel runs when it is :data:`MIN_GAIN` x faster. The timing is cached beside the
    precision checks (``precision-checks.json``, key ``attention|<CPU>|<PyTorch>|<threads>|...``)."""
    from ..cachedir import load_records, save_record

    threads = threads or torch.get_num_threads()
    how = mode()
    memo = (heads, dim_head, threads, how)
    if memo in _choices:
        return _choices[memo]
    lib, problem = library() if how != "pytorch" else (None, None)  # no build where it would never run
    if how == "pytorch":
        out = Choice(False, f"{ENV}=pytorch")
    elif lib is None:
        out = Choice(False, f"no bf16 kernel: {problem}")
    elif how == "kernel":
        out = Choice(True, f"{ENV}=kernel")
    else:
        key = _key(heads, dim_head, threads)
        record = load_records().get(key)
        busy = ""
        if not isinstance(record, dict) or not isinstance(record.get("seconds"), dict):
            record = _measure(heads, dim_head)
            if record["cpu_share"] >= CPU_SHARE_MIN:
                save_record(key, record)
            else:  # this process goes by it; the next one times again
                busy = (f"; timed while the machine was busy, CPU {record['cpu_share']:.0%} of {threads} threads, "
                        "not kept")
        secs = record["seconds"]
        gain = secs.get("pytorch", 0.0) / secs["kernel"] if secs.get("kernel") else 0.0
        use = gain >= MIN_GAIN
        out = Choice(use, f"{gain:.2f}x PyTorch's here at {TIMED_FRAMES} frames"
                          + ("" if use else f", under the {MIN_GAIN}x it needs") + busy,
                     tuple(sorted(secs.items())))
    _choices[memo] = out
    return out


def _measure(heads: int, dim_head: int) -> dict:
    """:func:`timed_calls` at :data:`TIMED_FRAMES` with the share of the CPU the process got over its timed
    rounds (as ``--precision auto``'s timing is judged)."""
    shares: list[float] = []
    seconds = timed_calls(TIMED_FRAMES, heads, dim_head, shares=shares)
    return {"seconds": seconds, "measured_at": time.time(), "cpu_share": round(shares[0], 4) if shares else 0.0}


def main(argv: list[str] | None = None) -> int:
    """``python -m cosyllama.flow.native_attention [DIR]``: build the kernel into DIR (default: beside its source,
    where every run finds it without a compiler; what the container image does at build time)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    where = Path(args[0]) if args else PREBUILT
    cxx = _compiler()
    if cxx is None:
        print("no C++ compiler: set CXX or install g++", file=sys.stderr)
        return 1
    try:
        print(build(where, cxx))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        print(f"could not build the bf16 attention kernel: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
