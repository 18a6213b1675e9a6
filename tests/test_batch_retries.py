"""``cosyllama batch --retries N`` (docs/retries.md): each row's caught takes are in its result line (the fields
the HTTP door's ``retries`` list has) with the ``--retries`` they were caught under; a run with another makes
those rows again and leaves rows whose takes all passed done; a bad N is exit 2 before the model. The LLM is a
scripted token source (tests/test_takes.py's) that loops for one seed; Ray's actor is run in this process."""

import json

import numpy as np
import pytest

from batch_helpers import results, run_batch, write_manifest
from helpers import FIXTURES, MODEL_DIR
from test_takes import GOOD, LOOPING, SEED, TEXT, Scripted

EN, EN_TEXT = FIXTURES / "wavs" / "prompt_en_16k.wav", "Hello, this is a short prompt."
ROW = {"mode": "zero-shot", "text": TEXT, "prompt_wav": str(EN), "prompt_text": EN_TEXT}
LOOPS = {"id": "loops", "seed": SEED, **ROW}  # its first take loops (caught at 30 + 12 + 25 tokens)
FINE = {"id": "fine", "seed": SEED + 100, **ROW}


def batch(manifest, out_dir, *extra):
    return run_batch(manifest, out_dir, "--concurrency", "1", *extra)


@pytest.fixture
def scripted(monkeypatch):
    """Every engine's token source: LOOPING for the seed SEED, GOOD for any other."""
    import cosyllama.llm.factory as factory

    sources = []

    def make(*args, **kw):
        sources.append(Scripted(lambda seed, n: LOOPING if seed == SEED else GOOD))
        return sources[-1]

    monkeypatch.setattr(factory, "make_token_source", make)
    return sources


def test_caught_takes_are_reported_and_another_retries_makes_only_their_rows_again(scripted, tmp_path, capsys):
    m = write_manifest(tmp_path / "m.jsonl", [LOOPS, FINE])
    out = tmp_path / "out"
    assert batch(m, out) == 0  # default 0: caught, reported, kept as the reference makes it
    res = results(out)
    assert res["loops"]["retries"] == [{"segment": 0, "attempt": 0, "seed": SEED, "reason": "loop", "tokens": 67,
                                        "action": "kept", "period": 12, "start": 30}]
    assert res["loops"]["retries_allowed"] == 0
    assert not {"retries", "retries_allowed"} & set(res["fine"])
    assert res["fine"]["tokens"] == len(GOOD) < res["loops"]["tokens"]
    assert "bad takes: 1 caught in 1 row(s) (1 kept); each is in the row's retries" in capsys.readouterr().out

    assert batch(m, out) == 0
    assert "2 already done" in capsys.readouterr().err
    fine = (out / "fine.wav").stat().st_mtime_ns
    assert batch(m, out, "--retries", "2") == 0  # the row with a caught take is made again, the other is done
    assert "1 already done, 0 failed before, 1 to synthesize" in capsys.readouterr().err
    assert (out / "fine.wav").stat().st_mtime_ns == fine
    rec = results(out)["loops"]
    assert [(b["attempt"], b["seed"], b["action"]) for b in rec["retries"]] == [(0, SEED, "retried")]
    assert rec["retries_allowed"] == 2 and rec["tokens"] == len(GOOD)  # the second take's
    assert scripted[-1].seeds == [SEED, SEED + 2**20]
    assert batch(m, out, "--retries", "2") == 0
    assert "2 already done" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["6", "-1"])
def test_a_bad_retries_flag_exits_2_before_the_model(tmp_path, capsys, monkeypatch, value):
    import cosyllama.batch.engine as engine

    monkeypatch.setattr(engine, "load_models", lambda *a: pytest.fail("the model was loaded"))
    assert batch(write_manifest(tmp_path / "m.jsonl", [FINE]), tmp_path / "o", "--retries", value) == 2
    err = capsys.readouterr().err
    assert f"--retries must be an integer from 0 to 5 (each is one more take of a segment that loops or runs " \
           f"away), got {value}" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_rays_actor_gets_the_runs_retries(scripted, tmp_path):
    """What ``run_on_ray`` hands each actor (the engine options, the rows as JSON) gives the same report."""
    from cosyllama.batch.engine import EngineOptions
    from cosyllama.batch.manifest import read_manifest
    from cosyllama.batch.ray_runner import RowActor
    from cosyllama.options import LoadOptions

    [row] = read_manifest(write_manifest(tmp_path / "m.jsonl", [LOOPS])).rows
    opts = EngineOptions(LoadOptions(model_dir=MODEL_DIR, precision="fp32"), concurrency=1, retries=1)
    actor = RowActor(opts, str(tmp_path))
    try:
        [rec] = map(json.loads, actor({"row": np.array([row.to_json()], dtype=object)})["result"])
    finally:
        actor.engine.close()
    assert rec["status"] == "ok" and rec["retries_allowed"] == 1
    assert [(b["reason"], b["action"]) for b in rec["retries"]] == [("loop", "retried")]
