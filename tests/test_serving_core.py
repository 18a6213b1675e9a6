"""One serving core under three doors (docs/server.md, "Serving from Python"): ``prepare(models, options)``
builds one :class:`~cosyllama.server.serving.Serving`, ``create_app(serving, ServeOptions)`` puts HTTP, the
WebSocket and Wyoming on it (one gate, one scheduler); streamed sessions on both doors follow one seed rule
(sentence k of an utterance is seeded with seed + k, as segment k of one request is)."""

from __future__ import annotations

import asyncio
import json

import pytest

from helpers import LoopbackServer

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("websockets")
pytest.importorskip("wyoming")
from websockets.sync.client import connect  # noqa: E402
from wyoming.client import AsyncTcpClient  # noqa: E402
from wyoming.info import Describe  # noqa: E402
from wyoming.tts import SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice  # noqa: E402

from cosyllama.request import SynthesisOptions  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from cosyllama.server.serving import prepare  # noqa: E402
from server_helpers import voiced_tts  # noqa: E402

TIMEOUT = 120  # seconds for any one message: generous, only a hang reaches it
SEED = 5
SENTENCES = ["Hello there.", "How are you today?"]


@pytest.fixture(scope="module")
def server():
    """The steps of docs/server.md on the tiny model: the models loaded once (here: a voiced TTS's),
    one serving core over them, HTTP + WebSocket + Wyoming on it."""
    tts = voiced_tts(gated=False)
    # Wyoming cannot carry a seed: the server's defaults give every request one
    options = ServingOptions(tts.options, max_concurrent=2, max_queue=4, defaults=SynthesisOptions(seed=SEED))
    serving = prepare(tts.models, options, voices=tts.voices)
    app = create_app(serving, ServeOptions(options, wyoming="tcp://127.0.0.1:0"))
    srv = LoopbackServer(app)
    srv.app, srv.serving, srv.tts = app, serving, tts
    srv.wyoming_port = app.state.server.wyoming.address[1]
    yield srv
    srv.stop()
    serving.close()


def _http_pcm(server, text: str, seed: int) -> bytes:
    body = {"input": text, "voice": "en", "seed": seed, "response_format": "pcm", "stream_format": "audio"}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/audio/speech", json=body)
    assert r.status_code == 200, r.text
    return r.content


def test_every_door_is_on_the_one_core(server):
    """The app, the Wyoming server and /health all read the serving core prepare made: one gate,
    one scheduler (so HTTP and Wyoming requests count against the same bounds)."""
    state = server.app.state.server
    assert state.serving is server.serving and state.wyoming.service.serving is server.serving
    assert not state.owns_serving  # the caller closes what it prepared
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        health = c.get("/health").json()
    assert (health["max_concurrent"], health["max_queue"]) == (2, 4)

    async def describe():
        client = AsyncTcpClient("127.0.0.1", server.wyoming_port)
        await client.connect()
        try:
            await client.write_event(Describe().event())
            return await asyncio.wait_for(client.read_event(), TIMEOUT)
        finally:
            await client.disconnect()

    info = asyncio.run(describe())
    assert info.type == "info" and "en" in [v["name"] for v in info.data["tts"][0]["voices"]]


def _continued_pcm(server, text: str, seed: int) -> bytes:
    """A streamed sentence after its utterance's first: ``text`` with the space before it (as the whole text's
    segment keeps it, docs/server.md), sampled with ``seed``, streamed."""
    from cosyllama.audio_out import pcm16
    from cosyllama.request import SynthesisRequest

    opts = SynthesisOptions(seed=seed, stream=True)
    return pcm16(server.tts.run(SynthesisRequest(text=text, voice="en", options=opts, lead=" ")).audio())


def test_both_streamed_doors_seed_sentence_k_with_seed_plus_k(server):
    """Sampled (not greedy) with seed 5: the WebSocket's and Wyoming's first sentence equals
    /v1/audio/speech of that sentence with seed 5, the k-th that sentence continued (the space before it kept)
    with seed 5 + k. The seeds matter here: the second sentence with seed 5 is other audio (so one seed for
    every sentence fails this test)."""
    http = [_http_pcm(server, SENTENCES[0], SEED)] + [_continued_pcm(server, s, SEED + k)
                                                       for k, s in enumerate(SENTENCES) if k]
    assert _continued_pcm(server, SENTENCES[1], SEED) != http[1]  # the test can fail

    with connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream", open_timeout=TIMEOUT,
                 close_timeout=TIMEOUT, max_size=None) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "en", "seed": SEED, "response_format": "pcm",
                            "stream_audio": True}))
        ws.send(json.dumps({"type": "input.text", "text": " ".join(SENTENCES)}))
        ws.send(json.dumps({"type": "input.done"}))
        got, audio = [], b""
        while True:
            m = ws.recv(timeout=TIMEOUT)
            if isinstance(m, bytes):
                audio += m
                continue
            m = json.loads(m)
            if m["type"] == "audio.done":
                got.append(audio)
                audio = b""
            elif m["type"] == "session.done":
                break
            else:
                assert m["type"] == "audio.start", m
    assert got == http

    async def wyoming_stream():
        client = AsyncTcpClient("127.0.0.1", server.wyoming_port)
        await client.connect()
        try:
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="en")).event())
            await client.write_event(SynthesizeChunk(text=" ".join(SENTENCES)).event())
            await client.write_event(SynthesizeStop().event())
            pcm = b""
            while (e := await asyncio.wait_for(client.read_event(), TIMEOUT)).type != "synthesize-stopped":
                assert e.type != "error", e.data
                if e.type == "audio-chunk":
                    pcm += e.payload
            return pcm
        finally:
            await client.disconnect()

    assert asyncio.run(wyoming_stream()) == b"".join(http)


def test_language_narrows_what_wyoming_describes_and_takes(server):
    """``--language de --language en``: describe lists de then en for every voice (Home Assistant offers
    the voices for those); a request for another language is refused naming the flag."""
    import copy
    import dataclasses

    from wyoming.tts import Synthesize

    from cosyllama.server.wyoming_server import start_wyoming

    serving = copy.copy(server.serving)  # the same core, other options
    serving.options = dataclasses.replace(serving.options, languages=("de", "en"))

    async def go():
        wy = await start_wyoming("tcp://127.0.0.1:0", serving)
        try:
            out = []
            for event in (Describe().event(),
                          Synthesize(text="Hallo.", voice=SynthesizeVoice(language="fr")).event()):
                client = AsyncTcpClient("127.0.0.1", wy.address[1])
                await client.connect()
                try:
                    await client.write_event(event)
                    out.append(await asyncio.wait_for(client.read_event(), TIMEOUT))
                finally:
                    await client.disconnect()
            return out
        finally:
            await wy.stop()

    info, refused = asyncio.run(go())
    assert {tuple(v["languages"]) for v in info.data["tts"][0]["voices"]} == {("de", "en")}
    assert refused.type == "error" and refused.data["code"] == "language_not_supported"
    assert "--language" in refused.data["text"] and "de, en" in refused.data["text"]


def test_a_bad_language_is_refused_before_loading(capsys):
    from cosyllama.cli import main
    from helpers import MODEL_DIR

    for bad in (["--language", "xx"], ["--language", "en", "--language", "en"]):
        assert main(["wyoming", "--model-dir", str(MODEL_DIR), "--uri", "tcp://127.0.0.1:0", *bad]) == 2
        assert "--language takes each of zh, en, ja" in capsys.readouterr().err
