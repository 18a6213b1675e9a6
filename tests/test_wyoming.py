"""The Wyoming server on loopback TCP (``serve --wyoming`` in one process with the HTTP API, tiny
model), driven by the wyoming package's own client: describe, plain and streamed synthesis equal
to the HTTP endpoint's audio, two clients at once, a disconnect frees its sequence, error events."""

from __future__ import annotations

import asyncio

import pytest

from helpers import MODEL_DIR, LoopbackServer

pytest.importorskip("wyoming")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from wyoming.audio import AudioChunk, AudioStart  # noqa: E402
from wyoming.client import AsyncTcpClient  # noqa: E402
from wyoming.error import Error  # noqa: E402
from wyoming.info import Describe, Info  # noqa: E402
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice  # noqa: E402

from cosyllama.request import SynthesisOptions  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from server_helpers import continued_pcm, voiced_tts  # noqa: E402
from server_helpers import wait_until as _wait  # noqa: E402

TIMEOUT = 120  # seconds for any one event: generous, only a hang reaches it
LONG = "This is a long sentence that keeps the model busy for a good while, word after word after word."


@pytest.fixture(scope="module")
def tts():
    return voiced_tts("bare")


@pytest.fixture(scope="module")
def server(tts):
    """``serve --wyoming``: the HTTP app with a Wyoming server on a free port, greedy, seed 0."""

    options = ServingOptions(tts.options, defaults=SynthesisOptions(greedy=True, seed=0))
    app = create_app(tts, ServeOptions(options, wyoming="tcp://127.0.0.1:0"))
    srv = LoopbackServer(app)
    srv.app, srv.port, srv.tts = app, app.state.server.wyoming.address[1], tts
    yield srv
    srv.stop()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 4 * TIMEOUT))


async def _connect(port: int) -> AsyncTcpClient:
    client = AsyncTcpClient("127.0.0.1", port, read_timeout=TIMEOUT)
    await client.connect()
    return client


async def _read_until(client, *types: str) -> list:
    """Events up to and including the first of one of ``types`` (or up to the end of the connection)."""
    events = []
    while (event := await client.read_event()) is not None:
        events.append(event)
        if event.type in types:
            break
    return events


def _audio(events) -> bytes:
    return b"".join(AudioChunk.from_event(e).audio for e in events if AudioChunk.is_type(e.type))


def _http_pcm(server, text: str, voice: str = "en", seed: int = 0) -> bytes:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/audio/speech", json={"input": text, "voice": voice, "greedy": True, "seed": seed,
                                             "stream": True, "response_format": "pcm"})
    assert r.status_code == 200, r.text
    return r.content


def test_describe_lists_the_voices(server):
    import cosyllama

    async def go():
        client = await _connect(server.port)
        try:
            await client.write_event(Describe().event())
            return Info.from_event(await client.read_event())
        finally:
            await client.disconnect()

    info = _run(go())
    assert len(info.tts) == 1 and not info.asr
    program = info.tts[0]
    assert program.name == "cosyllama" and program.version == cosyllama.__version__
    assert program.supports_synthesize_streaming and program.installed
    assert "CosyVoice" in program.attribution.url
    assert [v.name for v in program.voices] == ["default", "bare", "en"]
    assert program.voices[0].description == "default (bare)"  # the first registered voice, alphabetically
    for v in program.voices:
        assert v.installed and {"en", "zh", "ru"} <= set(v.languages)


def test_synthesize_streams_the_http_endpoints_audio(server):
    text = "Hello there. How are you today?"

    async def go():
        client = await _connect(server.port)
        try:
            await client.write_event(Synthesize(text=text, voice=SynthesizeVoice(name="en")).event())
            return await _read_until(client, "audio-stop", "error")
        finally:
            await client.disconnect()

    events = _run(go())
    types = [e.type for e in events]
    assert types[0] == "audio-start" and types[-1] == "audio-stop", types
    assert types.count("audio-start") == 1 and types.count("audio-chunk") >= 2  # chunks as streaming makes them
    start = AudioStart.from_event(events[0])
    assert (start.rate, start.width, start.channels) == (24_000, 2, 1)
    assert _audio(events) == _http_pcm(server, text)


