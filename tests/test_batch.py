"""``cosyllama batch``: manifest checks, files equal to single ``synth`` calls, results.jsonl,
resume after an interruption, retries, and the same job on a local Ray instance."""

import json
import os
import shutil

import numpy as np
import pytest
import soundfile as sf

from cosyllama.batch.manifest import read_manifest
from cosyllama.cli import main
from cosyllama.errors import InputError
from helpers import FIXTURES, MODEL_DIR

WAVS = FIXTURES / "wavs"
EN, EN_TEXT = WAVS / "prompt_en_16k.wav", "Hello, this is a short prompt."

# 12 rows, 2 of them bad. Every sampled row has a seed, so each row has one right answer.
ROWS = [
    {"id": "z1", "mode": "zero-shot", "text": "Turn left at the second light.", "prompt_wav": str(EN),
     "prompt_text": EN_TEXT, "greedy": True},
    {"id": "z2", "mode": "zero-shot", "text": "The quick brown fox.", "prompt_wav": str(EN),
     "prompt_text": EN_TEXT, "seed": 3},
    {"id": "c1", "mode": "cross-lingual", "text": "Good morning, everyone.", "prompt_wav": "ru.wav",
     "greedy": True},  # relative to the manifest's directory
    {"id": "c2", "mode": "cross-lingual", "text": "See you tomorrow.",
     "prompt_wav": str(WAVS / "prompt_zh_22k_stereo.wav"), "seed": 11},
    {"id": "i1", "mode": "instruct", "text": "今天天气很好。", "prompt_wav": str(EN),
     "instructions": "Please speak fast.", "greedy": True},
    {"id": "i2", "mode": "instruct", "text": "One two three.", "prompt_wav": "ru.wav",
     "instructions": "Speak slowly.", "seed": 5},
    {"id": "v1", "mode": "zero-shot", "text": "Hello from a registered voice.", "voice": "anna", "greedy": True},
    {"id": "v2", "mode": "cross-lingual", "text": "Another line.", "voice": "anna", "seed": 9},
    {"id": "s1", "mode": "zero-shot", "text": "Faster please.", "prompt_wav": str(EN), "prompt_text": EN_TEXT,
     "speed": 1.5, "greedy": True},
    {"id": "b1", "mode": "zero-shot", "text": "Unknown key.", "prompt_wav": str(EN), "prompt_text": EN_TEXT,
     "speaker": "x"},
    {"id": "n1", "mode": "cross-lingual", "text": "Numbers: 25 and 7.", "voice": "anna", "greedy": True},
    {"id": "b2", "mode": "shout", "prompt_wav": str(EN)},
]
BAD = {"b1", "b2"}
GOOD = [r for r in ROWS if r["id"] not in BAD]


