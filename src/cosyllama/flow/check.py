"""The fidelity check behind ``--precision auto``: a lossy flow path (bf16, int8) is kept only if,
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
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..precision import precision_name

if TYPE_CHECKING:
    from .model import Flow

MEAN_BOUND = 0.01
MAX_BOUND = 0.1
CHECK_TOKENS = 20
CHECK_PROMPT_TOKENS = 5
CHECK_SEED = 1234
CHECK_VERSION = 2  # bump when a path's arithmetic changes: older cached outcomes are then ignored

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


def cache_dir() -> Path:
    base = os.environ.get("COSYLLAMA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "cosyllama")
    return Path(base)


def _file_key(flow: "Flow", candidate: torch.dtype) -> str | None:
    from ..cpu import cpu_class

    path = getattr(flow, "weights_file", None)
    if path is None or getattr(flow, "weights_file_key", None) != flow.decoder.weights_key():
        return None  # not loaded from a file, or changed since
    try:
        st = Path(path).stat()
    except OSError:
        return None
    dev = flow.device.type
    from . import fast_dit

    scheme = (fast_dit.INT8_ENGINE, fast_dit.INT8_REDUCE_RANGE, fast_dit.INT8_WEIGHT_MAX, fast_dit.INT8_FP32_LAST_STEPS)
    return "|".join(str(x) for x in (Path(path).resolve(), st.st_size, st.st_mtime_ns, precision_name(candidate),
                                     scheme if precision_name(candidate) == "int8" else "",
                                     dev, cpu_class() if dev == "cpu" else torch.cuda.get_device_name(flow.device),
                                     torch.__version__, flow.decoder.n_timesteps, CHECK_VERSION))


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


def synthetic_input(flow: "Flow") -> tuple[torch.Tensor, ...]:
    """The check's deterministic input: random speech tokens, a random prompt mel around -5 and a
    random speaker embedding (token, prompt_token, prompt_feat, embedding)."""
    c = flow.cfg
    g = torch.Generator().manual_seed(CHECK_SEED)
    token = torch.randint(0, c.vocab_size, (1, CHECK_TOKENS), generator=g)
    prompt = torch.randint(0, c.vocab_size, (1, CHECK_PROMPT_TOKENS), generator=g)
    feat = torch.randn(1, c.token_mel_ratio * CHECK_PROMPT_TOKENS, c.output_size, generator=g) - 5
    return token, prompt, feat, torch.randn(1, c.spk_embed_dim, generator=g)


def check_candidate(flow: "Flow", candidate: torch.dtype) -> CheckResult:
    """Solve :func:`synthetic_input` at float32 and at ``candidate``; leaves the flow's solver at
    ``candidate``. Uses (and fills) the per-file cache described in the module docstring."""
    key = _file_key(flow, candidate)
    if key is not None:
        hit = _memory.get(key) or _load_disk().get(key)
        if hit is not None:
            _memory[key] = hit
            flow.decoder.set_compute_dtype(candidate)
            return CheckResult(**{**hit, "cached": True})
    inp = synthetic_input(flow)
    flow.decoder.set_compute_dtype(torch.float32)
    ref = flow.inference(*inp)
    flow.decoder.set_compute_dtype(candidate)
    got = flow.inference(*inp)
    d = (got.double() - ref.double()).abs()
    mean, mx = float(d.mean()), float(d.max())
    res = CheckResult(precision_name(candidate), mean, mx, bool(mean <= MEAN_BOUND and mx <= MAX_BOUND))
    if key is not None:
        value = {k: v for k, v in asdict(res).items() if k != "cached"}
        _memory[key] = value
        _save_disk(key, value)
    return res
