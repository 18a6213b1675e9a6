"""What every request starts from (``ServingOptions.defaults``), set per server: ``serve`` and ``wyoming`` take
``--seed``, ``--greedy`` and ``--speed``; an HTTP request (and a dialogue) that gives none of them takes the
server's, one that gives its own keeps it; Wyoming, whose events carry none, speaks at the server's speed too
(each sentence synthesized whole), as wyoming-piper's ``--length-scale`` does (issue #53)."""

from __future__ import annotations

import asyncio

import pytest

from helpers import MODEL_DIR, LoopbackServer

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("wyoming")
from wyoming.client import AsyncTcpClient  # noqa: E402
from wyoming.tts import Synthesize, SynthesizeVoice  # noqa: E402

from cosyllama.defaults import RETRIES  # noqa: E402
from cosyllama.request import SynthesisOptions  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from cosyllama.server.serving import prepare  # noqa: E402
from server_helpers import voiced_tts  # noqa: E402

TIMEOUT = 120  # seconds for any one answer: generous, only a hang reaches it
SEED, SPEED = 5, 1.25
TEXT = "Hello there."


@pytest.fixture(scope="module")
def server():
    """HTTP and Wyoming over one serving core whose requests start from seed 5 at speed 1.25."""
    tts = voiced_tts("bob", gated=False)
    options = ServingOptions(tts.options, max_concurrent=2, max_queue=4,
                             defaults=SynthesisOptions(seed=SEED, speed=SPEED))
    serving = prepare(tts.models, options, voices=tts.voices)
    app = create_app(serving, ServeOptions(options, wyoming="tcp://127.0.0.1:0"))
    srv = LoopbackServer(app)
    srv.wyoming_port = app.state.server.wyoming.address[1]
    yield srv
    srv.stop()
    serving.close()


def _post(server, path: str, body: dict) -> bytes:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        r = c.post(path, json={"response_format": "pcm", **body})
    assert r.status_code == 200, r.text
    return r.content


def test_the_flags_set_what_every_request_starts_from(capsys, monkeypatch):
    from cosyllama.cli import build_parser, main
    from cosyllama.commands.options import serving_options
    from cosyllama.server import startup

    parser = build_parser()
    for command in (["serve"], ["wyoming"]):
        args = parser.parse_args([*command, "--model-dir", "m", "--seed", "7", "--greedy", "--speed", "1.25"])
        assert serving_options(args).defaults == SynthesisOptions(seed=7, greedy=True, speed=1.25, retries=RETRIES)
        assert serving_options(parser.parse_args([*command, "--model-dir", "m"])).defaults == SynthesisOptions()
    monkeypatch.setattr(startup, "load_models", lambda options: pytest.fail("the model was loaded"))
    for command in ("serve", "wyoming"):
        for flags, says in ((["--seed", "-1"], "--seed must be an integer from 0 to 2147483647"),
                            (["--speed", "9"], "--speed must be between 0.25 and 4.0")):
            assert main([command, "--model-dir", str(MODEL_DIR), *flags]) == 2
            err = capsys.readouterr().err
            assert says in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        parser.parse_args(["wyoming", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--seed N" in out and "--greedy" in out and "--speed X" in out


def test_an_http_request_that_gives_none_takes_the_servers_seed_and_speed(server):
    explicit = _post(server, "/v1/audio/speech", {"input": TEXT, "voice": "en", "seed": SEED, "speed": SPEED})
    assert _post(server, "/v1/audio/speech", {"input": TEXT, "voice": "en"}) == explicit
    own = _post(server, "/v1/audio/speech", {"input": TEXT, "voice": "en", "speed": 1.0})
    assert len(own) != len(explicit)  # a request's own speed wins


def test_a_dialogue_that_gives_no_seed_takes_the_servers(server):
    turns = [{"voice": "en", "text": "Hello."}, {"voice": "bob", "text": "Hi there."}]
    explicit = _post(server, "/v1/audio/dialogue", {"turns": turns, "seed": SEED})
    assert _post(server, "/v1/audio/dialogue", {"turns": turns}) == explicit


def test_wyoming_speaks_at_the_servers_speed(server):
    """The Wyoming door, refused at start with a speed other than 1 before, speaks each request at it: the
    audio of /v1/audio/speech with the same seed and speed (the whole file)."""

    async def synthesize() -> bytes:
        client = AsyncTcpClient("127.0.0.1", server.wyoming_port)
        await client.connect()
        try:
            await client.write_event(Synthesize(text=TEXT, voice=SynthesizeVoice(name="en")).event())
            pcm = b""
            while (e := await asyncio.wait_for(client.read_event(), TIMEOUT)).type != "audio-stop":
                assert e.type != "error", e.data
                if e.type == "audio-chunk":
                    pcm += e.payload
            return pcm
        finally:
            await client.disconnect()

    http = _post(server, "/v1/audio/speech", {"input": TEXT, "voice": "en", "seed": SEED, "speed": SPEED})
    assert asyncio.run(synthesize()) == http
