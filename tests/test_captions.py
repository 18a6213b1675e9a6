"""Sentence times (cosyllama.captions.Segment on every Synthesis) and the caption formats.

A segment's times are exact by construction: the output is the segments' audio appended in order, so the
samples between a segment's start and end are that segment's audio, streamed or not, at any speed, whichever
LLM made the tokens. The formats are read back with kept parsers (``srt``, ``webvtt-py``)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from cosyllama.captions import (
    MAX_CUE_S,
    MAX_LINE,
    CaptionError,
    Segment,
    Word,
    to_json,
    to_srt,
    to_vtt,
    write_captions,
)
from helpers import FIXTURES, MODEL_DIR

PROMPT = FIXTURES / "wavs/prompt_en_16k.wav"
# long enough for the tiny model's frontend to cut it into several segments
TEXT = ("The first sentence is short, but the second one runs on a good deal longer, with commas, clauses and "
        "asides in it, so that the frontend has to think about where to cut. Here comes a third sentence, and "
        "then the fourth one follows it closely! Is this the fifth one, or did we lose count somewhere along the "
        "way? Yes, it is the fifth, and the sixth sentence, which is also the last, ends the paragraph here. "
        "One more sentence makes sure that the text is long enough to be cut into several segments.")


@pytest.fixture(scope="module")
def tts():
    from cosyllama import load

    return load(MODEL_DIR, precision="fp32", threads=1)


def _check_exact(synthesis, n_inputs_min: int = 2) -> None:
    chunks = list(synthesis)
    audio = np.concatenate([c.samples for c in chunks])
    segs = synthesis.segments
    assert len(segs) >= n_inputs_min
    assert [s.index for s in segs] == list(range(len(segs)))
    assert segs[0].start_sample == 0 and segs[-1].end_sample == audio.size
    offset = 0
    for c in chunks:
        assert c.start == offset
        offset += c.samples.size
    for prev, seg in zip([None, *segs], segs):
        if prev is not None:
            assert seg.start_sample == prev.end_sample
        own = np.concatenate([c.samples for c in chunks if c.segment == seg.index])
        np.testing.assert_array_equal(audio[seg.start_sample:seg.end_sample], own)
        assert seg.start == seg.start_sample / 24000 and seg.end == seg.end_sample / 24000
        assert seg.text.strip() and seg.words is None
    # each segment's text is what the frontend cut, without the LLM's prompt prefix
    assert segs[0].text.startswith("The first sentence") and segs[-1].text.endswith("several segments.")
    assert all("endofprompt" not in s.text for s in segs)


@pytest.mark.parametrize("stream,speed", [(False, 1.0), (False, 1.5), (True, 1.0)])
def test_sentence_times_are_the_segments_audio_to_the_sample(tts, stream, speed):
    _check_exact(tts.cross_lingual(TEXT, PROMPT, seed=3, stream=stream, speed=speed))


def test_sentence_times_with_the_llama_cpp_llm(tiny_gguf):
    from cosyllama import load

    t = load(MODEL_DIR, precision="fp32", threads=1, llm="llamacpp", gguf=tiny_gguf("speech", "f32"))
    _check_exact(t.cross_lingual(TEXT, PROMPT, seed=3))
    _check_exact(t.cross_lingual(TEXT, PROMPT, seed=3, stream=True))


def test_segments_are_filled_as_iteration_goes_and_stop_with_close(tts):
    s = tts.cross_lingual(TEXT, PROMPT, seed=3)
    assert s.segments == []
    next(s)
    assert len(s.segments) == 1  # non-streamed: one chunk per segment, final
    s.close()
    assert len(s.segments) == 1


# -- formats ------------------------------------------------------------------------------------------------


def _segs(voice=None, words=False):
    w = (Word("Hello", 0.0, 0.4), Word("there.", 0.45, 1.0)) if words else None
    return [Segment(0, "Hello there.", 0, 24000, 24000, words=w, voice=voice),
            Segment(1, "A <second> & final line.", 24000, 60000, 24000, voice=voice)]


def test_srt_reads_back_with_the_srt_parser():
    srt = pytest.importorskip("srt")
    subs = list(srt.parse(to_srt(_segs())))
    assert [s.content for s in subs] == ["Hello there.", "A <second> & final line."]
    assert [s.start.total_seconds() for s in subs] == [0.0, 1.0]
    assert [s.end.total_seconds() for s in subs] == [1.0, 2.5]


def test_vtt_reads_back_with_webvtt_py_and_names_the_voice():
    webvtt = pytest.importorskip("webvtt")
    caps = list(webvtt.from_buffer(io.StringIO(to_vtt(_segs(voice="anna")))))
    assert [c.start for c in caps] == ["00:00:00.000", "00:00:01.000"]
    assert [c.end for c in caps] == ["00:00:01.000", "00:00:02.500"]
    assert caps[1].raw_text == "<v anna>A &lt;second&gt; &amp; final line."
    assert caps[1].voice == "anna"


def test_srt_names_the_voice_in_brackets():
    assert "[anna] Hello there." in to_srt(_segs(voice="anna"))


def test_json_schema_and_levels():
    d = json.loads(to_json(_segs()))
    assert d["level"] == "segment" and d["sample_rate"] == 24000
    assert d["segments"][0] == {"text": "Hello there.", "start": 0.0, "end": 1.0, "start_sample": 0,
                                "end_sample": 24000, "words": None}
    both = [Segment(0, "Hi.", 0, 100, 100, words=(Word("Hi.", 0.0, 0.5),))]
    assert json.loads(to_json(both))["level"] == "word"


def test_a_long_segment_is_cut_at_word_boundaries_when_word_times_exist():
    words = tuple(Word(f"word{i:02d}", i * 0.5, i * 0.5 + 0.4) for i in range(40))
    text = " ".join(w.word for w in words)
    seg = Segment(0, text, 0, 20 * 24000, 24000, words=words)
    srt = pytest.importorskip("srt")
    subs = list(srt.parse(to_srt([seg])))
    assert len(subs) > 1
    assert " ".join(" ".join(s.content.split()) for s in subs) == text  # every word once, in order
    for s in subs:
        assert (s.end - s.start).total_seconds() <= MAX_CUE_S + 1e-9
        lines = s.content.splitlines()
        assert len(lines) <= 2 and all(len(ln) <= MAX_LINE for ln in lines)
    assert subs[0].start.total_seconds() == 0 and subs[-1].end.total_seconds() == 20.0
    # without word times the segment stays one cue (nothing guessed), its lines wrapped
    one = list(srt.parse(to_srt([Segment(0, text, 0, 20 * 24000, 24000)])))
    assert len(one) == 1 and all(len(ln) <= MAX_LINE for ln in one[0].content.splitlines())


def test_caption_files_name_their_format_and_place(tmp_path):
    with pytest.raises(CaptionError, match=r"must end in \.srt, \.vtt, \.json"):
        write_captions(tmp_path / "out.txt", _segs())
    with pytest.raises(CaptionError, match="cannot be written"):
        write_captions(tmp_path / "missing" / "out.srt", _segs())
    p = write_captions(tmp_path / "out.VTT", _segs())
    assert p.read_text().startswith("WEBVTT")


# -- the CLI ------------------------------------------------------------------------------------------------


def _synth(tmp_path, *extra):
    return ["synth", "--model-dir", str(MODEL_DIR), "--out", str(tmp_path / "o.wav"), "--precision", "fp32",
            "--threads", "1", "--prompt-wav", str(PROMPT), "--text", TEXT, "--seed", "3", *extra]


def test_cli_synth_writes_captions_that_match_the_wav(tmp_path, capsys):
    import soundfile as sf

    from cosyllama.cli import main

    assert main(_synth(tmp_path, "--captions", str(tmp_path / "o.json"))) == 0
    assert "wrote" in capsys.readouterr().out
    d = json.loads((tmp_path / "o.json").read_text())
    audio, sr = sf.read(tmp_path / "o.wav", dtype="float32")
    assert d["level"] == "segment" and len(d["segments"]) >= 2
    assert d["segments"][-1]["end_sample"] == audio.size and d["segments"][-1]["end"] == audio.size / sr
    assert main(_synth(tmp_path, "--captions", str(tmp_path / "o.srt"))) == 0
    srt = pytest.importorskip("srt")
    subs = list(srt.parse((tmp_path / "o.srt").read_text()))
    assert [round(s.start.total_seconds(), 3) for s in subs] == [round(x["start"], 3) for x in d["segments"]]


@pytest.mark.parametrize("name,message", [
    ("o.txt", r"--captions: captions '.*o\.txt': the file name must end in \.srt, \.vtt, \.json"),
    ("missing/o.srt", r"--captions: cannot write '.*o\.srt': directory '.*missing' does not exist"),
])
def test_cli_refuses_a_caption_path_before_any_work(tmp_path, capsys, name, message):
    import re

    from cosyllama.cli import main

    assert main(_synth(tmp_path, "--captions", str(tmp_path / name))) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "loaded" not in err and not (tmp_path / "o.wav").exists()


def test_captions_show_words_not_pronunciation_tokens_or_markup(tts):
    from cosyllama.text.lexicon import Lexicon

    lex = Lexicon.from_mapping({"potato": "[P][AH0][T][EY1][T][OW2]"})
    s = tts.cross_lingual("Say {tomato|[T][AH0][M][EY1][T][OW2]} and potato with <strong>care</strong> [breath] now.",
                          PROMPT, seed=3, lexicon=lex)
    s.audio()
    assert [seg.text for seg in s.segments] == ["Say tomato and potato with care now."]