def test_streamed_text_is_spoken_sentence_by_sentence(server):
    """Audio starts once the first sentence is complete, before the rest of the text is sent; the
    stream is the three sentences' audio in order, each equal to the HTTP endpoint's."""
    pieces = ["Hello there. How", " are you today? I am", " fine, thanks."]
    sentences = ["Hello there.", "How are you today?", "I am fine, thanks."]

    async def go():
        client = await _connect(server.port)
        try:
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="en")).event())
            await client.write_event(SynthesizeChunk(text=pieces[0]).event())
            first = await _read_until(client, "audio-chunk", "error")  # before any more text is sent
            for piece in pieces[1:]:
                await client.write_event(SynthesizeChunk(text=piece).event())
            await client.write_event(Synthesize(text="".join(pieces), voice=SynthesizeVoice(name="en")).event())
            await client.write_event(SynthesizeStop().event())
            return first, first + await _read_until(client, "synthesize-stopped", "error")
        finally:
            await client.disconnect()

    first, events = _run(go())
    assert [e.type for e in first] == ["audio-start", "audio-chunk"]
    types = [e.type for e in events]
    assert types.count("audio-start") == 1 and types.count("audio-stop") == 1 and "error" not in types
    assert types[-2:] == ["audio-stop", "synthesize-stopped"]
    assert SynthesizeStopped.is_type(events[-1].type)
    # sentence k is one request with seed 0 + k, after the first with the space before it (as the whole text's
    # segments keep it); the compatibility `synthesize` added nothing
    want = _http_pcm(server, sentences[0]) + b"".join(continued_pcm(server.tts, s, "en", seed=k)
                                                        for k, s in enumerate(sentences) if k)
    assert _audio(events) == want


def test_two_clients_at_once(server):
    """A second satellite is served from start to end while the first one's stream is open."""
    async def go():
        a = await _connect(server.port)
        b = await _connect(server.port)
        try:
            await a.write_event(SynthesizeStart(voice=SynthesizeVoice(name="bare")).event())
            await a.write_event(SynthesizeChunk(text="Good morning. Still").event())
            a_events = await _read_until(a, "audio-chunk", "error")
            await b.write_event(Synthesize(text="See you soon.", voice=SynthesizeVoice(name="en")).event())
            b_events = await _read_until(b, "audio-stop", "error")
            await a.write_event(SynthesizeChunk(text=" here.").event())
            await a.write_event(SynthesizeStop().event())
            a_events += await _read_until(a, "synthesize-stopped", "error")
            return a_events, b_events
        finally:
            await a.disconnect()
            await b.disconnect()

    a_events, b_events = _run(go())
    assert b_events[-1].type == "audio-stop" and a_events[-1].type == "synthesize-stopped"
    assert _audio(b_events) == _http_pcm(server, "See you soon.")
    assert _audio(a_events) == _http_pcm(server, "Good morning.", "bare") + continued_pcm(server.tts, "Still here.",
                                                                                          "bare", seed=1)


def test_disconnect_mid_stream_frees_the_sequence(server, tts):
    scheduler = server.app.state.server.serving.scheduler
    tokens_before = scheduler.stats()["tokens"]
    tts.llm.hold_after(60)  # the first chunk needs ~28 tokens; the sentence decodes hundreds
    try:
        async def go():
            client = await _connect(server.port)
            await client.write_event(SynthesizeStart().event())
            await client.write_event(SynthesizeChunk(text=LONG + " And").event())
            events = await _read_until(client, "audio-chunk", "error")
            assert scheduler.stats()["active_sequences"] == 1  # held: still decoding
            await client.disconnect()
            return events

        assert [e.type for e in _run(go())] == ["audio-start", "audio-chunk"]
        # the server cancels the sequence when it sees the connection end, before the LLM goes on
        _wait(lambda: all(r.cancelled for r in scheduler._active), "the sequence was not cancelled")
    finally:
        tts.llm.let_go()
    _wait(lambda: scheduler.stats()["active_sequences"] == 0, "the sequence was not released")
    assert scheduler.stats()["tokens"] - tokens_before <= 62, "the cancelled sequence decoded on"
    gate = server.app.state.server.serving.gate
    _wait(lambda: gate.running == 0, "the session kept its slot")
    assert _http_pcm(server, "After the disconnect.")  # still serving


