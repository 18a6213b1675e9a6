"""Which CPU path runs: the instruction sets this CPU has, the kernels PyTorch and llama.cpp picked,
and the precision chosen for the flow and the vocoder (and why).

Speed differs several-fold between CPU classes (an AVX2-only CPU computes bf16 by emulation, so
``--precision auto`` stays on float32 there), so ``demo``, ``bench`` and ``synth`` print this next
to their timings: a slow machine must be told apart from a broken install. The benchmark tables in
docs/benchmarks.md are keyed by the class :func:`cpu_class` names.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# /proc/cpuinfo flag -> the name people know it by, in the order they are printed.
ISA_FLAGS = (
    ("avx2", "AVX2"), ("fma", "FMA"), ("avx_vnni", "AVX-VNNI"), ("avx512f", "AVX-512"),
    ("avx512_vnni", "AVX512-VNNI"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16"),
    ("amx_int8", "AMX-INT8"),
)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# Environment variables that force PyTorch / oneDNN / MKL down to a smaller instruction set.
ISA_OVERRIDES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


@functools.lru_cache(maxsize=None)
def _cpuinfo_field(name: str) -> str | None:
    """The value of ``name`` for the first CPU in ``/proc/cpuinfo`` (None where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name):
            return line.split(":", 1)[1].strip()
    return None


def cpu_flags() -> frozenset[str]:
    """The ``flags`` of the first CPU in ``/proc/cpuinfo`` (empty where there is none, e.g. macOS).

    What the kernel reports, not what the kernels see: PyTorch, oneDNN, fbgemm and ggml choose from CPUID, and the
    two differ under an emulator (QEMU's user mode passes the host's file through while the emulated process's
    CPUID is the emulated CPU's) or where a hypervisor masks CPUID. Decisions that depend on a kernel read
    :func:`kernel_flags`, :func:`has_vnni` or :func:`onednn_bf16_reorder_ok` instead."""
    return frozenset((_cpuinfo_field("flags") or "").split())


# PyTorch's names for the features (torch.cpu.get_capabilities) that /proc/cpuinfo spells otherwise.
_TORCH_FEATURE_NAMES = {"fma3": "fma", "avx512_f": "avx512f", "avx512_bw": "avx512bw", "avx512_vl": "avx512vl",
                        "avx512_dq": "avx512dq", "avx512_cd": "avx512cd"}


@functools.lru_cache(maxsize=None)
def kernel_flags() -> frozenset[str]:
    """The instruction sets as the kernels see them, in /proc/cpuinfo's names: :func:`cpu_flags` with every
    feature PyTorch reports (``torch.cpu.get_capabilities``: CPUID through its cpuinfo library, which for AVX-512
    and AMX also checks that the OS enabled their registers) set to PyTorch's answer. /proc/cpuinfo alone where
    torch is not importable or has no such report."""
    flags = set(cpu_flags())
    try:
        import torch

        caps = torch.cpu.get_capabilities()
    except (ImportError, AttributeError, RuntimeError):
        return frozenset(flags)
    for name, value in caps.items():
        if isinstance(value, bool):
            (flags.add if value else flags.discard)(_TORCH_FEATURE_NAMES.get(name, name))
    return frozenset(flags)


def cpu_model() -> str:
    import platform

    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def isa_names(flags: frozenset[str] | None = None) -> list[str]:
    """The vector/matrix instruction sets the kernels see (:func:`kernel_flags`), e.g. ``['AVX2', 'FMA', 'AVX-512',
    'AVX512-BF16']``."""
    flags = kernel_flags() if flags is None else flags
    return [name for flag, name in ISA_FLAGS if flag in flags]


def cpu_class(flags: frozenset[str] | None = None) -> str:
    """The benchmark class of this CPU: ``AMX``, ``AVX512-BF16``, ``AVX-512``, ``AVX2`` or ``baseline``
    (the rows of docs/benchmarks.md), by the instruction sets the kernels see (:func:`kernel_flags`)."""
    flags = kernel_flags() if flags is None else flags
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    if "avx512f" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    return "baseline"


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that still include bf16 dot products.
_ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "ALL",
                     "DEFAULT")


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16). For this
    process (``flags`` None), as the kernels see them (:func:`kernel_flags`), and also False when
    ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA caps oneDNN below them: such a run computes bf16 by emulation,
    as an older CPU would."""
    if flags is None:
        if _onednn_cap() not in ("",) + _ONEDNN_BF16_ISAS:
            return False
        flags = kernel_flags()
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def _onednn_cap() -> str:
    """The oneDNN ISA cap this process runs under (``""``: none)."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()


