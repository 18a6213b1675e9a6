"""Weight copies derived from a module's parameters, rebuilt when the parameters change.

The fast flow solver and the fast vocoder stack both run on re-laid-out copies of their module's
weights (pre-packed, channels-last, low precision). One scheme tells when such a copy is stale:
:func:`weights_key` names each parameter, its storage and its in-place version counter, so
``load_state_dict`` (copies in place: the versions move), ``.to()`` / ``.cuda()`` / ``.float()``
(new storage, also where the ``Parameter`` object is kept) and an in-place edit
(``weight.mul_(...)``) all change it.
The streaming flow cache keys its frames on the same value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch
from torch import nn

T = TypeVar("T")


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor (module built under inference_mode) has no counter
        return -1


def weights_key(module: nn.Module) -> tuple:
    """A value that changes whenever one of ``module``'s parameters is replaced or modified."""
    return tuple((id(p), p.data_ptr(), _version(p)) for p in module.parameters())


class WeightCopies(Generic[T]):
    """One derived object per module, built by ``build(module, *extra)`` on first use and again
    whenever :func:`weights_key` or ``extra`` (e.g. the compute dtype) changes. It keeps the
    parameters it was built from alive, so their identities cannot be reused by new tensors."""

    def __init__(self, build: Callable[..., T]):
        self._build = build
        self.value: T | None = None
        self._key: tuple | None = None
        self._params: list[torch.Tensor] = []

    def get(self, module: nn.Module, *extra) -> T:
        key = (weights_key(module),) + extra
        if self.value is None or key != self._key:
            self.drop()
            self.value = self._build(module, *extra)
            self._key, self._params = key, list(module.parameters())
        return self.value

    def drop(self) -> None:
        self.value, self._key, self._params = None, None, []
