"""The fidelity check and the timing behind ``--precision auto``: a lossy flow path (bf16, int8) is kept only if,
on the weights actually loaded, it solves a short synthetic input within the bound of the float32
solve (mel mean abs <= :data:`MEAN_BOUND`, max abs <= :data:`MAX_BOUND`, natural-log mel units).

Why on the loaded weights: the fixture and random-weight models say how a path behaves on *those*
weights; trained weights may have activation outliers that an 8-bit path handles worse. Cost: one
float32 and one candidate solve of :data:`CHECK_TOKENS` tokens after a :data:`CHECK_PROMPT_TOKENS`-token
prompt (a few seconds at full size on a 2-core CPU), once per weight file: the outcome is kept in
memory and in ``<cache dir>/precision-checks.json`` (cache dir: ``$COSYLLAMA_CACHE``, else
``$XDG_CACHE_HOME/cosyllama`` or ``~/.cache/cosyllama``), keyed by the weight file's path, size and
mtime, the candidate, the CPU class, PyTorch's version and :data:`CHECK_VERSION`. A flow built
without a file (or whose weights were changed after loading) is checked every time it asks.

Then ``auto`` measures instead of assuming (:func:`choose_fastest`): on the CPU it times every candidate
that passed (float32, bf16 where the CPU computes it natively, int8 on each of PyTorch's int8 engines) on
a solve of :data:`TIME_PROMPT_TOKENS` + :data:`TIME_TOKENS` tokens and keeps the fastest, so each CPU class
gets the path that is fastest there without anyone having that class at hand. Timings are cached beside
the checks, keyed as they are but by the CPU's model name rather than its class. Emulated bf16 (a CPU
without AVX512-BF16/AMX) is not timed: it ran 5x slower than float32 on AVX2 (docs/benchmarks.md), and
one timed solve would cost half a minute there. ``COSYLLAMA_AUTO=rule`` skips the timing and keeps the
class rule (:func:`cosyllama.precision.auto_candidate`), as the test suite does for reproducible paths.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..cachedir import cache_dir
from ..config import FlowConfig
from ..precision import precision_name
from ..timing import timed
from .cfm import CFM


class Flow(Protocol):
    """What the check and the timing use of a :class:`~cosyllama.flow.model.Flow` (which passes itself):
    its config, device and solver, and ``inference`` (a whole solve); ``weights_file`` and
    ``weights_file_key`` (the file it was loaded from and its weights' key then) where it has them."""

    cfg: FlowConfig
    device: torch.device
    decoder: CFM

    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, streaming: bool = False, finalize: bool = True) -> torch.Tensor: ...

MEAN_BOUND = 0.01
MAX_BOUND = 0.1
CHECK_TOKENS = 20
CHECK_PROMPT_TOKENS = 5
CHECK_SEED = 1234
CHECK_VERSION = 2  # bump when a path's arithmetic changes: older cached outcomes are then ignored

TIME_TOKENS = 50  # the timed solve: 2 s after a 1 s prompt (150 frames: attention's share is not negligible)
TIME_PROMPT_TOKENS = 25
AUTO_ENV = "COSYLLAMA_AUTO"  # "measure" (default) or "rule"

_memory: dict[str, dict] = {}


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one check: the candidate's mel against float32 on the synthetic input."""

    candidate: str
    mean_abs: float
    max_abs: float
    passed: bool
    cached: bool = False  # taken from an earlier check of the same weight file

    def summary(self) -> str:
        return (f"{self.candidate} mel vs fp32 on these weights: mean {self.mean_abs:.4f}, max {self.max_abs:.4f} "
                f"(bound {MEAN_BOUND}/{MAX_BOUND}{', cached' if self.cached else ''})")


@dataclass(frozen=True)
class Candidate:
    """A flow path ``auto`` can choose: a compute dtype and, at int8, PyTorch's int8 engine."""

    dtype: torch.dtype
    int8_engine: str | None = None

    @property
    def name(self) -> str:
        n = precision_name(self.dtype)
        return f"{n}/{self.int8_engine}" if self.int8_engine else n

    def apply(self, flow: Flow) -> None:
        flow.decoder.set_compute_dtype(self.dtype, self.int8_engine)


