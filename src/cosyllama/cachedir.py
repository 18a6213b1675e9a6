"""Where cosyllama keeps what it makes once and reuses (random-weight models and their GGUFs, the flow's
fidelity checks and timings, demo output): ``$COSYLLAMA_CACHE``, else ``$XDG_CACHE_HOME/cosyllama``, else
``~/.cache/cosyllama``. Light on purpose (no torch): the bench scripts import it before choosing their
threading settings."""

from __future__ import annotations

import json
import os
from pathlib import Path

# The flow's fidelity checks, `auto`'s verdicts, static int8 scales and the attention choice, one record per key
RECORDS = "precision-checks.json"


def cache_dir() -> Path:
    """The cache directory (not created here)."""
    base = os.environ.get("COSYLLAMA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "cosyllama")
    return Path(base)


def load_records(name: str = RECORDS) -> dict:
    """The JSON object kept in ``<cache dir>/name`` ({} where there is none or it cannot be read)."""
    try:
        return json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}


def save_record(key: str, value, name: str = RECORDS) -> None:
    """Set ``key`` in ``<cache dir>/name``, replacing the file at once (a reader never sees half of it); a
    read-only cache only costs the work again next time."""
    path = cache_dir() / name
    try:
        data = load_records(name)
        data[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:
        pass
