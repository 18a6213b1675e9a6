"""Device selection: CPU by default; CUDA only when asked for and present (never a silent fallback)."""

from __future__ import annotations

import torch

from .errors import DeviceError

ALLOWED = ("cpu", "cuda")


def resolve_device(name: str | torch.device | None = "cpu") -> torch.device:
    """Return a torch.device for ``cpu``, ``cuda`` or ``cuda:N``; raise DeviceError if unavailable."""
    if name is None:
        name = "cpu"
    try:
        dev = torch.device(name) if not isinstance(name, torch.device) else name
    except RuntimeError:
        raise DeviceError(f"device {str(name)!r} is not supported; use one of {', '.join(ALLOWED)}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise DeviceError(f"device {str(name)!r} is not supported; use one of {', '.join(ALLOWED)}")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {str(name)!r} was asked for, but this PyTorch build sees no CUDA device "
                          f"(torch {torch.__version__}); use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DeviceError(f"device {str(name)!r} does not exist; {torch.cuda.device_count()} CUDA device(s) here")
    return dev
