"""Device selection: CPU by default; CUDA only when asked for and present (never a silent fallback)."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable

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


# ----------------------------------------------------------------------------------------------
# True float32 on CUDA

_tf32_lock = threading.Lock()
_tf32_users = 0
_tf32_saved: tuple[bool, bool] | None = None


@contextlib.contextmanager
def true_fp32(device: torch.device):
    """Run the block with TF32 off for cuDNN convolutions and CUDA matrix products when ``device`` is
    CUDA (no effect elsewhere).

    PyTorch lets cuDNN convolutions use TF32 (10-bit mantissa) by default, which moves the vocoder's
    waveform far beyond the fixtures' 1e-3 on Ampere and later GPUs; our float32 paths are meant to
    be the reference computation on every device, and bf16 is the fast path. The flags are
    process-wide, so overlapping blocks (server threads) share one saved state: the first block in
    turns TF32 off, the last one out restores what the process had.
    """
    if device.type != "cuda":
        yield
        return
    global _tf32_users, _tf32_saved
    with _tf32_lock:
        if _tf32_users == 0:
            _tf32_saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        _tf32_users += 1
    try:
        yield
    finally:
        with _tf32_lock:
            _tf32_users -= 1
            if _tf32_users == 0 and _tf32_saved is not None:
                torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = _tf32_saved
                _tf32_saved = None


def on_true_fp32(method: Callable) -> Callable:
    """Decorate a method of a module with a ``device`` property so it runs under :func:`true_fp32`."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with true_fp32(self.device):
            return method(self, *args, **kwargs)
    return wrapper
