"""Compute precision of the flow and vocoder: ``fp32`` (the reference path), ``bf16`` or ``auto``.

``fp32`` is the float32 path the fixture tests hold to upstream. ``bf16`` runs the DiT's matrix
products in bfloat16 with float32 accumulation, float32 LayerNorm statistics, float32 residual stream
and float32 interfaces (noise in, mel out); the vocoder stays float32 (see ``vocoder.py``).
``auto`` picks ``bf16`` where the hardware computes it natively — a CPU with AVX512-BF16 or AMX
(Linux ``/proc/cpuinfo``), or a CUDA device that reports bf16 support — and ``fp32`` elsewhere.
"""

from __future__ import annotations

import torch

from .cpu import has_native_bf16
from .errors import InputError

PRECISIONS = ("fp32", "bf16", "auto")


def cpu_has_native_bf16() -> bool:
    """True when this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16). Linux only;
    elsewhere (no ``/proc/cpuinfo``) False, so ``auto`` stays on float32."""
    return has_native_bf16()


def resolve_precision(name: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    """Map a precision name to the compute dtype used on ``device``.

    ``"fp32"`` -> ``torch.float32``; ``"bf16"`` -> ``torch.bfloat16``; ``"auto"`` -> bfloat16 where
    ``device`` computes it natively, else float32. ``None`` means ``"fp32"``; a ``torch.dtype`` of
    float32/bfloat16 is passed through. Anything else raises :class:`InputError`.
    """
    if name is None:
        return torch.float32
    if isinstance(name, torch.dtype):
        if name in (torch.float32, torch.bfloat16):
            return name
        raise InputError(f"precision {name} is not supported; use one of {', '.join(PRECISIONS)}")
    key = str(name).strip().lower()
    aliases = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "auto": "auto"}
    if key not in aliases:
        raise InputError(f"precision {name!r} is not supported; use one of {', '.join(PRECISIONS)}")
    key = aliases[key]
    if key == "fp32":
        return torch.float32
    if key == "bf16":
        return torch.bfloat16
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if dev.type == "cpu" and cpu_has_native_bf16() else torch.float32


def precision_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"fp32"``, ``torch.bfloat16`` -> ``"bf16"``."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
