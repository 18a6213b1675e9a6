"""Dialogue (cosyllama.dialogue, TTS.dialogue, synth --script, POST /v1/audio/dialogue): each turn's audio is
the turn spoken alone with its seed (turn k: seed + 1000·k), the pause between turns is exactly its samples of
silence, segments name their speaker and sit where their audio is, and every bad script is refused naming its
turn before any audio."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from cli_run import run_cli
from cosyllama.dialogue import MAX_TURNS, PAUSE_SEGMENT, ScriptError, Turn, parse_script, turn_seed
from helpers import FIXTURES, MODEL_DIR, LoopbackServer

PROMPT = FIXTURES / "wavs" / "prompt_en_16k.wav"
RATE = 24000


@pytest.fixture(scope="module")
def tts():
    from cosyllama.tts import TTS
    from server_helpers import PROMPT_TEXT

    t = TTS(MODEL_DIR, threads=1, precision="fp32")
    t.add_voice("anna", PROMPT, PROMPT_TEXT)
    t.add_voice("bob", PROMPT)
    return t


# -- scripts -------------------------------------------------------------------------------------------------


def test_plain_scripts_name_a_voice_per_turn_and_continue_lines():
    s = parse_script("# a comment\nanna: Hello there, Bob.\nbob: Hi Anna! How are you?\n  I am fine.\n\nanna: Good.\n")
    assert [(t.voice, t.text) for t in s.turns] == [("anna", "Hello there, Bob."),
                                                     ("bob", "Hi Anna! How are you? I am fine."), ("anna", "Good.")]


@pytest.mark.parametrize("data", [
    [{"voice": "anna", "text": "Hi."}, {"voice": "bob", "text": "Yes.", "instructions": "Speak slowly.", "speed": 1.2}],
    {"turns": [{"voice": "anna", "text": "Hi."}, {"voice": "bob", "text": "Yes.", "instructions": "Speak slowly.",
                                                 "speed": 1.2}], "pause_between_turns": 0.5},
    {"inputs": [{"voice_id": "anna", "text": "Hi."}, {"voice_id": "bob", "text": "Yes.",
                                                      "instructions": "Speak slowly.", "speed": 1.2}]},
])
def test_json_scripts_in_three_shapes(data):
    s = parse_script(json.dumps(data))
    assert [(t.voice, t.text, t.instruction, t.speed) for t in s.turns] == [
        ("anna", "Hi.", None, None), ("bob", "Yes.", "Speak slowly.", 1.2)]


@pytest.mark.parametrize("text,message", [
    ("Hello there.\nanna: Hi.", "line 1: a script line is 'name: text'"),
    ("anna:   \nbob: Hi.", "turn 1 (voice 'anna') has no text"),
    ("", "the script has no turns"),
    ('[{"voice": "anna", "text": "Hi."}', "is not valid JSON (line 1, column 34"),
    ('{"turns": [{"voice": "anna", "text": "Hi."}], "pause_between_turns": 60}', "must be 0 to 10 seconds"),
    ('[{"voice": "anna"}]', "turn 1 needs text or input"),
    ('[{"voice": "anna", "text": "Hi.", "speed": "fast"}]', "turn 1's speed must be a number"),
    ("\n".join(f"anna: Line {i}." for i in range(MAX_TURNS + 1)), f"at most {MAX_TURNS} are allowed"),
])
def test_bad_scripts_are_refused_naming_the_place(text, message):
    with pytest.raises(ScriptError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_script(text)


def test_the_seed_rule_wraps_into_the_seed_range():
    assert turn_seed(None, 3) is None and turn_seed(5, 0) == 5 and turn_seed(5, 2) == 2005
    assert turn_seed(2**31 - 1, 1) == 999


# -- TTS.dialogue ---------------------------------------------------------------------------------------------


def test_each_turn_is_the_turn_alone_and_the_pause_is_exact(tts):
    turns = [Turn("anna", "Hello there, Bob."), Turn("bob", "Hi Anna! How are you?"), Turn("anna", "Good.")]
    s = tts.dialogue(turns, pause=0.25, seed=5)
    chunks = list(s)
    audio = np.concatenate([c.samples for c in chunks])
    alone = [tts.synthesize(t.text, voice=t.voice, seed=turn_seed(5, k)).audio() for k, t in enumerate(turns)]
    gap = int(round(0.25 * RATE))
    assert audio.size == sum(a.size for a in alone) + 2 * gap
    at = 0
    for k, a in enumerate(alone):
        np.testing.assert_array_equal(audio[at:at + a.size], a)
        at += a.size
        if k < 2:
            assert not audio[at:at + gap].any()
            at += gap
    pauses = [c for c in chunks if c.segment == PAUSE_SEGMENT]
    assert [c.samples.size for c in pauses] == [gap, gap]
    assert [seg.voice for seg in s.segments] == ["anna", "bob", "anna"]
    assert [seg.index for seg in s.segments] == [0, 1, 2]
    for seg, start in zip(s.segments, [0, alone[0].size + gap, alone[0].size + alone[1].size + 2 * gap]):
        assert seg.start_sample == start
    assert s.segments[-1].end_sample == audio.size and s.timings.first_chunk is not None


def test_captions_name_the_speaker(tts):
    from cosyllama.captions import to_srt, to_vtt

    s = tts.dialogue([Turn("anna", "Hello."), Turn("bob", "Hi.")], pause=0.1, seed=1)
    s.audio()
    assert "<v anna>Hello." in to_vtt(s.segments) and "[bob] Hi." in to_srt(s.segments)


def test_word_times_of_a_dialogue_are_placed_in_the_whole_output(tts, monkeypatch):
    import cosyllama.alignment as alignment
    from cosyllama.captions import Word

    def even(audio, rate, text, language=None, **kw):
        words, n = text.split(), len(audio) / rate
        return alignment.Alignment(tuple(Word(w, i * n / len(words), (i + 1) * n / len(words))
                                         for i, w in enumerate(words)), "en", 0.0)

    monkeypatch.setattr(alignment, "align", even)
    s = tts.dialogue([Turn("anna", "Hello there."), Turn("bob", "Hi Anna.")], pause=0.5, seed=1, word_times=True)
    s.audio()
    second = s.segments[1]
    assert second.words[0].start == pytest.approx(second.start, abs=1e-3)
    assert second.words[-1].end == pytest.approx(second.end, abs=1e-3)


def test_a_bad_turn_is_refused_before_any_audio(tts):
    with pytest.raises(ScriptError, match="turn 2 \\(voice 'zed'\\): unknown voice 'zed'"):
        tts.dialogue([Turn("anna", "Hello."), Turn("zed", "Hi.")])
    with pytest.raises(ScriptError, match="turn 1 \\(voice 'anna'\\): .*speed"):
        tts.dialogue([Turn("anna", "Hello.", speed=1.5)], stream=True)
    with pytest.raises(ScriptError, match="pause between turns must be 0 to 10 seconds"):
        tts.dialogue([Turn("anna", "Hello.")], pause=-1)


# -- synth --script ---------------------------------------------------------------------------------------------


def test_synth_script_from_another_folder(tmp_path):
    import shutil

    import soundfile as sf

    webvtt = pytest.importorskip("webvtt")
    (tmp_path / "show").mkdir()
    shutil.copy(PROMPT, tmp_path / "show" / "anna.wav")
    shutil.copy(PROMPT, tmp_path / "show" / "bob.wav")
    (tmp_path / "show" / "script.txt").write_text("anna.wav: Hello there, Bob.\nbob.wav: Hi Anna!\n")
    work = tmp_path / "work"
    work.mkdir()
    r = run_cli("synth", "--model-dir", str(MODEL_DIR), "--script", "../show/script.txt", "--pause", "0.3",
                "--out", "out.wav", "--captions", "out.vtt", "--precision", "fp32", "--threads", "1", "--seed", "2",
                cwd=work)
    assert r.returncode == 0, r.stderr
    assert "dialogue: 2 turn(s), 2 voice(s), 0.3 s between turns" in r.stderr
    audio, rate = sf.read(work / "out.wav")
    caps = list(webvtt.read(work / "out.vtt"))
    def seconds(stamp: str) -> float:
        h, m, sec = stamp.split(":")
        return 3600 * int(h) + 60 * int(m) + float(sec)

    assert [c.voice for c in caps] == ["anna", "bob"]
    assert seconds(caps[1].start) - seconds(caps[0].end) == pytest.approx(0.3, abs=1e-3)
    assert seconds(caps[1].end) == pytest.approx(audio.shape[0] / rate, abs=1e-3)


@pytest.mark.parametrize("args,message", [
    (["--script", "none.txt"], "--script 'none.txt' does not exist"),
    (["--script", "latin1.txt"], "--script 'latin1.txt' is not UTF-8 text (invalid continuation byte at byte 9)"),
    (["--script", "s.txt", "--prompt-wav", "p.wav"], "--prompt-wav belong with --text"),
    (["--script", "s.txt", "--pause", "99"], "the pause between turns must be 0 to 10 seconds"),
    (["--script", "bad.txt"], "turn 1: voice 'nobody.wav' names an audio file that does not exist"),
    (["--text", "Hi.", "--pause", "1", "--prompt-wav", "p.wav"], "--voices and --pause go with --script"),
])
def test_synth_script_refuses_bad_input_in_one_line(tmp_path, args, message):
    (tmp_path / "s.txt").write_text("anna: Hi.\n")
    (tmp_path / "bad.txt").write_text("nobody.wav: Hi.\n")
    (tmp_path / "latin1.txt").write_bytes("anna: Caf\u00e9.\n".encode("latin-1"))
    r = run_cli("synth", "--model-dir", str(MODEL_DIR), *args, "--out", "o.wav", cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- POST /v1/audio/dialogue -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client():
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from cosyllama.server.app import create_app
    from server_helpers import voiced_tts

    srv = LoopbackServer(create_app(voiced_tts("bob", gated=False)))
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c
    srv.stop()


def _wav(data: bytes) -> np.ndarray:
    import soundfile as sf

    return sf.read(io.BytesIO(data), dtype="int16")[0]


def test_http_dialogue_is_its_turns_and_pauses(client):
    turns = [{"voice": "en", "text": "Hello Bob."}, {"voice": "bob", "text": "Hi there!"}]
    r = client.post("/v1/audio/dialogue", json={"turns": turns, "pause_between_turns": 0.5, "response_format": "wav",
                                                "seed": 3})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    whole = _wav(r.content)
    alone = [_wav(client.post("/v1/audio/speech", json={"input": t["text"], "voice": t["voice"],
                                                         "seed": turn_seed(3, k), "response_format": "wav"}).content)
             for k, t in enumerate(turns)]
    gap = 12000
    np.testing.assert_array_equal(whole, np.concatenate([alone[0], np.zeros(gap, np.int16), alone[1]]))
    same = client.post("/v1/audio/dialogue", json={"inputs": [{"voice_id": t["voice"], "text": t["text"]}
                                                              for t in turns], "pause_between_turns": 0.5,
                                                   "response_format": "wav", "seed": 3})
    assert same.content == r.content  # ElevenLabs' shape, the same dialogue


def test_http_dialogue_streams_as_speech_does(client):
    r = client.post("/v1/audio/dialogue", json={"turns": [{"voice": "en", "text": "Hello."}, {"voice": "bob",
                                                                                           "text": "Hi."}],
                                                "stream_format": "sse", "response_format": "pcm"})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["output_tokens"] > 0


@pytest.mark.parametrize("body,status,param,words", [
    ({"turns": [{"voice": "zed", "text": "Hi."}]}, 404, "turns[0].voice", "turns[0] (zed): unknown voice 'zed'"),
    ({"turns": []}, 422, "turns", "turns is empty"),
    ({"turns": [{"voice": "en", "text": " "}]}, 422, "turns[0].text", "has no text"),
    ({"input": "x", "turns": [{"voice": "en", "text": "Hi."}]}, 422, "input", "not a field of a dialogue"),
    ({"turns": [{"voice": "en", "text": "Hi."}], "pause_between_turns": 99}, 422, "pause_between_turns", "10"),
    ({"turns": [{"voice": "en", "text": "Hi.", "speed": 9}]}, 422, "turns[0].speed", "speed must be between"),
    ({}, 422, "turns", "give the dialogue as turns"),
    ({"turns": [{"voice": "en", "text": "x" * 5000}] * 3}, 413, "input", "too long"),
])
def test_http_dialogue_refuses_naming_the_turn(client, body, status, param, words):
    r = client.post("/v1/audio/dialogue", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]


def test_with_loudness_each_turn_is_brought_to_the_target(tts):
    pyln = pytest.importorskip("pyloudnorm")
    s = tts.dialogue([Turn("anna", "Hello there, Bob."), Turn("bob", "Hi Anna! How are you?")], pause=0.2, seed=5,
                     loudness=-30.0)
    audio = s.audio()
    meter = pyln.Meter(RATE)
    for seg in s.segments:  # one segment a turn here
        assert meter.integrated_loudness(audio[seg.start_sample:seg.end_sample].astype(np.float64)) == \
            pytest.approx(-30.0, abs=0.1)
    assert s.timings.loudness_gain_db is None  # no single gain: each turn has its own


# -- SSML: spans as turns, breaks as exact silences ------------------------------------------------------------

DOC = ('<speak>Hello <emphasis>there</emphasis>.<break time="500ms"/><voice name="bob"><prosody rate="slow">'
       'I am Bob.</prosody></voice><p>A new paragraph.</p><break strength="strong"/></speak>')


def test_ssml_spans_are_turns_and_breaks_exact_silences(tts):
    s = tts.ssml(DOC, "anna", seed=1)
    chunks = list(s)
    audio = np.concatenate([c.samples for c in chunks])
    assert [c.samples.size for c in chunks if c.segment == PAUSE_SEGMENT] == [12000, 18000]  # 0.5 s, strong 0.75 s
    assert [seg.voice for seg in s.segments] == ["anna", "bob", "anna"]
    first = tts.synthesize("Hello <strong>there</strong>.", voice="anna", seed=turn_seed(1, 0)).audio()
    np.testing.assert_array_equal(audio[:first.size], first)
    bob = tts.synthesize("I am Bob.", voice="bob", seed=turn_seed(1, 1), speed=0.75).audio()
    at = first.size + 12000
    np.testing.assert_array_equal(audio[at:at + bob.size], bob)
    assert not audio[-18000:].any() and s.segments[-1].end_sample == audio.size - 18000


@pytest.mark.parametrize("doc,message", [
    ('<speak>Hi <break time="3x"/></speak>', "SSML line 1, column 11: break time '3x'"),
    ('<?xml version="1.0"?><!DOCTYPE s [<!ENTITY a "aaaa">]><speak>&a;</speak>', "SSML"),
    ('<speak><p>unclosed</speak>', "malformed XML"),
    ('<speak> <break time="1s"/> </speak>', "says nothing"),
    ('<speak><voice name="zed">Hi.</voice></speak>', "turn 1 (voice 'zed'): unknown voice 'zed'"),
])
def test_ssml_that_cannot_be_spoken_is_refused(tts, doc, message):
    from cosyllama.errors import InputError

    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tts.ssml(doc, "anna")


def test_http_speech_takes_an_ssml_input(client):
    doc = '<speak>Hello there.<break time="500ms"/><voice name="bob">I am Bob.</voice></speak>'
    r = client.post("/v1/audio/speech", json={"input": doc, "voice": "en", "response_format": "wav", "seed": 3})
    assert r.status_code == 200
    whole = _wav(r.content)
    first = _wav(client.post("/v1/audio/speech", json={"input": "Hello there.", "voice": "en", "seed": 3,
                                                        "response_format": "wav"}).content)
    np.testing.assert_array_equal(whole[:first.size], first)
    assert not whole[first.size:first.size + 12000].any()
    r = client.post("/v1/audio/speech", json={"input": '<speak>Hi <voice name="zed">there</voice></speak>',
                                              "voice": "en"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "input[1].voice"
    r = client.post("/v1/audio/speech", json={"input": '<!DOCTYPE x><speak>Hi</speak>', "voice": "en"})
    assert r.status_code == 200  # not an SSML document (it does not start with <speak>): spoken as text
    r = client.post("/v1/audio/speech", json={"input": '<speak>Hi <break time="x"/></speak>', "voice": "en"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_ssml"


def test_synth_ssml_in_one_line_errors_and_captions(tmp_path):
    r = run_cli("synth", "--model-dir", str(MODEL_DIR), "--prompt-wav", str(PROMPT), "--ssml", "--text",
                '<speak>Hello.<break time="300ms"/>Again.</speak>', "--out", "o.wav", "--captions", "o.srt",
                "--precision", "fp32", "--threads", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o.srt").read_text().count("-->") == 2
    bad = run_cli("synth", "--model-dir", str(MODEL_DIR), "--prompt-wav", str(PROMPT), "--ssml", "--text",
                  "<speak>Hi", "--out", "o.wav", cwd=tmp_path)
    assert bad.returncode == 2 and "malformed XML" in bad.stderr and "Traceback" not in bad.stderr
