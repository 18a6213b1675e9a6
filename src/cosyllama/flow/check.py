"""The fidelity check behind ``--precision auto``: a lossy flow path (bf16, int8) is kept only if, on the
weights actually loaded, it solves a short synthetic input within the bound of the float32
solve (mel mean abs <= :data:`MEAN_BOUND`, max abs <= :data:`MAX_BOUND`, natural-log mel units).

Why on the loaded weights: the fixture and random-weight models say how a path behaves on *those*
weights; trained weights may have activation outliers that an 8-bit path handles worse. Cost: one
float32 and one candidate solve of :data:`CHECK_TOKENS` tokens after a :data:`CHECK_PROMPT_TOKENS`-token
prompt (a few seconds at full size on a 2-core CPU), once per weight file: the outcome is kept in
memory and in ``<cache dir>/precision-checks.json`` (cache dir: ``$COSYLLAMA_CACHE``, else
``$XDG_CACHE_HOME/cosyllama`` or ``~/.cache/cosyllama``), keyed by the weight file's path, size and
mtime, the candidate, the CPU class, PyTorch's version and :data:`CHECK_VERSION`. A flow built
without a file (or whose weights were changed after loading) is checked every time it asks.

What ``auto`` then does with the candidates that pass (it times them and keeps the fastest) is
:mod:`cosyllama.flow.auto`; the cache both keep their outcomes in is here (:func:`cached`, :func:`remember`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..cachedir import cache_dir, load_records, save_record
from ..config import FlowConfig
from ..precision import INT8, precision_name
from .cfm import CFM


class Flow(Protocol):
    """What the check and the timing (:mod:`cosyllama.flow.auto`) use of a :class:`~cosyllama.flow.model.Flow`
    (which passes itself): its config, device and solver, and ``inference`` (a whole solve); ``weights_file`` and
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
CHECK_VERSION = 4  # bump when a path's arithmetic changes: older cached outcomes are then ignored

CALIBRATION_TOKENS = 50  # the static int8 path's calibration solve (see calibration_input)
CALIBRATION_PROMPT_TOKENS = 25
CALIBRATION_SEED = CHECK_SEED + 2
CALIBRATION_VERSION = 1  # bump when the calibration's rule changes: older cached scales are then ignored

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

    @property
    def attention_dtype(self) -> torch.dtype:
        """The dtype its solve runs attention in (its activations' dtype, ``FastDiT.act_dtype``): bfloat16 for
        bf16 and the mixed int8 paths, float32 for the others. The one answer for ``auto``'s attention timing and
        the CPU line's attention words."""
        from .fast_dit import int8_is_mixed

        mixed = self.dtype == INT8 and self.int8_engine is not None and int8_is_mixed(self.int8_engine)
        return torch.bfloat16 if self.dtype == torch.bfloat16 or mixed else torch.float32

    def apply(self, flow: Flow) -> None:
        from .fast_dit import int8_is_static

        if self.int8_engine and int8_is_static(self.int8_engine) and self.dtype == INT8:
            flow.decoder.set_compute_dtype(self.dtype, self.int8_engine, static_scales(flow, self.int8_engine))
        else:
            flow.decoder.set_compute_dtype(self.dtype, self.int8_engine)


def file_key(flow: Flow, candidate: torch.dtype | Candidate, what: str = "check") -> str | None:
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
    if cand.int8_engine and fast_dit.int8_is_static(cand.int8_engine):
        scheme += (f"calibration{CALIBRATION_VERSION}",)  # its check depends on the scales too
    if dev == "cpu":
        where = cpu_class() if what in ("check", "calibration") else cpu_model()
    else:
        where = torch.cuda.get_device_name(flow.device)
    parts = (Path(path).resolve(), st.st_size, st.st_mtime_ns, name, scheme if name == "int8" else "", dev, where,
             torch.__version__, flow.decoder.n_timesteps, CHECK_VERSION)
    if what != "check":  # a check's key has no prefix: outcomes cached before timings existed stay valid
        parts = (what,) + parts
    return "|".join(str(x) for x in parts)