VNNI_FLAGS = ("avx512_vnni", "avx_vnni")


def has_vnni(flags: frozenset[str] | None = None) -> bool:
    """True when the int8 dot product adds u8 x s8 products straight into int32 (AVX512-VNNI or AVX-VNNI).
    Without VNNI, oneDNN's and fbgemm's int8 kernels multiply with ``vpmaddubsw``, which adds each pair of
    adjacent products in int16 with saturation: two full 8-bit activations against large weights
    (2 x 255 x 127 > 32767) lose the excess. The static int8 engine quantizes to the full 8 bits, so it needs
    VNNI (:func:`cosyllama.flow.fast_dit.int8_engine_problem`).

    For this process (``flags`` None) the answer is oneDNN's own: one small static int8 product whose every pair
    overflows int16, exact with VNNI and saturated without, so it holds under an emulator, a hypervisor's CPUID
    mask and ONEDNN_MAX_CPU_ISA alike. Where PyTorch lacks oneDNN's quantized linear: :func:`kernel_flags`."""
    if flags is not None:
        return any(f in flags for f in VNNI_FLAGS)
    seen = _onednn_int8_pairs_exact()
    return any(f in kernel_flags() for f in VNNI_FLAGS) if seen is None else seen


@functools.lru_cache(maxsize=None)
def _onednn_int8_pairs_exact() -> bool | None:
    """oneDNN's static u8 x s8 product on all-255 activations and all-127 weights: True if exact (VNNI), False if
    the pair sums saturated at 32767, None where PyTorch has no such product. Cached: the CPU does not change."""
    try:
        import torch

        ops = torch.ops.onednn
        rows, k, n = 32, 256, 64  # a block of the DiT's kind, large enough for oneDNN's real (JIT) kernels
        packed = ops.qlinear_prepack(torch.full((n, k), 127, dtype=torch.int8), None)
        y = ops.qlinear_pointwise(torch.full((rows, k), 255, dtype=torch.uint8), 1.0, 0, packed,
                                  torch.ones(n), torch.zeros(n, dtype=torch.int32), None, 1.0, 0, torch.float32,
                                  "none", [], "")
    except (AttributeError, RuntimeError):
        return None
    exact = float(k * 255 * 127)
    return bool(torch.all(y == exact))


def onednn_bf16_reorder_ok(flags: frozenset[str] | None = None) -> bool:
    """True when oneDNN's bf16 linear can pack its weight (``torch.ops.mkldnn._reorder_linear_weight`` on bf16,
    the bf16 flow's fused products): oneDNN has bf16 kernels only with AVX-NE-CONVERT or with AVX-512's
    BW + VL + DQ subsets, and elsewhere the reorder raises. For this process (``flags`` None), oneDNN's own
    check, the one the reorder raises from (``torch.ops.mkldnn._is_mkldnn_bf16_supported``: CPUID, capped by
    ONEDNN_MAX_CPU_ISA)."""
    if flags is None:
        try:
            import torch

            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (ImportError, AttributeError, RuntimeError):
            flags = kernel_flags()
    return "avx_ne_convert" in flags or {"avx512bw", "avx512vl", "avx512dq"} <= flags


def torch_kernels() -> str:
    """The vectorized kernel set PyTorch dispatched to (``AVX2``, ``AVX512``, ``DEFAULT``, ...), with
    any variable that forced it down."""
    import torch

    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        cap = "unknown"
    forced = [f"{k}={os.environ[k]}" for k in ISA_OVERRIDES if os.environ.get(k)]
    return cap + (f" (forced: {', '.join(forced)})" if forced else "")


# llama.cpp's AMX buffer type (its int8 tile kernels) traps on AMX CPUs here: SIGILL on tileloadd / tilezero in
# libggml-cpu.so, on the main and the worker threads, for any full-size Q8_0 model (llama-cpp-python 0.3.36; an open
# upstream pull request on ggml's AMX code says the tile-data permission is requested on the main thread only and
# the tile configuration can be optimised away). The buffer type exists only where the CPU has AMX-INT8 and the
# build compiled the kernels in, so models load without extra buffer types exactly there
# (docs/performance-notes.md#llamacpp-on-amx). The environment variable overrides the choice: 1 keeps them (once
# llama.cpp is fixed), 0 drops them.
LLAMA_EXTRA_BUFTS_ENV = "COSYLLAMA_LLAMA_EXTRA_BUFTS"


