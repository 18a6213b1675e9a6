"""Session-wide cache of GGUF files converted from the tiny model (shared by the GGUF tests)."""

from __future__ import annotations

import threading
from pathlib import Path

_lock = threading.Lock()
_made: dict[tuple[str, str], Path] = {}


def tiny_gguf(root: Path, model_dir: Path, layout: str, type: str) -> Path:
    """Convert once per session into ``root``; later calls return the same file."""
    from cosyllama.llm.gguf import convert

    key = (layout, type)
    with _lock:
        if key not in _made:
            root.mkdir(parents=True, exist_ok=True)
            _made[key] = convert(model_dir, root / f"tiny-{layout}-{type}.gguf", layout=layout, type=type)
        return _made[key]
