"""Where cosyllama keeps what it makes once and reuses (random-weight models and their GGUFs, the flow's
fidelity checks and timings, demo output): ``$COSYLLAMA_CACHE``, else ``$XDG_CACHE_HOME/cosyllama``, else
``~/.cache/cosyllama``. Light on purpose (no torch): the bench scripts import it before choosing their
threading settings."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache directory (not created here)."""
    base = os.environ.get("COSYLLAMA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "cosyllama")
    return Path(base)