def _file_key(flow: Flow, candidate: torch.dtype | Candidate, what: str = "check") -> str | None:
    from ..cpu import cpu_class, cpu_model

    path = getattr(flow, "weights_file", None)
    if path is None or getattr(flow, "weights_file_key", None) != flow.decoder.weights_key():
        return None  # not loaded from a file, or changed since
    try:
        st = Path(path).stat()
    except OSError:
        return None
    dev = flow.device.type
    from . import fast_dit

    cand = candidate if isinstance(candidate, Candidate) else Candidate(candidate, flow.decoder.int8_engine)
    name = precision_name(cand.dtype)
    scheme = (cand.int8_engine or fast_dit.INT8_ENGINE, fast_dit.INT8_REDUCE_RANGE, fast_dit.INT8_WEIGHT_MAX,
              fast_dit.INT8_FP32_LAST_STEPS)
    if dev == "cpu":
        where = cpu_class() if what == "check" else cpu_model()
    else:
        where = torch.cuda.get_device_name(flow.device)
    parts = (Path(path).resolve(), st.st_size, st.st_mtime_ns, name, scheme if name == "int8" else "", dev, where,
             torch.__version__, flow.decoder.n_timesteps, CHECK_VERSION)
    if what != "check":  # a check's key has no prefix: outcomes cached before timings existed stay valid
        parts = (what,) + parts
    return "|".join(str(x) for x in parts)


def _load_disk() -> dict:
    try:
        return json.loads((cache_dir() / "precision-checks.json").read_text())
    except (OSError, ValueError):
        return {}


