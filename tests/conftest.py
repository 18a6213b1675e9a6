"""Session fixtures shared by the test modules (helpers they import are in ``helpers.py``)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from helpers import MODEL_DIR

# `--precision auto` times its candidates on the CPU and keeps the fastest; which one wins on the tiny fixture
# model depends on the machine, so the suite (and the CLIs it starts) use the class rule for reproducible paths.
# tests/test_auto_timing.py measures, with the timings mocked where a choice is asserted.
os.environ.setdefault("COSYLLAMA_AUTO", "rule")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return MODEL_DIR


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """``tiny_gguf(layout, type) -> Path``: the fixture model converted to GGUF, once per session
    for each (layout, type); later calls return the same file."""
    root = tmp_path_factory.getbasetemp() / "gguf"
    made: dict[tuple[str, str], Path] = {}
    lock = threading.Lock()

    def make(layout: str, type: str) -> Path:
        from cosyllama.llm.gguf import convert

        with lock:
            if (layout, type) not in made:
                root.mkdir(parents=True, exist_ok=True)
                made[layout, type] = convert(MODEL_DIR, root / f"tiny-{layout}-{type}.gguf", layout=layout, type=type)
            return made[layout, type]

    return make