def random_input(flow: Flow, seed: int, prompt_tokens: int, tokens: int) -> tuple[torch.Tensor, ...]:
    """Deterministic flow input from ``seed``: ``tokens`` random speech tokens after a prompt of
    ``prompt_tokens``, a random prompt mel around -5 and a random speaker embedding (token,
    prompt_token, prompt_feat, embedding)."""
    c = flow.cfg
    g = torch.Generator().manual_seed(seed)
    token = torch.randint(0, c.vocab_size, (1, tokens), generator=g)
    prompt = torch.randint(0, c.vocab_size, (1, prompt_tokens), generator=g)
    feat = torch.randn(1, c.token_mel_ratio * prompt_tokens, c.output_size, generator=g) - 5
    return token, prompt, feat, torch.randn(1, c.spk_embed_dim, generator=g)


def synthetic_input(flow: Flow) -> tuple[torch.Tensor, ...]:
    """The check's input: :data:`CHECK_PROMPT_TOKENS` + :data:`CHECK_TOKENS` (see :func:`random_input`)."""
    return random_input(flow, CHECK_SEED, CHECK_PROMPT_TOKENS, CHECK_TOKENS)


def calibration_input(flow: Flow) -> tuple[torch.Tensor, ...]:
    """The static int8 path's calibration solve: :data:`CALIBRATION_PROMPT_TOKENS` + :data:`CALIBRATION_TOKENS`
    random tokens, drawn apart from the fidelity check's input (which then tests the scales on other values)."""
    return random_input(flow, CALIBRATION_SEED, CALIBRATION_PROMPT_TOKENS, CALIBRATION_TOKENS)


def static_scales(flow: Flow, engine: str) -> tuple:
    """The static int8 engine's activation scales on this flow's weights and step count: from the cache
    beside the fidelity checks (same key, plus ``calibration``), else calibrated now
    (:meth:`~cosyllama.flow.cfm.CFM.calibrate_static` on :func:`calibration_input`: one solve, about a
    second at full size on 2 cores) and cached. The flow's solver is left as it was."""
    mine = flow.decoder.calibrated_scales()  # this solver's own, e.g. of a flow built without a file
    if mine is not None:
        return mine
    key = file_key(flow, Candidate(INT8, engine), what="calibration")
    hit = cached(key)
    if hit is not None:
        from .fast_dit import static_steps

        blocks = len(flow.decoder.estimator.transformer_blocks)
        steps = static_steps(flow.decoder.n_timesteps)
        try:
            scales = _scales_from_json(hit["scales"])
            if len(scales) == blocks and all(len(b) == steps and all(len(st) == 4 for st in b) for b in scales):
                return scales
        except (KeyError, TypeError, ValueError):
            pass
        # another shape (an edited or foreign cache entry): calibrate again
    inp = calibration_input(flow)
    with torch.inference_mode():
        scales = flow.decoder.calibrate_static(lambda: flow.inference(*inp))
    if key is not None:
        value = json.loads(json.dumps({"scales": scales}))  # tuples as lists, as the disk holds them
        remember(key, value)
    return scales


def _scales_from_json(blocks) -> tuple:
    return tuple(tuple(tuple((float(s), int(z)) for s, z in step) for step in steps) for steps in blocks)


def cached(key: str | None) -> dict | None:
    """What the cache holds under ``key`` (in memory, else on disk; None: nothing, or no key)."""
    if key is None:
        return None
    hit = _memory.get(key) or load_records().get(key)
    if hit is not None:
        _memory[key] = hit
    return hit


def remember(key: str, value: dict) -> None:
    """Keep ``value`` under ``key``, in memory and on disk (a read-only cache only costs the work again)."""
    _memory[key] = value
    save_record(key, value)


def check_candidate(flow: Flow, candidate: torch.dtype | Candidate, reference: dict | None = None) -> CheckResult:
    """Solve :func:`synthetic_input` at float32 and at ``candidate``; leaves the flow's solver at
    ``candidate``. Uses (and fills) the per-file cache described in the module docstring.
    ``reference``: a dict that keeps the float32 solve for the next candidate of the same flow."""
    cand = candidate if isinstance(candidate, Candidate) else Candidate(candidate)
    key = file_key(flow, cand)
    hit = cached(key)
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
        remember(key, value)
    return res


__all__ = ["CHECK_SEED", "CHECK_TOKENS", "CHECK_PROMPT_TOKENS", "CHECK_VERSION", "MAX_BOUND", "MEAN_BOUND", "Candidate",
           "CheckResult", "Flow", "cache_dir", "cached", "calibration_input", "check_candidate", "file_key",
           "random_input", "remember", "static_scales", "synthetic_input"]
