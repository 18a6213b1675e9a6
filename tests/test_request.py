"""The one request validator (:mod:`cosyllama.request`): each rule raises its :class:`RequestError`
naming its field, and the same bad request is refused by the same rule at every front door, each
in its own words (the Python API, ``cosyllama synth``, HTTP, a batch manifest row, Wyoming)."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess

import pytest

from cli_run import COSYLLAMA, cli_env
from cosyllama.errors import InputError
from cosyllama.limits import LimitExceeded, RequestLimits
from cosyllama.request import (
    BATCH_NAMES,
    FLAG_NAMES,
    FRONTEND_MODES,
    HTTP_NAMES,
    MODES,
    RequestError,
    SynthesisOptions,
    SynthesisRequest,
)
from helpers import FIXTURES, MODEL_DIR, LoopbackServer

PROMPT_WAV = FIXTURES / "wavs" / "prompt_en_16k.wav"
TIMEOUT = 120  # seconds for any one answer: generous, only a hang reaches it


class Voice:
    """What the mode rules read of a voice (a PromptFeatures stand-in)."""

    def __init__(self, prompt_text=None, instruction=None):
        self.prompt_text, self.instruction = prompt_text, instruction


def _refused(field: str, code: str | None = None, **kw) -> RequestError:
    with pytest.raises(RequestError) as ei:
        SynthesisRequest(**kw)
    assert ei.value.field == field, ei.value
    if code is not None:
        assert ei.value.code == code, ei.value
    return ei.value


# -- the validator, rule by rule -------------------------------------------------------------------

CLIP = {"prompt_wav": "clip.wav"}


@pytest.mark.parametrize("text, code", [("", "empty_string"), ("  \n", "empty_string"), (5, "string_type"),
                                        ("Hi\x07", "invalid_characters"), ("Hi \ud800", "invalid_characters")])
def test_text_is_a_non_empty_string_of_unicode_text(text, code):
    _refused("text", code, text=text, **CLIP)


def test_mode_is_one_of_modes():
    assert MODES == ("zero-shot", "cross-lingual", "instruct")
    e = _refused("mode", "literal_error", text="Hi.", mode="vc", **CLIP)
    assert "zero-shot, cross-lingual, instruct" in str(e)


def test_the_frontends_modes_come_from_modes():
    from cosyllama.frontend import MODES as FRONTEND

    assert set(FRONTEND_MODES) == set(MODES) and FRONTEND == (*FRONTEND_MODES.values(), "vc")


def test_instruct_needs_an_instruction_which_a_voice_may_bring():
    _refused("instruction", "conflicting_fields", text="Hi.", mode="instruct", **CLIP)
    _refused("instruction", "conflicting_fields", text="Hi.", mode="instruct", voice=Voice("t"))
    _refused("instruction", "empty_string", text="Hi.", mode="instruct", instruction=" ", **CLIP)
    r = SynthesisRequest("Hi.", "instruct", voice=Voice(instruction="Speak slowly."))
    assert r.resolve(r.voice) == ("instruct", "Speak slowly.")
    assert SynthesisRequest("Hi.", voice=Voice("t", "Slowly.")).resolve(Voice("t", "Slowly.")) == ("instruct",
                                                                                                    "Slowly.")
    # a registered id: known only once the voice is looked up (TTS.run)
    r = SynthesisRequest("Hi.", "instruct", voice="anna")
    with pytest.raises(RequestError, match="instruct mode needs instruction"):
        r.resolve(Voice("t"))


def test_instructions_go_with_instruct_mode_only():
    for mode in ("zero-shot", "cross-lingual"):
        e = _refused("mode", "conflicting_fields", text="Hi.", mode=mode, instruction="Slowly.", prompt_text="t",
                     **CLIP)
        assert "takes no instructions" in e.render(HTTP_NAMES)


def test_zero_shot_needs_a_transcript():
    e = _refused("prompt_text", "missing", text="Hi.", mode="zero-shot", **CLIP)
    assert "needs --prompt-text (the transcript of --prompt-wav)" in str(e.as_flag())
    _refused("voice", "missing", text="Hi.", mode="zero-shot", voice=Voice())
    with pytest.raises(RequestError) as ei:
        SynthesisRequest("Hi.", "zero-shot", voice="bare").resolve(Voice())
    assert ei.value.field == "voice"
    assert SynthesisRequest("Hi.", **CLIP, prompt_text="t").resolve() == ("zero-shot", None)
    assert SynthesisRequest("Hi.", **CLIP).resolve() == ("cross-lingual", None)


def test_a_voice_or_a_clip_not_both_not_neither():
    _refused("voice", "conflicting_fields", text="Hi.", voice="anna", **CLIP)
    _refused("prompt_wav", "missing", text="Hi.")


def test_prompt_text_goes_with_a_clip_not_a_registered_voice():
    _refused("prompt_text", "conflicting_fields", text="Hi.", voice="anna", prompt_text="t")


@pytest.mark.parametrize("speed, code", [(0.2, "greater_than_equal"), (4.5, "less_than_equal"),
                                         (math.nan, "finite_number"), (math.inf, "finite_number"),
                                         ("fast", "float_type"), (True, "float_type")])
def test_speed_is_finite_and_in_range(speed, code):
    _refused("speed", code, text="Hi.", options=SynthesisOptions(speed=speed), **CLIP)
    assert SynthesisRequest("Hi.", **CLIP, options=SynthesisOptions(speed=4)).options.speed == 4


def test_speed_other_than_one_is_not_streaming_synthesis():
    e = _refused("speed", "conflicting_fields", text="Hi.", options=SynthesisOptions(stream=True, speed=1.5), **CLIP)
    assert "drop --stream" in str(e.as_flag())


@pytest.mark.parametrize("seed, code", [(-1, "greater_than_equal"), (2**31, "less_than_equal"),
                                        (1.0, "int_type"), (False, "int_type")])
def test_seed_range(seed, code):
    _refused("seed", code, text="Hi.", options=SynthesisOptions(seed=seed), **CLIP)
    assert SynthesisRequest("Hi.", **CLIP, options=SynthesisOptions(seed=2**31 - 1)).options.seed == 2**31 - 1


def test_character_limits_checked_when_made():
    lim = RequestLimits(input_chars=5, instructions_chars=5, transcript_chars=5)
    for kw, field in (({"text": "x" * 6}, "input"), ({"instruction": "x" * 6}, "instructions"),
                      ({"prompt_text": "x" * 6, "mode": "zero-shot"}, "transcript")):
        with pytest.raises(LimitExceeded) as ei:
            SynthesisRequest(**{"text": "Hi.", **kw, **CLIP, "limits": lim})
        assert ei.value.field == field


def test_each_door_names_the_field_its_way():
    e = _refused("instruction", text="Hi.", mode="instruct", **CLIP)
    assert e.name(HTTP_NAMES) == "instructions" and e.name(BATCH_NAMES) == "instructions"
    assert "--instruct" in str(e.as_flag()) and e.name(FLAG_NAMES) == "--instruct"
    assert isinstance(e, InputError) and isinstance(e.as_flag(), InputError)
    e = _refused("text", text=" ", **CLIP)
    assert str(e).startswith("text is empty") and e.render(HTTP_NAMES).startswith("input is empty")
    assert str(e.as_flag()).startswith("--text is empty")


def test_a_value_with_braces_is_shown_as_given():
    assert "'{x}'" in str(_refused("mode", text="Hi.", mode="{x}", **CLIP))


# -- one bad request at every door ----------------------------------------------------------------

# case -> (the Python API call, synth flags, HTTP body fields, batch row fields, the field, words every door says)
CASES = {
    "empty text": (lambda tts: tts.cross_lingual("  ", voice="en"), ["--text", " "], {"input": " "},
                   {"text": " ", "mode": "cross-lingual", "voice": "en"}, "text", "is empty"),
    "control character": (lambda tts: tts.cross_lingual("Hi\x07 there.", voice="en"), ["--text", "Hi\x07 there."],
                          {"input": "Hi\x07 there."}, {"text": "Hi\x07 there.", "mode": "cross-lingual", "voice": "en"},
                          "text", "holds a control character (U+0007) at character 2"),
    "zero-shot without a transcript": (
        lambda tts: tts.zero_shot("Hi.", PROMPT_WAV), ["--mode", "zero-shot"], {"mode": "zero-shot", "voice": "bare"},
        {"mode": "zero-shot", "prompt_wav": str(PROMPT_WAV)}, None, "zero-shot needs"),
    "instruct without an instruction": (
        lambda tts: tts.instruct("Hi.", None, voice="en"), ["--mode", "instruct"], {"mode": "instruct"},
        {"mode": "instruct", "prompt_wav": str(PROMPT_WAV)}, "instruction", "instruct mode needs"),
    "speed out of range": (lambda tts: tts.cross_lingual("Hi.", voice="en", speed=5), ["--speed", "5"], {"speed": 5},
                           {"mode": "cross-lingual", "voice": "en", "speed": 5}, "speed",
                           "must be between 0.25 and 4.0"),
}
HTTP_PARAM = {"text": "input", "instruction": "instructions", "speed": "speed", None: "voice"}
BATCH_FIELD = {"text": "text", "instruction": "instructions", "speed": "speed", None: "prompt_text"}


@pytest.fixture(scope="module")
def tts():
    from cosyllama.tts import TTS

    t = TTS(MODEL_DIR, threads=1, precision="fp32")
    t.add_voice("en", PROMPT_WAV, "Hello, this is my voice.")
    t.add_voice("bare", PROMPT_WAV)
    return t


@pytest.fixture(scope="module")
def server(tts):
    pytest.importorskip("fastapi")
    pytest.importorskip("wyoming")
    from cosyllama.server.app import create_app
    from cosyllama.server.options import ServeOptions, ServingOptions

    app = create_app(tts, ServeOptions(ServingOptions(tts.options), wyoming="tcp://127.0.0.1:0"))
    srv = LoopbackServer(app)
    srv.wyoming_port = app.state.server.wyoming.address[1]
    yield srv
    srv.stop()


@pytest.mark.parametrize("case", list(CASES))
def test_python_api(tts, case):
    call, _, _, _, field, words = CASES[case]
    with pytest.raises(RequestError) as ei:
        call(tts)
    assert words in str(ei.value) and (field is None or ei.value.field == field), ei.value


@pytest.mark.parametrize("case", list(CASES))
def test_cli(tmp_path, case):
    _, flags, _, _, field, words = CASES[case]
    args = {"--text": "Hi.", "--prompt-wav": str(PROMPT_WAV)}
    args.update(zip(flags[::2], flags[1::2]))
    cmd = [*COSYLLAMA, "synth", "--model-dir", str(MODEL_DIR), "--out", str(tmp_path / "o.wav"),
           *[x for kv in args.items() for x in kv]]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=cli_env())
    assert p.returncode == 2, p.stderr
    assert words in p.stderr and "Traceback" not in p.stderr, p.stderr
    flag = {"text": "--text", "instruction": "--instruct", "speed": "--speed", None: "--prompt-text"}[field]
    assert flag in p.stderr, p.stderr
    assert not (tmp_path / "o.wav").exists()


@pytest.mark.parametrize("case", list(CASES))
def test_http(server, case):
    import httpx

    _, _, body, _, field, words = CASES[case]
    r = httpx.post(f"{server.url}/v1/audio/speech", json={"input": "Hi.", "voice": "en", **body}, timeout=TIMEOUT)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == HTTP_PARAM[field] and words in err["message"], err


@pytest.mark.parametrize("case", list(CASES))
def test_batch_row(tmp_path, case):
    from cosyllama.batch.manifest import read_manifest

    _, _, _, row, field, words = CASES[case]
    lines = ['{"id": "ok", "mode": "cross-lingual", "text": "Fine.", "voice": "en"}',
             json.dumps({"id": "bad", "text": "Hi.", **row})]
    (tmp_path / "m.jsonl").write_text("\n".join(lines), encoding="utf-8")
    m = read_manifest(tmp_path / "m.jsonl", voices={"en", "bare"}, voice_transcripts={"en": True, "bare": False})
    assert [r.id for r in m.rows] == ["ok"]
    [bad] = m.bad
    assert bad.line == 2 and words in bad.error and BATCH_FIELD[field] in bad.error, bad


def test_batch_instruct_row_needs_instructions_unless_its_voice_has_its_own(tmp_path):
    """An instruct row without instructions is refused when the manifest is read, before any synthesis,
    unless its registered voice carries a style instruction (a voice folder's instruct.txt)."""
    from cosyllama.batch.manifest import read_manifest

    lines = ['{"id": "styled", "mode": "instruct", "text": "Hi.", "voice": "calm"}',
             '{"id": "plain", "mode": "instruct", "text": "Hi.", "voice": "en"}']
    (tmp_path / "m.jsonl").write_text("\n".join(lines), encoding="utf-8")
    m = read_manifest(tmp_path / "m.jsonl", voices={"en", "calm"}, voice_transcripts={"en": True, "calm": False},
                      voice_instructions={"en": False, "calm": True})
    assert [r.id for r in m.rows] == ["styled"]
    [bad] = m.bad
    assert bad.line == 2 and "instructions" in bad.error and "instruct mode needs" in bad.error, bad


@pytest.mark.parametrize("case", ["empty text", "control character"])
def test_wyoming(server, case):
    from wyoming.client import AsyncTcpClient
    from wyoming.error import Error
    from wyoming.tts import Synthesize

    text = {"empty text": "   ", "control character": "Hi\x07 there."}[case]

    async def ask():
        client = AsyncTcpClient("127.0.0.1", server.wyoming_port)
        await client.connect()
        try:
            await client.write_event(Synthesize(text=text).event())
            return await client.read_event()
        finally:
            await client.disconnect()

    event = asyncio.run(asyncio.wait_for(ask(), TIMEOUT))
    assert Error.is_type(event.type), event
    e = Error.from_event(event)
    assert e.code == ("empty_text" if case == "empty text" else "invalid_input"), e
    assert CASES[case][5] in e.text or case == "empty text", e


def test_one_http_request_checks_speed_and_characters_once(server, monkeypatch):
    """Speed was checked three times on one HTTP request (pydantic, the route, the synthesis) and the
    character limits twice; now the request checks each once, when it is made."""
    import httpx

    import cosyllama.request as request_module

    counts = {"options": 0, "chars": 0}
    check_options, check_chars = request_module.check_options, RequestLimits.check_chars

    def counted_options(o):
        counts["options"] += 1
        return check_options(o)

    def counted_chars(self, field, text):
        counts["chars"] += field == "input"
        return check_chars(self, field, text)

    monkeypatch.setattr(request_module, "check_options", counted_options)
    monkeypatch.setattr(RequestLimits, "check_chars", counted_chars)
    r = httpx.post(f"{server.url}/v1/audio/speech", json={"input": "Hi.", "voice": "en", "speed": 1.5, "greedy": True,
                                                           "response_format": "wav"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert counts == {"options": 1, "chars": 1}