def llama_extra_buffer_types(features: str | None = None, flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """Whether llama.cpp models load with extra buffer types (repacked weights, AMX tiles), and why.

    ``features``: the build's features as :func:`llama_cpp_features` gives them (read when None);
    ``flags``: the CPU's (:func:`cpu_flags` when None)."""
    forced = os.environ.get(LLAMA_EXTRA_BUFTS_ENV, "").strip().lower()
    if forced in ("1", "on", "true", "yes"):
        return True, f"extra buffer types on ({LLAMA_EXTRA_BUFTS_ENV}={forced})"
    if forced in ("0", "off", "false", "no"):
        return False, f"extra buffer types off ({LLAMA_EXTRA_BUFTS_ENV}={forced})"
    flags = kernel_flags() if flags is None else flags  # ggml reads CPUID
    features = llama_cpp_features() if features is None else features
    built = {f.strip() for f in (features or "").split(",")}
    if "amx_int8" in flags and "AMX_INT8" in built:
        return False, ("extra buffer types off: this build's AMX int8 kernels crash on this CPU "
                       "(docs/performance-notes.md#llamacpp-on-amx)")
    return True, "extra buffer types on (repacked weights)"


def llama_flash_attention(flags: frozenset[str] | None = None) -> bool | None:
    """llama.cpp's flash attention for decoding on this CPU: False (off) on the AMX class, where its CPU kernel
    decoded speech Q8_0 at 30.5-30.6 tok/s against 33.5-34.1 with it off (`scripts/bench_llm_decode.py`, two
    rounds, docs/benchmarks.md#intel-amx); None (llama.cpp's own choice, on) elsewhere, where it was as fast or
    faster (AVX2 30.8 vs 28.0, AVX512-BF16 56.9 vs 52.6 tok/s)."""
    return False if cpu_class(flags) == "AMX" else None


def interleave_stages(llm_threads: int, flow_threads: int, device: str = "cpu",
                      cores: int | None = None) -> tuple[str, str]:
    """When a server's scheduler pauses decoding for flow work (a mode of
    :data:`cosyllama.llm.scheduler.INTERLEAVE_MODES`, see ``BatchScheduler.pause_for_flow``), and why.
    Where the two stages' threads together outnumber the cores, running them at once slows each:
    the first chunk of a stream, which everyone waits for, then gets the cores alone ("first"); the
    later chunks still overlap, which gave the better real-time factor on 2 cores (docs/amx.md,
    "Two cores, streaming"). With cores to spare, or the flow on a GPU, they always overlap."""
    if device != "cpu":
        return "off", "the flow runs on the GPU: the LLM decodes beside it"
    cores = cores or len(os.sched_getaffinity(0))
    if llm_threads + flow_threads > cores:
        return "first", (f"LLM {llm_threads} + flow {flow_threads} threads > {cores} cores: decoding pauses "
                         "while a stream's first chunk is made")
    return "off", f"LLM {llm_threads} + flow {flow_threads} threads fit {cores} cores: the stages overlap"


def llama_cpp_features() -> str | None:
    """The llama.cpp build's CPU features as it reports them (``AVX2 = 1 | F16C = 1 | ...`` reduced to
    the features that are on), or None when llama-cpp-python is not installed. Imports llama_cpp only
    if it is already imported or importable without side effects on torch (it is a pure extension)."""
    mod = sys.modules.get("llama_cpp")
    if mod is None:
        try:
            from .llm.llamacpp_lib import import_llama_cpp

            mod = import_llama_cpp()
        except Exception:  # not installed, or a broken build: the report says so rather than failing
            return None
    try:
        info = mod.llama_print_system_info()
        info = info.decode() if isinstance(info, bytes) else str(info)
    except Exception:
        return None
    on = llama_features_on(info)
    return ", ".join(on) if on else info.strip()


def llama_features_on(info: str) -> list[str]:
    """The features a llama.cpp system-info string (``"CPU : SSE3 = 1 | AVX512 = 0 | ..."``) reports as on, in
    its order."""
    on = []
    for part in info.replace("|", "\n").splitlines():
        if "=" in part:
            k, v = (s.strip() for s in part.split("=", 1))
            k = k.split(":")[-1].strip()  # "CPU : SSE3 = 1": the backend's name comes first
            if v == "1" and k:
                on.append(k)
    return on


# llama.cpp's report of its x86 CPU backend's instruction sets (``llama_print_system_info``: compiled in, for a
# build with one CPU backend) in /proc/cpuinfo's names; its other keys (LLAMAFILE, REPACK, OPENMP) are not ISAs.
GGML_ISA_FLAGS = {"SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX_VNNI": "avx_vnni", "AVX2": "avx2",
                  "F16C": "f16c", "FMA": "fma", "BMI2": "bmi2", "AVX512": "avx512f", "AVX512_VBMI": "avx512_vbmi",
                  "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8"}
_AVX512 = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")  # what ggml's AVX512 feature checks
_HASWELL = ("sse4_2", "avx", "f16c", "fma", "avx2", "bmi2")
# The x86 variants of a GGML_CPU_ALL_VARIANTS build (llama.cpp 0.3.36's ggml/src/CMakeLists.txt) and what each
# is compiled for. ggml loads the one with the highest score among those the CPU's CPUID allows: each feature
# adds its own power of two, a later one more (ggml-cpu/arch/x86/cpu-feats.cpp), so the newest feature decides.
GGML_CPU_VARIANTS = {
    "x64": (), "sse42": ("sse4_2",), "sandybridge": ("sse4_2", "avx"), "ivybridge": ("sse4_2", "avx", "f16c"),
    "piledriver": ("sse4_2", "avx", "f16c", "fma"), "haswell": _HASWELL, "skylakex": _HASWELL + _AVX512,
    "cannonlake": _HASWELL + _AVX512 + ("avx512_vbmi",), "cascadelake": _HASWELL + _AVX512 + ("avx512_vnni",),
    "icelake": _HASWELL + _AVX512 + ("avx512_vbmi", "avx512_vnni"),
    "cooperlake": _HASWELL + _AVX512 + ("avx512_vnni", "avx512_bf16"),
    "zen4": _HASWELL + _AVX512 + ("avx512_vbmi", "avx512_vnni", "avx512_bf16"),
    "alderlake": _HASWELL + ("avx_vnni",),
    "sapphirerapids": _HASWELL + _AVX512 + ("avx512_vbmi", "avx512_vnni", "avx512_bf16", "amx_int8"),
}
_GGML_SCORE = {"fma": 1, "f16c": 2, "sse4_2": 4, "bmi2": 8, "avx": 16, "avx2": 32, "avx_vnni": 64, "avx512f": 128,
               "avx512_vbmi": 256, "avx512_bf16": 512, "avx512_vnni": 1024, "amx_int8": 2048}


def ggml_cpu_variant(flags: frozenset[str] | None = None) -> str:
    """The variant of a run-time-dispatch llama.cpp build ggml loads on a CPU with ``flags`` (the kernels' view,
    :func:`kernel_flags`, when None): ``haswell`` on an AVX2 CPU, ``sapphirerapids`` on an AMX one, ..."""
    flags = kernel_flags() if flags is None else flags
    runnable = [name for name, needs in GGML_CPU_VARIANTS.items() if set(needs) <= flags]
    return max(runnable, key=lambda n: sum(_GGML_SCORE.get(f, 0) for f in GGML_CPU_VARIANTS[n]))


def llama_cpu_variant() -> str | None:
    """The ggml CPU variant a run-time-dispatch llama.cpp build chose for this CPU (the container image's
    build; :func:`cosyllama.llm.llamacpp_lib.cpu_variant`), or None for a build with one CPU backend."""
    if "llama_cpp" not in sys.modules:
        return None
    from .llm.llamacpp_lib import cpu_variant

    return cpu_variant()


def precision_reason(requested: str, chosen: str, device: str = "cpu", stage: str = "flow") -> str:
    """Why ``requested`` became ``chosen`` for ``stage`` on ``device``, in a few words."""
    requested = str(requested).strip().lower()
    if requested != "auto":
        return "fixed by --precision"
    if stage == "vocoder":
        return "auto keeps the vocoder at fp32: its bf16 audio is measurably worse"
    if str(device).startswith("cuda"):
        return "auto: the GPU computes bf16 natively" if chosen == "bf16" else "auto: this GPU has no bf16"
    if chosen == "bf16":
        return "auto: this CPU computes bf16 natively (" + "/".join(
            n for f, n in ISA_FLAGS if f in NATIVE_BF16_FLAGS and f in kernel_flags()) + ")"
    if chosen == "int8":
        return ("auto: int8 matrix products (no native bf16 on this CPU, where bf16 is emulated and several times "
                "slower)")
    return "auto: no native bf16 on this CPU, where bf16 is emulated and several times slower"


@dataclass
class CpuPath:
    """What a run computes with; ``lines()`` is what the CLI prints."""

    threads: int
    flow: str | None = None  # chosen flow precision (fp32/bf16/int8)
    vocoder: str | None = None
    requested: str = "auto"
    device: str = "cpu"
    llm: str | None = None  # "torch" / "llamacpp"
    flow_why: str | None = None  # why the flow runs at ``flow`` (the flow's own record; else derived)
    llama_bufts: str | None = None  # what the llama.cpp backend chose for extra buffer types, and why
    attention: str | None = None  # the flow's bf16 attention and why (native_attention.Choice.words)

    def as_dict(self) -> dict:
        d = {"cpu": cpu_model(), "cpu_class": cpu_class(), "isa": isa_names(), "native_bf16": has_native_bf16(),
             "torch_kernels": torch_kernels(), "threads": self.threads, "device": self.device}
        if self.flow:
            d["flow_precision"] = self.flow
            d["flow_precision_why"] = self.flow_why or precision_reason(self.requested, self.flow, self.device)
            if self.attention:
                d["flow_attention"] = self.attention
        if self.vocoder:
            d["vocoder_precision"] = self.vocoder
            d["vocoder_precision_why"] = precision_reason(self.requested, self.vocoder, self.device, "vocoder")
        if self.llm != "torch":
            d["llama_cpp"] = llama_cpp_features()
            d["llama_cpp_variant"] = llama_cpu_variant()
            d["llama_cpp_buffers"] = self.llama_bufts or llama_extra_buffer_types(d["llama_cpp"])[1]
        return d

    def lines(self) -> list[str]:
        d = self.as_dict()
        out = [f"cpu: {d['cpu']} | class {d['cpu_class']} | ISA {' '.join(d['isa']) or 'none of AVX2/AVX-512'}"
               f" | torch kernels {d['torch_kernels']} | {self.threads} threads"]
        if self.flow or self.vocoder:
            parts = []
            if self.flow:
                parts.append(f"flow {self.flow} ({d['flow_precision_why']})")
                if self.attention:
                    parts.append(f"flow {self.attention}")
            if self.vocoder:
                parts.append(f"vocoder {self.vocoder} ({d['vocoder_precision_why']})")
            out.append(f"precision on {self.device}: " + "; ".join(parts))
        if "llama_cpp" in d:
            out.append(f"llama.cpp build: {d['llama_cpp'] or 'llama-cpp-python not installed'}"
                       + (f" | ggml CPU variant {d['llama_cpp_variant']} (chosen at run time)"
                          if d.get("llama_cpp_variant") else "")
                       + (f" | {d['llama_cpp_buffers']}" if d["llama_cpp"] else "")
                       + (" | an OpenMP build: decodes slower beside the flow; rebuild without (docs/server.md)"
                          if "OPENMP" in (d["llama_cpp"] or "").split(", ") else ""))
        return out


def tts_path(tts, requested: str, threads: int | None = None) -> CpuPath:
    """The :class:`CpuPath` of a loaded ``TTS``."""
    import torch

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.qint8: "int8"}  # qint8: precision.INT8
    t2w = tts.token2wav
    llm = tts.llm.name  # the backend's own: "torch" for TorchLLM and StaticTorchLLM alike
    choice = getattr(t2w.flow, "precision_choice", None)
    return CpuPath(threads=threads or torch.get_num_threads(), flow=names.get(t2w.flow.precision),
                   vocoder=names.get(t2w.hift.compute_dtype), requested=requested, device=str(tts.device),
                   llm=llm, flow_why=choice.reason if choice is not None else None,
                   llama_bufts=tts.llm.extra_buffer_types_why if llm == "llamacpp" else None,
                   attention=getattr(t2w.flow, "attention_words", lambda: None)())