def _save_disk(key: str, value: dict) -> None:
    path = cache_dir() / "precision-checks.json"
    try:
        data = _load_disk()
        data[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs the check again next time


def synthetic_input(flow: Flow) -> tuple[torch.Tensor, ...]:
    """The check's deterministic input: random speech tokens, a random prompt mel around -5 and a
    random speaker embedding (token, prompt_token, prompt_feat, embedding)."""
    c = flow.cfg
    g = torch.Generator().manual_seed(CHECK_SEED)
    token = torch.randint(0, c.vocab_size, (1, CHECK_TOKENS), generator=g)
    prompt = torch.randint(0, c.vocab_size, (1, CHECK_PROMPT_TOKENS), generator=g)
    feat = torch.randn(1, c.token_mel_ratio * CHECK_PROMPT_TOKENS, c.output_size, generator=g) - 5
    return token, prompt, feat, torch.randn(1, c.spk_embed_dim, generator=g)


def _cached(key: str | None) -> dict | None:
    if key is None:
        return None
    hit = _memory.get(key) or _load_disk().get(key)
    if hit is not None:
        _memory[key] = hit
    return hit


def check_candidate(flow: Flow, candidate: torch.dtype | Candidate, reference: dict | None = None) -> CheckResult:
    """Solve :func:`synthetic_input` at float32 and at ``candidate``; leaves the flow's solver at
    ``candidate``. Uses (and fills) the per-file cache described in the module docstring.
    ``reference``: a dict that keeps the float32 solve for the next candidate of the same flow."""
    cand = candidate if isinstance(candidate, Candidate) else Candidate(candidate)
    key = _file_key(flow, cand)
    hit = _cached(key)
    if hit is not None:
        cand.apply(flow)
        return CheckResult(**{**hit, "cached": True})
    inp = synthetic_input(flow)
    ref = None if reference is None else reference.get("mel")
    if ref is None:
        flow.decoder.set_compute_dtype(torch.float32)
        ref = flow.inference(*inp)
        if reference is not None:
            reference["mel"] = ref
    cand.apply(flow)
    got = flow.inference(*inp)
    d = (got.double() - ref.double()).abs()
    mean, mx = float(d.mean()), float(d.max())
    res = CheckResult(cand.name if cand.int8_engine else precision_name(cand.dtype), mean, mx,
                      bool(mean <= MEAN_BOUND and mx <= MAX_BOUND))
    if key is not None:
        value = {k: v for k, v in asdict(res).items() if k != "cached"}
        _memory[key] = value
        _save_disk(key, value)
    return res


# ----------------------------------------------------------------------------------------------
# Timing: auto keeps the fastest path that passed


def candidates(flow: Flow) -> list[Candidate]:
    """What ``auto`` times on this flow's device, float32 first (docstring: emulated bf16 is left out)."""
    from ..precision import INT8, cpu_has_native_bf16
    from .fast_dit import INT8_ENGINES, int8_engine_problem

    out = [Candidate(torch.float32)]
    if flow.device.type != "cpu":
        return out
    if cpu_has_native_bf16():
        out.append(Candidate(torch.bfloat16))
    out += [Candidate(INT8, e) for e in INT8_ENGINES if int8_engine_problem(e) is None]
    return out


def timing_input(flow: Flow) -> tuple[torch.Tensor, ...]:
    """The timed solve's input: like :func:`synthetic_input`, :data:`TIME_PROMPT_TOKENS` + :data:`TIME_TOKENS`."""
    c = flow.cfg
    g = torch.Generator().manual_seed(CHECK_SEED + 1)
    token = torch.randint(0, c.vocab_size, (1, TIME_TOKENS), generator=g)
    prompt = torch.randint(0, c.vocab_size, (1, TIME_PROMPT_TOKENS), generator=g)
    feat = torch.randn(1, c.token_mel_ratio * TIME_PROMPT_TOKENS, c.output_size, generator=g) - 5
    return token, prompt, feat, torch.randn(1, c.spk_embed_dim, generator=g)


def time_candidate(flow: Flow, cand: Candidate) -> tuple[float, bool]:
    """Seconds of one warm solve of :func:`timing_input` on ``cand`` (leaves the flow's solver on it), and
    whether the number came from the cache."""
    key = _file_key(flow, cand, what="time")
    cand.apply(flow)
    hit = _cached(key)
    if hit is not None:
        return float(hit["seconds"]), True
    inp = timing_input(flow)
    flow.inference(*inp)  # warm: kernels chosen, buffers sized
    best = min(timed(lambda: flow.inference(*inp), flow.device)[0] for _ in range(2))
    if key is not None:
        _memory[key] = {"seconds": best}
        _save_disk(key, {"seconds": best})
    return best, False


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` chose: the candidate, its fidelity check (None for float32), the timings of every
    candidate that passed (name -> seconds), and the candidates that failed the check."""

    chosen: Candidate
    check: CheckResult | None
    seconds: dict[str, float]
    failed: tuple[CheckResult, ...] = ()
    cached: bool = False

    def summary(self) -> str:
        t = ", ".join(f"{n} {s:.2f} s" for n, s in sorted(self.seconds.items(), key=lambda kv: kv[1]))
        out = f"measured on {TIME_PROMPT_TOKENS}+{TIME_TOKENS} tokens: {t}{' (cached)' if self.cached else ''}"
        if self.failed:
            out += "; failed the fidelity check: " + ", ".join(f.summary() for f in self.failed)
        if self.check is not None:
            out += f"; {self.check.summary()}"
        return out


def choose_fastest(flow: Flow) -> AutoChoice:
    """Check every :func:`candidates` entry's fidelity, time those that pass and float32, and leave the
    flow on the fastest."""
    checks: dict[str, CheckResult] = {}
    failed = []
    timed: dict[str, tuple[Candidate, float]] = {}
    all_cached = True
    reference: dict = {}  # the float32 solve of the check's input, made at most once
    for cand in candidates(flow):
        if cand.dtype != torch.float32:
            res = check_candidate(flow, cand, reference)
            if not res.passed:
                failed.append(res)
                continue
            checks[cand.name] = res
        seconds, cached = time_candidate(flow, cand)
        all_cached = all_cached and cached
        timed[cand.name] = (cand, seconds)
    best = min(timed.values(), key=lambda cs: cs[1])[0]
    best.apply(flow)
    return AutoChoice(best, checks.get(best.name), {n: s for n, (_, s) in timed.items()}, tuple(failed), all_cached)