def test_bad_requests_get_error_events(server):
    async def ask(*events, until=()):
        client = await _connect(server.port)
        try:
            for e in events:
                await client.write_event(e.event())
            return await _read_until(client, *until)  # by default up to the server closing the connection
        finally:
            await client.disconnect()

    def error(*events) -> Error:
        got = _run(ask(*events))
        assert [e.type for e in got] == ["error"], got
        return Error.from_event(got[0])

    e = error(Synthesize(text="Hi.", voice=SynthesizeVoice(name="nobody")))
    assert e.code == "voice_not_found" and "'nobody'" in e.text and "en" in e.text
    e = error(SynthesizeStart(voice=SynthesizeVoice(name="nobody")))
    assert e.code == "voice_not_found"
    assert error(Synthesize(text="   ")).code == "empty_text"
    assert error(Synthesize(text=" ... ")).code == "empty_text"
    assert error(SynthesizeStart(), SynthesizeChunk(text=" "), SynthesizeStop()).code == "empty_text"
    e = error(Synthesize(text="x" * 5000))
    assert e.code == "limit_exceeded" and "--max-input-chars" in e.text
    e = error(SynthesizeStart(), SynthesizeChunk(text="x" * 5000))  # a sentence that never ends
    assert e.code == "limit_exceeded"
    assert error(SynthesizeChunk(text="Hi.")).code == "protocol_error"
    assert error(Synthesize(text="Hi.", voice=SynthesizeVoice(language="tlh"))).code == "language_not_supported"
    gate = server.app.state.server.serving.gate
    _wait(lambda: gate.running == 0, "a refused request kept its slot")
    # a voice chosen by language speaks with the default voice
    got = _run(ask(Synthesize(text="Hi there.", voice=SynthesizeVoice(language="en-US")), until=["audio-stop"]))
    assert got[-1].type == "audio-stop"


def test_sentences_of_streamed_text():
    from cosyllama.text.normalize import take_sentences

    assert take_sentences("Hello there. How are") == (["Hello there."], " How are")
    assert take_sentences("It costs 3.") == ([], "It costs 3.")  # 3.5 or the end of a sentence: wait
    assert take_sentences("It costs 3.5 dollars! Ok") == (["It costs 3.5 dollars!"], " Ok")
    assert take_sentences('He said "hi." Then') == (['He said "hi."'], " Then")
    assert take_sentences("你好。我很好") == (["你好。"], "我很好")
    assert take_sentences("Items:\n- one\n- two") == (["Items:", "- one"], "- two")
    assert take_sentences("Wait... what? ") == (["Wait...", "what?"], " ")


def test_bench_script_measures_first_audio_over_wyoming(tmp_path, capsys):
    """scripts/bench_wyoming.py end to end on the tiny model (a run that works, not a timing)."""
    import json
    import runpy
    from pathlib import Path

    out = tmp_path / "wyoming.jsonl"
    main = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "bench_wyoming.py"))["main"]
    assert main(["--model-dir", str(MODEL_DIR), "--llm", "torch", "--threads", "1", "--requests", "2",
                 "--max-tokens", "60", "--prompt-seconds", "1", "--first-chunk-tokens", "none,8",
                 "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["first_chunk_tokens"] for r in rows] == ["ref", "8"]
    for row in rows:
        assert row["llm"] == "torch" and row["flow"] in ("fp32", "bf16", "int8") and row["max_tokens"] == 60
        assert len(row["first_audio_s"]) == 2 and all(t > 0 for t in row["first_audio_s"])
    assert "wyoming first audio" in capsys.readouterr().out


def test_bench_script_runs_sessions_at_once_to_their_ends(tmp_path, capsys):
    """scripts/bench_wyoming.py --concurrent: each session read to synthesize-stopped (a run that works)."""
    import json
    import runpy
    from pathlib import Path

    out = tmp_path / "wyoming.jsonl"
    main = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "bench_wyoming.py"))["main"]
    assert main(["--model-dir", str(MODEL_DIR), "--llm", "torch", "--threads", "1", "--requests", "1",
                 "--max-tokens", "30", "--prompt-seconds", "1", "--concurrent", "2", "--json", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["concurrent"] == 2 and len(row["first_audio_s"]) == len(row["end_s"]) == 2
    assert all(0 < first < end for first, end in zip(row["first_audio_s"], row["end_s"]))
    assert "2 sessions at once: first audio / end" in capsys.readouterr().out


def test_a_taken_port_is_a_clear_error(server):

    from cosyllama.errors import InputError
    from cosyllama.server.wyoming_server import start_wyoming

    serving = server.app.state.server.serving
    with pytest.raises(InputError, match=f"cannot listen at tcp://127.0.0.1:{server.port}"):
        _run(start_wyoming(f"tcp://127.0.0.1:{server.port}", serving))
