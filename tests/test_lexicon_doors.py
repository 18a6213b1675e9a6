"""Pronunciation lexicons through the server's doors (docs/pronunciation.md#where-a-server-takes-one): the
server's ``--lexicon`` (the served pipeline's ``TTS.lexicon``), a voice folder's ``lexicon.txt`` and a request's
``lexicon`` field, the later winning, on loopback over HTTP and the WebSocket; bad ones refused naming
``lexicon``; ``serve``/``wyoming --lexicon`` with a bad file is one line, exit 2, before any model.

The effect is checked where it is made: the text segments the frontend hands the tokenizer (a recording
wrapper around ``Frontend._segments``) hold the entry's tokens, which are single ids of the
vocabulary; the tiny model's audio says nothing."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import MODEL_DIR, LoopbackServer

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from cosyllama.cli import main  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from cosyllama.text.lexicon import Lexicon, LexiconError  # noqa: E402
from cosyllama.tts import TTS  # noqa: E402
from cosyllama.voice_directory import VoiceDirectory  # noqa: E402
from server_helpers import PROMPT_TEXT, PROMPT_WAV, json_error, voiced_tts  # noqa: E402

TIMEOUT = 120
SERVER_LEX = {"tomato": "[T][AH0][M][EY1][T][OW2]", "potato": "[P][AH0][T][EY1][T][OW2]"}
VOICE_LEX_TXT = "# the voice's own\ntomato\t[T][AH0][M][AA1][T][OW2]\nbanana\t[B][AH0][N][AE1][N][AH0]\n"
REQUEST_TOMATO = "[T][OW1][M][EY1][T][OW2]"
BODY = {"greedy": True, "seed": 1, "response_format": "wav"}


class Recorder:
    """Wraps the shared frontend's ``_segments`` (what its modes split a text into): every spoken segment it
    hands on, in order."""

    def __init__(self, frontend):
        self.frontend, self.inner, self.segments = frontend, frontend._segments, []

    def __call__(self, *args, **kw):
        out = self.inner(*args, **kw)
        self.segments.extend(spoken for spoken, _shown in out)
        return out

    def take(self) -> str:
        text, self.segments = " ".join(self.segments), []
        return text


@pytest.fixture(scope="module")
def tts():
    return voiced_tts(gated=False)


@pytest.fixture(scope="module")
def store(tts, tmp_path_factory):
    """A voice directory: ``en`` (a file), the folder ``lex`` (with a lexicon.txt) and ``bad`` (whose lexicon.txt
    has an unknown token)."""
    d = tmp_path_factory.mktemp("voices")
    store = VoiceDirectory(d)
    store.add("en", tts.voices.get("en"))
    for name, lex in (("lex", VOICE_LEX_TXT), ("bad", "tomato\t[T][XX1]\n")):
        (d / name).mkdir()
        shutil.copy(PROMPT_WAV, d / name / "ref.wav")
        (d / name / "ref.txt").write_text(PROMPT_TEXT)
        (d / name / "lexicon.txt").write_text(lex)
    return store


def _has_wyoming() -> bool:
    try:
        import wyoming  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def server(tts, store):
    recorder = Recorder(tts.frontend)
    tts.frontend._segments = recorder  # the served pipeline shares the models' frontend
    view = TTS.from_models(tts.models, voices=store)
    options = ServingOptions(view.options, lexicon=Lexicon.from_mapping(SERVER_LEX))
    app = create_app(view, ServeOptions(options, wyoming="tcp://127.0.0.1:0" if _has_wyoming() else None))
    srv = LoopbackServer(app)
    srv.recorder = recorder
    srv.wyoming_port = app.state.server.wyoming.address[1] if _has_wyoming() else None
    yield srv
    srv.stop()
    del tts.frontend._segments


@pytest.fixture
def client(server):
    server.recorder.take()
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


def _spoken(server, client, text, voice, **fields) -> str:
    r = client.post("/v1/audio/speech", json={**BODY, "input": text, "voice": voice, **fields})
    assert r.status_code == 200, r.text
    return server.recorder.take()


def test_the_servers_lexicon_reaches_every_request(server, client, tts):
    said = _spoken(server, client, "A potato and a tomato.", "en")
    assert SERVER_LEX["potato"] in said and SERVER_LEX["tomato"] in said, said
    ids = tts.frontend.tokenize(SERVER_LEX["potato"])
    assert len(ids) == 6, ids  # each token one id of the vocabulary: the LLM sees the phones
    assert "potato" not in _spoken(server, client, "A potato.", "en", lexicon={}).lower()


def test_a_voice_folders_lexicon_wins_over_the_servers(server, client):
    said = _spoken(server, client, "A potato, a tomato, a banana.", "lex")
    assert "[T][AH0][M][AA1][T][OW2]" in said and SERVER_LEX["tomato"] not in said, said
    assert SERVER_LEX["potato"] in said and "[B][AH0][N][AE1][N][AH0]" in said, said
    assert "[AA1]" not in _spoken(server, client, "A tomato.", "en")  # only that voice's requests


def test_a_requests_lexicon_wins_over_the_voices_and_the_servers(server, client):
    said = _spoken(server, client, "A tomato, a potato, a banana.", "lex",
                   lexicon={"Tomato": REQUEST_TOMATO, "banana": "[B][AA1][N][AA1][N][AH0]"})
    assert REQUEST_TOMATO in said and "[AA1][T][OW2]" not in said, said
    assert "[B][AA1][N][AA1][N][AH0]" in said and SERVER_LEX["potato"] in said, said


def test_a_voice_folder_with_a_bad_lexicon_is_skipped_with_its_reason(server, client, store):
    ids = [v["id"] for v in client.get("/v1/voices").json()["voices"]]
    assert "lex" in ids and "bad" not in ids, ids
    why = store.skipped["bad/"]
    assert why.startswith("lexicon.txt:1: unknown token [XX1]") and str(store.directory) not in why, why
    json_error(client.post("/v1/audio/speech", json={**BODY, "input": "Hi.", "voice": "bad"}), 404, "'bad'")


@pytest.mark.parametrize("lexicon, code, words", [
    ({"tomato": "[T][XX1]"}, "invalid_lexicon", "lexicon entry 'tomato': unknown token [XX1]"),
    ({"tomato": "T AH0"}, "invalid_lexicon", "'tomato'"),
    ({"tomato": ""}, "invalid_lexicon", "no tokens"),
    ({"to{m}ato": "[T]"}, "invalid_lexicon", "none of"),
    ({"tomato": "[T]", "TOMATO": "[T]"}, "invalid_lexicon", "duplicate word"),
    ({f"w{i}": "[T]" for i in range(1001)}, "invalid_lexicon", "1001 entries; at most 1000"),
    ({"tomato": 5}, "invalid_lexicon", "entry 'tomato': its tokens must be a string"),
    ({"tomato": ["[T]"]}, "invalid_lexicon", "not list"),
    ({"w" * 65: "[T]"}, "invalid_lexicon", "at most 64 characters"),
    ({"tomato": "[T]" * 86}, "invalid_lexicon", "258 characters of tokens; at most 256"),
    (["tomato"], "dict_type", "lexicon"),
    ("tomato [T]", "dict_type", "lexicon"),
])
def test_a_bad_request_lexicon_is_422_naming_it(server, client, lexicon, code, words):
    r = client.post("/v1/audio/speech", json={**BODY, "input": "A tomato.", "voice": "en", "lexicon": lexicon})
    err = json_error(r, 422, words)
    assert (err["param"], err["code"]) == ("lexicon", code), err
    assert "Traceback" not in err["message"] and len(err["message"]) < 400, err
    assert server.recorder.take() == ""  # refused before any synthesis


def test_captioned_speech_and_dialogue_take_it_too(server, client):
    r = client.post("/dev/captioned_speech", json={**BODY, "input": "A tomato.", "voice": "en", "stream": False,
                                                    "lexicon": {"tomato": REQUEST_TOMATO}})
    assert r.status_code == 200, r.text
    assert REQUEST_TOMATO in server.recorder.take()
    err = json_error(client.post("/dev/captioned_speech", json={**BODY, "input": "Hi.", "voice": "en",
                                                                "lexicon": {"x": "[QQ]"}}), 422, "[QQ]")
    assert err["param"] == "lexicon"


def test_a_dialogues_lexicon_applies_to_every_turn_each_with_its_voices(server, client):
    turns = [{"voice": "en", "text": "A banana and a tomato."}, {"voice": "lex", "text": "A tomato."}]
    r = client.post("/v1/audio/dialogue", json={**BODY, "turns": turns, "lexicon": {"banana": "[B][AA1][N][AH0]"}})
    assert r.status_code == 200, r.text
    said = server.recorder.take()
    assert said.count("[B][AA1][N][AH0]") == 1 and SERVER_LEX["tomato"] in said, said
    assert said.index(SERVER_LEX["tomato"]) < said.index("[T][AH0][M][AA1][T][OW2]"), said  # the second turn's voice
    err = json_error(client.post("/v1/audio/dialogue", json={**BODY, "turns": turns, "lexicon": {"a": 1}}), 422)
    assert err["param"] == "lexicon", err


def test_the_websocket_session_config_takes_a_lexicon(server):
    pytest.importorskip("websockets")
    from websockets.sync.client import connect

    def recv(ws):
        m = ws.recv(timeout=TIMEOUT)
        return m if isinstance(m, bytes) else json.loads(m)

    url = f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream"
    config = {"type": "session.config", "voice": "lex", "greedy": True, "seed": 0}
    with connect(url, open_timeout=TIMEOUT, close_timeout=TIMEOUT, max_size=None) as ws:
        ws.send(json.dumps({**config, "lexicon": {"banana": "[B][AA1][N][AA1][N][AH0]"}}))
        ws.send(json.dumps({"type": "input.text", "text": "A banana and a tomato."}))
        ws.send(json.dumps({"type": "input.done"}))
        while not (isinstance(m := recv(ws), dict) and m["type"] == "session.done"):
            assert not (isinstance(m, dict) and m["type"] == "error"), m
    said = server.recorder.take()
    assert "[B][AA1][N][AA1][N][AH0]" in said and "[T][AH0][M][AA1][T][OW2]" in said, said
    with connect(url, open_timeout=TIMEOUT, close_timeout=TIMEOUT, max_size=None) as ws:
        ws.send(json.dumps({**config, "lexicon": {"banana": "[B][XX1]"}}))
        err = recv(ws)
    assert (err["type"], err["param"], err["code"]) == ("error", "lexicon", "invalid_lexicon"), err


def test_wyoming_speaks_the_servers_and_the_voice_folders_lexicons(server):
    """Home Assistant's door: Wyoming carries no lexicon, so the server's ``--lexicon`` and a voice folder's
    lexicon.txt are what it has; a synthesis in each voice, driven by the wyoming package's client."""
    if server.wyoming_port is None:
        pytest.skip("the wyoming package is not installed")
    import asyncio

    from wyoming.client import AsyncTcpClient
    from wyoming.tts import Synthesize, SynthesizeVoice

    async def speak(text: str, voice: str) -> list[str]:
        client = AsyncTcpClient("127.0.0.1", server.wyoming_port, read_timeout=TIMEOUT)
        await client.connect()
        try:
            await client.write_event(Synthesize(text=text, voice=SynthesizeVoice(name=voice)).event())
            types = []
            while (event := await client.read_event()) is not None:
                types.append(event.type)
                if event.type in ("audio-stop", "error"):
                    return types
            return types
        finally:
            await client.disconnect()

    server.recorder.take()
    types = asyncio.run(asyncio.wait_for(speak("A potato and a tomato.", "en"), 2 * TIMEOUT))
    assert types[-1] == "audio-stop" and "audio-chunk" in types, types
    said = server.recorder.take()
    assert SERVER_LEX["potato"] in said and SERVER_LEX["tomato"] in said, said
    types = asyncio.run(asyncio.wait_for(speak("A tomato and a banana.", "lex"), 2 * TIMEOUT))
    assert types[-1] == "audio-stop", types
    said = server.recorder.take()
    assert "[T][AH0][M][AA1][T][OW2]" in said and "[B][AH0][N][AE1][N][AH0]" in said, said


