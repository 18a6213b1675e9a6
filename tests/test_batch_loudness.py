"""``cosyllama batch`` loudness (docs/loudness.md): a row's ``loudness`` field or ``--loudness`` for rows without
one brings the row's audio to that target (the samples ``cosyllama synth --loudness`` writes), its result line
says the gain; a row's ``"loudness": null`` asks for none; bad values are bad rows (or exit 2 for the flag),
said as every door says them; a row's target is part of what makes it done."""


import numpy as np
import pytest
import soundfile as sf

from batch_helpers import results, run_batch, write_manifest
from cosyllama.batch.manifest import _digest, _row_digest, read_manifest
from cosyllama.cli import main
from helpers import FIXTURES, MODEL_DIR

pyln = pytest.importorskip("pyloudnorm")

EN, EN_TEXT = FIXTURES / "wavs" / "prompt_en_16k.wav", "Hello, this is a short prompt."
ROW = {"mode": "zero-shot", "prompt_wav": str(EN), "prompt_text": EN_TEXT, "greedy": True}
OWN = {"id": "own", "text": "Turn left at the second light.", "loudness": -35, **ROW}  # its own target
FLAG = {"id": "flag", "text": "The quick brown fox.", **ROW}  # takes --loudness
OFF = {"id": "off", "text": "The quick brown fox.", "loudness": None, **ROW}  # none, whatever the flag says
TARGET = -30.0  # the tiny model's noise peaks ~22 dB over its loudness: higher targets stop at the ceiling


def batch(manifest, out_dir, *extra):
    return run_batch(manifest, out_dir, "--concurrency", "2", *extra)


def lufs(path) -> float:
    audio, sr = sf.read(path, dtype="float64")
    return pyln.Meter(sr).integrated_loudness(audio)


def test_the_loudness_field_is_checked_and_the_flag_fills_rows_without_it(tmp_path):
    bad = [dict(FLAG, id="b1", loudness=-80), dict(FLAG, id="b2", loudness="loud"),
           dict(FLAG, id="b3", loudness=True), dict(FLAG, id="b4", loudness=-4.5)]
    m = write_manifest(tmp_path / "m.jsonl", [OWN, FLAG, OFF, dict(FLAG, id="int", loudness=-30),
                                              dict(FLAG, id="float", loudness=-30.0), *bad])
    plain, flagged = read_manifest(m), read_manifest(m, loudness=TARGET)
    assert {r.id: r.loudness for r in plain.rows} == {"own": -35.0, "flag": None, "off": None, "int": -30.0,
                                                      "float": -30.0}
    assert {r.id: r.loudness for r in flagged.rows} == {"own": -35.0, "flag": TARGET, "off": None, "int": -30.0,
                                                        "float": -30.0}
    assert [r.options().loudness for r in flagged.rows] == [-35.0, TARGET, None, -30.0, -30.0]
    for man in (plain, flagged):  # the messages of every other door, in the row's field name, with the line
        errs = {b.line: b.error for b in man.bad}
        assert errs[6] == ("loudness must be from -70 to -5 LUFS (e.g. -16 for speech on the web, -23 for "
                           "broadcast), got -80")
        assert errs[7] == "loudness must be a number of LUFS from -70 to -5, got 'loud'"
        assert errs[8] == "loudness must be a number of LUFS from -70 to -5, got True"
        assert errs[9].startswith("loudness must be from -70 to -5 LUFS") and errs[9].endswith("got -4.5")
    # the digest: a row without a target keeps the digest it had before loudness existed; a target as it
    # applies is part of it (the same for -30 and -30.0)
    digest = {r.id: r.digest for r in plain.rows}
    assert digest["flag"] == _digest(FLAG) and digest["off"] == _digest({k: v for k, v in OFF.items()
                                                                          if k != "loudness"})
    assert digest["int"] != _digest(dict(FLAG, id="int"))
    assert _row_digest(dict(FLAG, loudness=-30), (), -30) == _row_digest(dict(FLAG, loudness=-30.0), (), -30.0)
    fl = {r.id: r.digest for r in flagged.rows}
    assert fl["flag"] != digest["flag"] and fl["off"] == digest["off"] and fl["own"] == digest["own"]
    # a row whose own target is the flag's is the same row as one that takes it from the flag
    assert fl["flag"] == _row_digest(dict(FLAG, loudness=TARGET), (), TARGET)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("loudness")
    m = write_manifest(d / "m.jsonl", [OWN, FLAG, OFF, dict(FLAG, id="bad", loudness=-99)])
    out = d / "out"
    code = batch(m, out, "--loudness", str(TARGET))
    return {"dir": d, "manifest": m, "out": out, "code": code}


