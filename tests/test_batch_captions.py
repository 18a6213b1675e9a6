"""``cosyllama batch`` captions: a row's ``captions`` field or ``--captions`` writes ``<id>.<fmt>`` beside its
audio (word times where they align; the tiny model speaks noise, so a row may have sentence times only, and
its record says why), atomically; the record lists them; a row counts as done only with its caption files;
a bad value is a bad row."""

import io
import json

import numpy as np
import pytest
import soundfile as sf

from batch_helpers import results, run_batch, write_manifest
from cosyllama.batch.manifest import Row, read_manifest
from helpers import FIXTURES

EN, EN_TEXT = FIXTURES / "wavs" / "prompt_en_16k.wav", "Hello, this is a short prompt."
ROW = {"mode": "zero-shot", "prompt_wav": str(EN), "prompt_text": EN_TEXT, "greedy": True}
R1 = {"id": "r1", "text": "Turn left at the light. Then go straight on.", "captions": ["vtt", "srt", "json"], **ROW}
R2 = {"id": "r2", "text": "The quick brown fox.", **ROW}


def batch(manifest, out_dir, *extra):
    return run_batch(manifest, out_dir, "--concurrency", "2", *extra)


def test_the_captions_field_is_checked_and_the_flag_fills_rows_without_it(tmp_path):
    lines = [dict(R1, id="a"), dict(R2, id="b"), dict(R2, id="c", captions="vtt"), dict(R2, id="d", captions=[]),
             dict(R2, id="e", captions=["srt", "txt"]), dict(R2, id="f", captions=5),
             dict(R2, id="g", captions=["json", "json", "srt"]), dict(R2, id="h", captions=None)]
    m = write_manifest(tmp_path / "m.jsonl", lines)
    plain = read_manifest(m)
    flagged = read_manifest(m, captions=("srt",))
    caps = {r.id: r.captions for r in plain.rows}
    assert caps == {"a": ("srt", "vtt", "json"), "b": (), "c": ("vtt",), "d": (), "g": ("srt", "json"), "h": ()}
    assert {r.id: r.captions for r in flagged.rows} == dict(caps, b=("srt",), h=("srt",))  # [] says "none"
    for m_ in (plain, flagged):
        errs = {b.id: b.error for b in m_.bad}
        assert errs["e"] == "captions: unknown caption format(s) 'txt'; use srt, vtt, json"
        assert errs["f"] == "captions must be a format or a list of them (srt, vtt, json), got 5"
    # a row's digest follows the captions that apply to it; a row without any keeps its digest of before
    digest = {r.id: r.digest for r in plain.rows}
    assert {r.id: r.digest for r in flagged.rows}["b"] != digest["b"]
    from cosyllama.batch.manifest import _digest

    for rid in ("b", "d", "h"):
        assert digest[rid] == _digest(dict(R2, id=rid))
    row = plain.rows[0]
    assert Row.from_json(row.to_json()) == row and row.options().word_times  # as a Ray actor gets it
    assert not plain.rows[1].options().word_times


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("captions")
    m = write_manifest(d / "m.jsonl", [R1, R2, {"id": "bad", "text": "Hi.", "captions": "txt", **ROW}])
    out = d / "out"
    code = batch(m, out, "--captions", "json")
    return {"dir": d, "manifest": m, "out": out, "code": code}


def test_caption_files_beside_the_audio_read_back_and_end_with_it(run):
    import srt
    import webvtt

    out = run["out"]
    assert run["code"] == 3  # the bad row
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "r1.json", "r1.srt", "r1.vtt", "r1.wav", "r2.json", "r2.wav", "results.jsonl"]
    frames = {rid: sf.info(out / f"{rid}.wav").frames for rid in ("r1", "r2")}
    for rid in ("r1", "r2"):
        doc = json.loads((out / f"{rid}.json").read_text())
        assert set(doc) == {"level", "sample_rate", "segments"} and doc["sample_rate"] == 24000
        segs = doc["segments"]
        assert segs and segs[0]["start_sample"] == 0 and segs[-1]["end_sample"] == frames[rid]
        for a, b in zip(segs, segs[1:]):
            assert a["end_sample"] == b["start_sample"]
        for s in segs:
            assert {"text", "start", "end", "start_sample", "end_sample", "words"} <= set(s)
    n_segs = len(json.loads((out / "r1.json").read_text())["segments"])
    subs = list(srt.parse((out / "r1.srt").read_text(encoding="utf-8")))
    cues = list(webvtt.from_buffer(io.StringIO((out / "r1.vtt").read_text(encoding="utf-8"))))
    assert len(subs) == len(cues) >= n_segs >= 1
    assert subs[-1].end.total_seconds() == pytest.approx(frames["r1"] / 24000, abs=1e-3)
    assert "Turn left" in subs[0].content and "Turn left" in cues[0].text

    res = results(out)
    assert res["r1"]["captions"] == ["r1.srt", "r1.vtt", "r1.json"] and res["r2"]["captions"] == ["r2.json"]
    for rid in ("r1", "r2"):
        rec = res[rid]
        assert rec["status"] == "ok" and rec["bytes"] == (out / f"{rid}.wav").stat().st_size
        assert rec["seconds"]["align"] >= 0
        doc = json.loads((out / f"{rid}.json").read_text())
        assert rec["caption_level"] == doc["level"]
        if rec["caption_level"] == "segment":  # the tiny model speaks noise: its words may not align
            whys = {s["words_why"] for s in doc["segments"] if s["words"] is None}
            assert rec["words_why"] == sorted(whys) and all(w.strip() for w in rec["words_why"])
        else:
            assert "words_why" not in rec