# -- the commands' flag -------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["serve", "wyoming"])
def test_a_bad_lexicon_file_is_one_line_and_exit_2_before_the_model(command, tmp_path, capsys, monkeypatch):
    if command == "wyoming":
        pytest.importorskip("wyoming")
    import cosyllama.server.startup as startup

    monkeypatch.setattr(startup, "load_models", lambda *a: pytest.fail("the model was loaded"))
    bad = tmp_path / "lex.txt"
    bad.write_text("tomato\t[T][AH0]\npotato\t[P][XX1]\n")
    assert main([command, "--model-dir", str(MODEL_DIR), "--lexicon", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"lexicon {bad}:2: unknown token [XX1]" in err, err
    assert main([command, "--model-dir", str(MODEL_DIR), "--lexicon", str(tmp_path / "none.txt")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_the_flag_becomes_the_serving_options_lexicon(tmp_path):
    from cosyllama.cli import build_parser
    from cosyllama.commands.options import serving_options

    good = tmp_path / "lex.txt"
    good.write_text("tomato\t[T][AH0][M][EY1][T][OW2]\n")
    args = build_parser().parse_args(["serve", "--model-dir", str(MODEL_DIR), "--lexicon", str(good)])
    lex = serving_options(args).lexicon
    assert lex.lookup("Tomato").spelled == SERVER_LEX["tomato"]
    args = build_parser().parse_args(["wyoming", "--model-dir", str(MODEL_DIR)])
    assert serving_options(args).lexicon is None


def test_a_lexicon_loaded_before_the_model_is_checked_against_its_vocabulary():
    class Vocabulary:
        def token_to_id(self, token):
            return None if token == "[EY1]" else 1

    lex = Lexicon.from_mapping(SERVER_LEX)
    with pytest.raises(LexiconError, match=r"entry 'tomato'.*\[EY1\] is not in this model's vocabulary"):
        lex.check(Vocabulary())
    assert Lexicon.from_mapping({"potato": "[P][AH0]"}).check(Vocabulary())
