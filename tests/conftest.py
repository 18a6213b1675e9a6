from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "cosyvoice3-tiny"
MODEL_DIR = FIXTURES / "model"


def load_fixture(name: str) -> tuple[dict, dict]:
    """Return (arrays, json sidecar) of a fixture file base name, e.g. 'llm_greedy'."""
    import json

    arrays = dict(np.load(FIXTURES / f"{name}.npz"))
    meta = json.loads((FIXTURES / f"{name}.json").read_text())
    return arrays, meta


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return MODEL_DIR