def test_each_row_is_brought_to_its_target_and_its_result_says_the_gain(run):
    out, res = run["out"], results(run["out"])
    assert run["code"] == 3  # the bad row
    assert lufs(out / "own.wav") == pytest.approx(-35.0, abs=0.2)  # 0.2 LU: through a 16-bit file
    assert lufs(out / "flag.wav") == pytest.approx(TARGET, abs=0.2)
    assert abs(lufs(out / "off.wav") - TARGET) > 3  # left at the model's level
    for rid, target in (("own", -35.0), ("flag", TARGET)):
        rec = res[rid]
        assert rec["loudness"] == target and rec["loudness_why"] == "target" and rec["loudness_held"] == 0
        # the gain took the measured loudness to the target
        assert rec["loudness_measured"] + rec["loudness_gain_db"] == pytest.approx(target, abs=0.02)
        peak = np.abs(sf.read(out / f"{rid}.wav")[0]).max()
        assert 20 * np.log10(peak) <= -1.0  # under the ceiling
    assert not {"loudness", "loudness_gain_db"} & set(res["off"])
    assert res["bad"]["status"] == "error" and res["bad"]["line"] == 4
    assert res["bad"]["error"].startswith("loudness must be from -70 to -5 LUFS")


def test_a_rows_audio_is_what_synth_writes_with_the_same_target(run, tmp_path):
    for row, flags in ((OWN, ["--loudness", "-35"]), (OFF, [])):
        single = tmp_path / f"{row['id']}.wav"
        assert main(["synth", "--model-dir", str(MODEL_DIR), "--precision", "fp32", "--out", str(single),
                     "--text", row["text"], "--mode", "zero-shot", "--prompt-wav", str(EN), "--prompt-text",
                     EN_TEXT, "--greedy", *flags]) == 0
        assert (run["out"] / f"{row['id']}.wav").read_bytes() == single.read_bytes(), row["id"]


def test_resume_follows_each_rows_target(run, tmp_path, capsys):
    out = tmp_path / "out"
    m = write_manifest(tmp_path / "m.jsonl", [OWN, FLAG, OFF])
    assert batch(m, out, "--loudness", str(TARGET)) == 0
    summary = capsys.readouterr().out
    assert "loudness: 2 row(s) brought to their target by gains of" in summary
    assert batch(m, out, "--loudness", str(TARGET)) == 0
    assert "3 already done" in capsys.readouterr().err
    stamp = (out / "own.wav").stat().st_mtime_ns
    assert batch(m, out, "--loudness", "-35") == 0  # only the row that takes the flag is made again
    assert "2 already done, 0 failed before, 1 to synthesize" in capsys.readouterr().err
    assert results(out)["flag"]["loudness"] == -35.0 and (out / "own.wav").stat().st_mtime_ns == stamp
    assert batch(m, out) == 0  # no flag: that row as it was before loudness existed
    assert "flag" in results(out) and "loudness" not in results(out)["flag"]
    assert (out / "flag.wav").read_bytes() == (run["out"] / "off.wav").read_bytes()


@pytest.mark.parametrize("value, message", [
    ("-80", "--loudness must be from -70 to -5 LUFS"),
    ("nan", "--loudness must be a finite number of LUFS"),
])
def test_a_bad_loudness_flag_exits_2_before_the_model(run, tmp_path, capsys, monkeypatch, value, message):
    import cosyllama.batch.engine as engine

    monkeypatch.setattr(engine, "load_models", lambda *a: pytest.fail("the model was loaded"))
    assert batch(run["manifest"], tmp_path / "o", "--loudness", value) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_without_the_extra_a_target_says_how_to_install_it(run, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pyloudnorm", None)  # as if not installed
    m = write_manifest(tmp_path / "m.jsonl", [OWN])  # a row's own target is enough
    assert batch(m, tmp_path / "o") == 2
    assert "pip install 'cosyllama[loudness]'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert batch(write_manifest(tmp_path / "plain.jsonl", [FLAG]), tmp_path / "o", "--dry-run") == 0
