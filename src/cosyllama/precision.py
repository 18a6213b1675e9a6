"""Compute precision of the flow and vocoder: ``fp32`` (the reference path), ``bf16``, ``int8`` or ``auto``.

``fp32`` is the float32 path the fixture tests hold to upstream. ``bf16`` runs the DiT's matrix
products in bfloat16 with float32 accumulation, float32 LayerNorm statistics, float32 residual stream
and float32 interfaces (noise in, mel out). ``int8`` runs the same four matrix products of every DiT
block on PyTorch's int8 kernels (fbgemm) in all but the last two Euler steps: weights quantized
once, one scale per output channel;
activations quantized on every call; int32 accumulation; everything between the products float32
(see :mod:`cosyllama.flow.fast_dit`). The vocoder stays float32 under ``int8`` and ``auto`` (see
:meth:`cosyllama.vocoder.hift.HiFT.set_precision`).

``auto`` picks a candidate per CPU class and keeps it only if it passes a fidelity check on the
weights actually loaded (:mod:`cosyllama.flow.check`): ``bf16`` where the hardware computes it
natively — a CPU with AVX512-BF16 or AMX (as PyTorch's kernels see it, :func:`cosyllama.cpu.kernel_flags`),
or a CUDA device that reports bf16 support — ``int8`` on other x86 CPUs (AVX2), ``fp32`` elsewhere or when the
check fails.
"""

from __future__ import annotations

import torch

from .cpu import has_native_bf16, has_vnni
from .defaults import PRECISIONS
from .errors import InputError
from .options import precision_key

# The int8 flow path's marker "dtype". Only the weights of the DiT's block matrices are int8; its
# activations, norms and interfaces are float32.
INT8 = torch.qint8
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", INT8: "int8"}


def cpu_has_native_bf16() -> bool:
    """True when this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16) as the kernels see them
    (:func:`cosyllama.cpu.has_native_bf16`); False where neither PyTorch nor /proc/cpuinfo says so, so ``auto``
    does not pick bf16."""
    return has_native_bf16()


def cpu_has_int8_vnni() -> bool:
    """True when this CPU's int8 products add u8 x s8 pairs without int16 saturation (VNNI), as oneDNN computes
    them here (:func:`cosyllama.cpu.has_vnni`). Tests stand in for it as for :func:`cpu_has_native_bf16`."""
    return has_vnni()


def int8_available() -> bool:
    """PyTorch's x86 int8 kernels (fbgemm) are in this build (PyTorch's x86 CPU wheels have them)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def _canonical(name: str | torch.dtype | None) -> str:
    if name is None:
        return "fp32"
    if isinstance(name, torch.dtype):
        if name in _NAMES:
            return _NAMES[name]
        raise InputError(f"precision {name} is not supported; use one of {', '.join(PRECISIONS)}")
    key = precision_key(str(name))  # the one vocabulary (cosyllama.defaults.PRECISIONS)
    if key is None:
        raise InputError(f"precision {name!r} is not supported; use one of {', '.join(PRECISIONS)}")
    return key


def is_auto(name: str | torch.dtype | None) -> bool:
    return isinstance(name, str) and _canonical(name) == "auto"


def resolve_precision(name: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    """Map a precision name to the compute dtype used on ``device``.

    ``"fp32"`` -> ``torch.float32``; ``"bf16"`` -> ``torch.bfloat16``; ``"int8"`` -> :data:`INT8`
    (CPU only); ``"auto"`` -> the candidate of this device (:func:`auto_candidate`; the flow keeps
    it only after its fidelity check). ``None`` means ``"fp32"``; a ``torch.dtype`` of
    float32/bfloat16/:data:`INT8` is passed through. Anything else raises :class:`InputError`.
    """
    key = _canonical(name)
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if key == "auto":
        return auto_candidate(dev)
    if key == "int8":
        if dev.type != "cpu":
            raise InputError(f"precision int8 runs on the CPU only (PyTorch's x86 int8 kernels); on {dev} use "
                             "bf16, fp32 or auto")
        if not int8_available():
            raise InputError("precision int8 needs PyTorch's fbgemm int8 kernels, which this PyTorch build "
                             f"lacks (engines: {', '.join(torch.backends.quantized.supported_engines)}); "
                             "use fp32, bf16 or auto")
        return INT8
    return torch.float32 if key == "fp32" else torch.bfloat16


def auto_candidate(device: str | torch.device = "cpu") -> torch.dtype:
    """What ``auto`` tries on ``device`` (before the fidelity check): bfloat16 where the device computes
    it natively; on another CPU int8 where PyTorch has its x86 int8 kernels; else float32."""
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    if dev.type != "cpu":
        return torch.float32
    if cpu_has_native_bf16():
        return torch.bfloat16
    return INT8 if int8_available() else torch.float32


def precision_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"fp32"``, ``torch.bfloat16`` -> ``"bf16"``, :data:`INT8` -> ``"int8"``."""
    return _NAMES[dtype]