def test_a_bad_captions_value_is_a_bad_row_said_plainly(run, capsys):
    bad = results(run["out"])["bad"]
    assert bad["status"] == "error" and bad["stage"] == "manifest"
    assert bad["error"] == "captions: unknown caption format(s) 'txt'; use srt, vtt, json"
    assert batch(run["manifest"], run["out"], "--captions", "json", "--dry-run") == 2
    err = capsys.readouterr().err
    assert f"{run['manifest']}:3: row 'bad': captions: unknown caption format(s) 'txt'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag", ["srt,txt", ",", "SRT"])
def test_a_bad_captions_flag_exits_2(run, tmp_path, capsys, flag):
    assert batch(run["manifest"], tmp_path / "o", "--captions", flag) == 2
    err = capsys.readouterr().err
    assert "--captions" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_resume_needs_the_caption_files_and_follows_their_formats(run, tmp_path, capsys):
    out = tmp_path / "out"
    m = write_manifest(tmp_path / "m.jsonl", [R1, R2])
    assert batch(m, out, "--captions", "json") == 0
    first = results(out)
    words = sum(r["caption_level"] == "word" for r in first.values())
    assert f"captions for 2 row(s), word times in {words}" in capsys.readouterr().out
    assert batch(m, out, "--captions", "json") == 0
    assert "2 already done" in capsys.readouterr().err
    (out / "r1.srt").unlink()  # a row is done only with every caption file it asks for
    assert batch(m, out, "--captions", "json") == 0
    assert "1 already done, 0 failed before, 1 to synthesize" in capsys.readouterr().err
    assert (out / "r1.srt").is_file() and results(out)["r1"]["captions"] == first["r1"]["captions"]
    # other captions for the rows without the field: r2 is made again, with the same audio
    wav = (out / "r2.wav").read_bytes()
    assert batch(m, out, "--captions", "srt") == 0
    assert "1 already done, 0 failed before, 1 to synthesize" in capsys.readouterr().err
    assert results(out)["r2"]["captions"] == ["r2.srt"] and (out / "r2.wav").read_bytes() == wav
    assert batch(m, out) == 0  # no captions: r2 as it was before captions existed
    assert results(out)["r2"].get("captions") is None and "captions" not in results(out)["r2"]
    assert not list(out.glob(".*.part"))


def test_an_abandoned_row_leaves_no_caption_file(tmp_path):
    """A row that finished but was never recorded loses its caption files with its audio; a row abandoned
    while it writes publishes none."""
    from types import SimpleNamespace

    from cosyllama.batch import engine as batch_engine
    from cosyllama.captions import Segment

    audio = np.zeros(4800, np.float32)
    segs = [Segment(0, "One.", 0, 2400, 24000, words_why="no words here"), Segment(1, "Two.", 2400, 4800, 24000)]
    timings = SimpleNamespace(tokens=[[1]], frontend=0, llm=0, token2wav=0.5, align=0.25, retries=[])
    syn = SimpleNamespace(audio=lambda: audio, timings=timings, segments=segs)
    tts = SimpleNamespace(sample_rate=24000, run=lambda request, cancel: syn)
    synth = batch_engine.RowSynthesizer(tts, tmp_path, "wav")
    rec = synth.run(Row(line=1, id="done", text="hi", mode="cross-lingual", voice="v", captions=("srt", "json")))
    assert rec["captions"] == ["done.srt", "done.json"] and rec["caption_level"] == "segment"
    assert rec["words_why"] == ["no words here"]
    assert rec["seconds"]["flow_vocoder"] == 0.25 and rec["seconds"]["align"] == 0.25
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done.json", "done.srt", "done.wav"]
    synth.abandon(["done"])
    assert list(tmp_path.iterdir()) == []
    assert synth.run(Row(line=2, id="late", text="hi", mode="cross-lingual", voice="v", captions=("vtt",))) is None
    assert list(tmp_path.iterdir()) == []


def test_ray_writes_the_same_captions(run, tmp_path):
    pytest.importorskip("ray.data", reason="Ray is not installed: pip install 'cosyllama[ray]'")
    import torch

    out = tmp_path / "out"
    m = write_manifest(tmp_path / "m.jsonl", [R1])
    assert batch(m, out, "--ray", "--ray-cpus", str(torch.get_num_threads()), "--ray-batch-size", "1") == 0
    # the same audio and sentence times; the word times are not compared: on the tiny model's noise they hang on
    # float rounding in the resampling, which differs with the actor's thread count (on speech they do not:
    # tests/test_align.py)
    for name in ("r1.wav", "r1.srt", "r1.vtt"):
        assert (out / name).read_bytes() == (run["out"] / name).read_bytes(), name

    def sentences(path):
        doc = json.loads(path.read_text())
        return [{k: v for k, v in seg.items() if k not in ("words", "words_why")} for seg in doc["segments"]]

    assert sentences(out / "r1.json") == sentences(run["out"] / "r1.json")
    keep = ("captions", "digest", "bytes")
    assert {k: results(out)["r1"].get(k) for k in keep} == {k: results(run["out"])["r1"].get(k) for k in keep}