def write_manifest(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def results(out_dir):
    return [json.loads(x) for x in (out_dir / "results.jsonl").read_text().splitlines()]


def batch(manifest, out_dir, voices, *extra):
    return main(["batch", str(manifest), "--out", str(out_dir), "--model-dir", str(MODEL_DIR),
                 "--precision", "fp32", "--voices", str(voices), "--no-progress", *extra])


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The manifest, the voice file it names, and one complete local run of it."""
    from cosyllama import load

    d = tmp_path_factory.mktemp("batch")
    shutil.copy(WAVS / "prompt_ru_24k.wav", d / "ru.wav")
    tts = load(MODEL_DIR, precision="fp32")
    tts.add_voice("anna", EN, EN_TEXT)
    tts.voices.save(d / "voices.pt")
    manifest = write_manifest(d / "manifest.jsonl", ROWS)
    out = d / "out"
    code = batch(manifest, out, d / "voices.pt", "--concurrency", "4")
    return {"dir": d, "manifest": manifest, "voices": d / "voices.pt", "out": out, "code": code}


def test_manifest_rows_are_checked_one_by_one(tmp_path):
    (tmp_path / "a.wav").write_bytes(b"")
    lines = [
        '{"id": "ok", "mode": "cross-lingual", "text": "Hi.", "prompt_wav": "a.wav"}',
        '{"id": "ok", "mode": "cross-lingual", "text": "Again.", "prompt_wav": "a.wav"}',
        'not json',
        '',
        '# a comment',
        '["a list"]',
        '{"id": "../x", "mode": "zero-shot", "text": " ", "prompt_wav": "nope.wav", "seed": -1, "speed": 4.5}',
        '{"id": "v", "mode": "zero-shot", "text": "Hi.", "voice": "nobody", "prompt_text": "t", "greedy": "yes"}',
        '{"id": "w", "mode": "instruct", "text": "Hi.", "prompt_wav": "a.wav", "voice": "anna"}',
        '{"id": "x", "mode": "cross-lingual", "text": "Hi.", "prompt_wav": "a.wav", "instructions": "Fast."}',
        '{"id": "y", "mode": "zero-shot", "text": "Hi.", "prompt_wav": "a.wav"}',
    ]
    (tmp_path / "m.jsonl").write_text("\n".join(lines), encoding="utf-8")
    m = read_manifest(tmp_path / "m.jsonl", voices={"anna"}, voice_transcripts={"anna": True})
    assert [r.id for r in m.rows] == ["ok"] and m.rows[0].prompt_wav == str(tmp_path / "a.wav")
    errs = {b.line: b.error for b in m.bad}
    assert sorted(errs) == [2, 3, 6, 7, 8, 9, 10, 11]
    assert "used again (first on line 1)" in errs[2]
    assert "not valid JSON" in errs[3] and "must be a JSON object" in errs[6]
    for part in ("id '../x' is not allowed", "text is empty", "'nope.wav' does not exist",
                 "seed must be an integer", "speed must be between 0.25 and 4.0"):
        assert part in errs[7]
    for part in ("unknown voice 'nobody'; registered voices: anna", "prompt_text goes with prompt_wav",
                 "greedy must be true or false"):
        assert part in errs[8]
    assert "either voice or prompt_wav, not both" in errs[9]
    assert "mode 'cross-lingual' takes no instructions" in errs[10]
    assert "zero-shot needs prompt_text" in errs[11]


def test_batch_equals_single_synth_calls(job, tmp_path):
    """10 files, each the audio `cosyllama synth` makes for its row with the same seed; 2 error lines."""
    out = job["out"]
    assert job["code"] == 3  # finished, but two rows are bad
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        [f"{r['id']}.wav" for r in GOOD] + ["results.jsonl"])
    res = results(out)
    assert [r["id"] for r in res] == [r["id"] for r in ROWS]  # one line per row, in manifest order
    errors = {r["id"]: r for r in res if r["status"] == "error"}
    assert set(errors) == BAD
    assert "unknown field(s) 'speaker'" in errors["b1"]["error"] and errors["b1"]["line"] == 10
    assert "mode must be one of zero-shot, cross-lingual, instruct, got 'shout'" in errors["b2"]["error"]
    assert "missing field 'text'" in errors["b2"]["error"]
    for r in res:
        if r["status"] == "ok":
            assert r["error"] is None and r["tokens"] > 0 and r["audio_seconds"] > 0
            assert set(r["seconds"]) == {"frontend", "llm", "flow_vocoder", "write", "total"}
            assert r["bytes"] == (out / r["file"]).stat().st_size
    for row in GOOD:
        single = tmp_path / f"{row['id']}.wav"
        wav = row.get("prompt_wav", str(EN))
        wav = str(job["dir"] / wav) if wav == "ru.wav" else wav
        args = ["synth", "--model-dir", str(MODEL_DIR), "--precision", "fp32", "--out", str(single),
                "--text", row["text"], "--mode", row["mode"], "--prompt-wav", wav]
        if row["mode"] == "zero-shot":
            args += ["--prompt-text", row.get("prompt_text", EN_TEXT)]
        if "instructions" in row:
            args += ["--instruct", row["instructions"]]
        args += ["--greedy"] if row.get("greedy") else ["--seed", str(row["seed"])]
        args += ["--speed", str(row.get("speed", 1.0))]
        assert main(args) == 0
        a, sr = sf.read(out / f"{row['id']}.wav", dtype="int16")
        b, _ = sf.read(single, dtype="int16")
        assert sr == 24000 and a.size > 0
        np.testing.assert_array_equal(a, b, err_msg=row["id"])
        if row.get("greedy"):  # the whole file, header included
            assert (out / f"{row['id']}.wav").read_bytes() == single.read_bytes(), row["id"]


def test_interrupted_run_resumes_without_redoing_finished_rows(job, tmp_path, monkeypatch, capsys):
    """Ctrl-C after the 4th finished row: exit 130, no partial files; the rerun leaves those files
    untouched and makes the rest, equal to an uninterrupted run."""
    from cosyllama.batch import output

    out = tmp_path / "out"
    real_append = output.ResultsLog.append
    seen = []

    def append_then_interrupt(self, rec):
        real_append(self, rec)
        if rec["status"] == "ok":
            seen.append(rec["id"])
            if len(seen) == 4:
                raise KeyboardInterrupt

    monkeypatch.setattr(output.ResultsLog, "append", append_then_interrupt)
    assert batch(job["manifest"], out, job["voices"], "--concurrency", "2") == 130
    monkeypatch.undo()
    assert "interrupted" in capsys.readouterr().err
    assert not list(out.glob(".*.part"))
    first = {r["id"]: r for r in results(out) if r["status"] == "ok"}
    assert len(first) >= 4 and len(first) < len(GOOD)
    files = {p.name for p in out.glob("*.wav")}
    assert files == {f"{i}.wav" for i in first}  # every file on disk has its result line
    stamps = {i: (out / f"{i}.wav").stat() for i in first}
    (out / ".z1.wav.part").write_bytes(b"half a file")  # as a crash would leave it

    assert batch(job["manifest"], out, job["voices"], "--concurrency", "2") == 3
    summary = capsys.readouterr().out
    assert f"{len(GOOD)} ok ({len(GOOD) - len(first)} now, {len(first)} before)" in summary
    for i, st in stamps.items():
        now = (out / f"{i}.wav").stat()
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), f"{i} was redone"
    assert not list(out.glob(".*.part"))
    res = results(out)
    assert [r["id"] for r in res] == [r["id"] for r in ROWS]
    for row in GOOD:
        assert (out / f"{row['id']}.wav").read_bytes() == (job["out"] / f"{row['id']}.wav").read_bytes()

    # a third run has nothing left to do; a file deleted by hand is made again
    (out / "v2.wav").unlink()
    assert batch(job["manifest"], out, job["voices"]) == 3
    assert f"{len(GOOD)} ok (1 now, {len(GOOD) - 1} before)" in capsys.readouterr().out


def test_a_row_writing_its_file_when_the_run_is_abandoned_publishes_none(tmp_path, monkeypatch):
    """The race behind the test above, made certain: a row has passed its checks and is encoding its
    file when the run is abandoned; it must not rename that file into place (nobody records it), and
    a finished row that was never recorded loses its file."""
    import threading
    from types import SimpleNamespace

    from cosyllama.batch import engine as batch_engine
    from cosyllama.batch import output
    from cosyllama.batch.manifest import Row

    audio = np.zeros(2400, np.float32)
    syn = SimpleNamespace(audio=lambda: audio, timings=SimpleNamespace(tokens=[[1]], frontend=0, llm=0, token2wav=0,
                                                                         retries=[]))
    tts = SimpleNamespace(sample_rate=24000, run=lambda request, cancel: syn)
    synth = batch_engine.RowSynthesizer(tts, tmp_path, "wav")
    row = Row(line=1, id="r1", text="hi", mode="cross-lingual", voice="v")

    assert synth.run(Row(line=2, id="done", text="hi", mode="cross-lingual", voice="v"))["status"] == "ok"
    encoding, go_on = threading.Event(), threading.Event()
    real_write = output.write_file

    def slow_write(*a, **k):
        encoding.set()
        assert go_on.wait(30)
        return real_write(*a, **k)

    monkeypatch.setattr(output, "write_file", slow_write)
    got = []
    th = threading.Thread(target=lambda: got.append(synth.run(row)))
    th.start()
    assert encoding.wait(30)
    synth.abandon(["r1", "done"])  # "done" finished but its record never reached the log
    go_on.set()
    th.join(30)
    assert got == [None]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_ctrl_c_keeps_finished_rows_and_leaves_no_partial_file(job, tmp_path, monkeypatch, capsys):
    """A real SIGINT to a running `cosyllama batch`: exit 130, every file on disk complete and
    recorded (resuming is tested above). Deterministic whatever the machine's speed: one row waits
    at a gate until the interrupt has been seen, so the run cannot finish before the signal lands."""
    import signal
    import threading

    from cosyllama.batch import engine as batch_engine

    rows = [dict(r, id=f"{r['id']}-{k}") for k in range(2) for r in GOOD]
    gate_id = rows[3]["id"]  # with 2 rows at a time, at least one other row finishes before it is taken
    m = write_manifest(job["dir"] / "long.jsonl", rows)
    out = tmp_path / "out"
    at_gate, interrupted, release = threading.Event(), threading.Event(), threading.Event()
    real_synth_run, real_engine_run = batch_engine.RowSynthesizer.run, batch_engine.BatchEngine.run

    def synth_run(self, row, cancel=None):
        if row.id == gate_id:
            at_gate.set()
            assert release.wait(120), "the test never opened the gate"
        return real_synth_run(self, row, cancel)

    def engine_run(self, todo, on_result, on_interrupt=None):
        def seen(n):
            interrupted.set()
            if on_interrupt is not None:
                on_interrupt(n)
        return real_engine_run(self, todo, on_result, seen)

    def interrupter():
        try:
            # The main thread is inside the engine's loop while the gated row is in flight.
            if at_gate.wait(120) and _wait_for(lambda: (out / "results.jsonl").exists()
                                               and (out / "results.jsonl").read_text().strip()):
                os.kill(os.getpid(), signal.SIGINT)
                interrupted.wait(120)
        finally:
            release.set()

    monkeypatch.setattr(batch_engine.RowSynthesizer, "run", synth_run)
    monkeypatch.setattr(batch_engine.BatchEngine, "run", engine_run)
    # A terminal delivers Ctrl-C as KeyboardInterrupt; a shell that starts this suite in the background
    # (CI does) leaves SIGINT ignored, and the signal would never arrive. Give the test what a terminal has.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    th = threading.Thread(target=interrupter, daemon=True)
    th.start()
    try:
        code = batch(m, out, job["voices"], "--concurrency", "2")
    finally:
        signal.signal(signal.SIGINT, previous)
    th.join(30)
    err = capsys.readouterr().err
    assert interrupted.is_set() and code == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert not list(out.glob(".*.part"))
    ok = {r["id"]: r for r in results(out) if r["status"] == "ok"}
    assert 1 <= len(ok) < len(rows) and gate_id not in ok
    for p in out.glob("*.wav"):  # every file is whole and accounted for
        assert p.stem in ok and p.stat().st_size == ok[p.stem]["bytes"]
        assert sf.info(p).frames > 0


def _wait_for(cond, timeout: float = 120.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_failed_rows_are_kept_and_retried_on_request(job, tmp_path, capsys):
    (tmp_path / "noise.wav").write_bytes(b"RIFF not really a wav")
    rows = [GOOD[0], {"id": "broken", "mode": "cross-lingual", "text": "Hi.", "prompt_wav": "noise.wav"}]
    m = write_manifest(tmp_path / "m.jsonl", rows)
    out = tmp_path / "out"
    assert batch(m, out, job["voices"], "--format", "flac", "--flow-slots", "1") == 3
    res = {r["id"]: r for r in results(out)}
    assert res["z1"]["status"] == "ok" and res["broken"]["status"] == "error"
    assert res["broken"]["stage"] == "synthesis" and "noise.wav" in res["broken"]["error"]
    flac, sr = sf.read(out / "z1.flac", dtype="int16")
    np.testing.assert_array_equal(flac, sf.read(job["out"] / "z1.wav", dtype="int16")[0])
    capsys.readouterr()
    assert batch(m, out, job["voices"], "--format", "flac") == 3
    assert "1 failed before (not retried" in capsys.readouterr().err
    assert batch(m, out, job["voices"], "--format", "flac", "--retry-failed") == 3
    assert "1 to synthesize" in capsys.readouterr().err
    assert [r["id"] for r in results(out)] == ["z1", "broken"]


def test_dry_run_checks_without_synthesizing(job, tmp_path, capsys):
    out = tmp_path / "out"
    assert batch(job["manifest"], out, job["voices"], "--dry-run") == 2
    cap = capsys.readouterr()
    assert f"{job['manifest']}:10: row 'b1': unknown field(s) 'speaker'" in cap.err
    assert "12 rows: 2 invalid, 0 already done, 0 failed before, 10 to synthesize" in cap.out
    assert not out.exists()
    assert batch(job["manifest"], job["out"], job["voices"], "--dry-run") == 2
    assert "10 already done" in capsys.readouterr().out
    good = write_manifest(tmp_path / "good.jsonl", GOOD[:2] + [GOOD[6]])
    assert batch(good, out, job["voices"], "--dry-run") == 0
    vdir = tmp_path / "voices"
    vdir.mkdir()
    assert batch(good, out, vdir, "--dry-run") == 2  # an empty voices directory
    assert "holds no voice files" in capsys.readouterr().err
    shutil.copy(job["voices"], vdir / "a.pt")
    assert batch(good, out, vdir, "--dry-run") == 0  # a directory of voice files


@pytest.mark.parametrize("extra, message", [
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--model-dir", "/nonexistent"], "model directory '/nonexistent' does not exist"),
    (["--llm-weights", "llm.missing.pt"], "LLM weights"),
])
def test_cli_user_errors_exit_2(job, tmp_path, capsys, extra, message):
    assert batch(job["manifest"], tmp_path / "o", job["voices"], *extra) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_bad_paths_exit_2(job, tmp_path, capsys):
    assert batch(tmp_path / "missing.jsonl", tmp_path / "o", job["voices"]) == 2
    assert "manifest" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert batch(job["manifest"], tmp_path / "file", job["voices"]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err
    assert batch(job["manifest"], tmp_path / "o", tmp_path / "nope.pt") == 2
    assert "--voices" in capsys.readouterr().err


def test_ray_missing_gives_the_install_hint(job, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    assert batch(job["manifest"], tmp_path / "o", job["voices"], "--ray") == 2
    assert "pip install 'cosyllama[ray]'" in capsys.readouterr().err


def test_ray_local_instance_gives_the_same_files_and_results(job, tmp_path):
    pytest.importorskip("ray.data", reason="Ray is not installed: pip install 'cosyllama[ray]'")
    import torch

    out = tmp_path / "out"
    # the actor computes with as many threads as this process did (float sums depend on the split)
    cpus = str(torch.get_num_threads())
    code = batch(job["manifest"], out, job["voices"], "--ray", "--ray-actors", "1", "--ray-cpus", cpus,
                 "--concurrency", "4", "--ray-batch-size", "4")
    assert code == 3
    assert sorted(p.name for p in out.glob("*.wav")) == sorted(p.name for p in job["out"].glob("*.wav"))
    for p in job["out"].glob("*.wav"):
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    keep = ("id", "line", "status", "error", "file", "bytes", "audio_seconds", "tokens", "digest")
    strip = lambda rs: [{k: r.get(k) for k in keep} for r in rs]  # noqa: E731 (timings differ)
    assert strip(results(out)) == strip(results(job["out"]))


@pytest.mark.parametrize("name,message", [
    ("none.jsonl", "manifest '{p}' does not exist"),
    ("latin1.jsonl", "manifest '{p}' is not UTF-8 text (invalid continuation byte at byte 13); save it as UTF-8"),
    ("folder", "manifest '{p}' is a directory; give a .jsonl file"),
])
def test_a_manifest_that_cannot_be_read_is_one_clear_error(tmp_path, name, message):
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "Caf\u00e9."}\n'.encode("latin-1"))
    (tmp_path / "folder").mkdir()
    path = tmp_path / name
    with pytest.raises(InputError) as e:
        read_manifest(path)
    assert str(e.value) == message.format(p=path)
