"""Bounded work per request on the HTTP server (tiny model, llama.cpp F32, loopback): text limits
refused with 413 naming the limit and its flag, a context that never grows, a long input beside a
short request, a client leaving during a long prefill; and a soak of `cosyllama serve` (slow)."""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import MODEL_DIR, slow_backend, wait_for_health

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")

from cosyllama.config import load_config  # noqa: E402
from cosyllama.limits import RequestLimits  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from cosyllama.text.normalize import SPLIT_MERGE_LEN  # noqa: E402
from helpers import LoopbackServer  # noqa: E402
from server_helpers import PROMPT_WAV, WAIT_S, wait_until  # noqa: E402
from server_helpers import speech as _speech  # noqa: E402
from server_helpers import wait_idle as _wait_idle  # noqa: E402

PARALLEL, SEQ_TOKENS = 8, 4096
PROSE = ("The quick brown fox jumps over the lazy dog near the river bank, and then it runs away into the "
         "forest. ")


@pytest.fixture(scope="module")
def backend(tiny_gguf):
    from cosyllama.llm.llamacpp_backend import LlamaCppLLM

    # what `cosyllama serve` makes: the context sized once for PARALLEL sequences of SEQ_TOKENS
    inner = LlamaCppLLM(tiny_gguf("speech", "F32"), load_config(MODEL_DIR), n_threads=1, n_seq_max=PARALLEL,
                        max_seq_tokens=SEQ_TOKENS, n_ctx=PARALLEL * SEQ_TOKENS)
    yield slow_backend(inner)
    inner.close()


@pytest.fixture(scope="module")
def tts(backend):
    from cosyllama.tts import TTS

    return TTS(MODEL_DIR, llm="llamacpp", llm_backend=backend)


def _register(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/voices", files={"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")},
                   data={"text": "Hello, this is my voice.", "id": "en", "replace": "true"})
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def server(tts):
    srv = LoopbackServer(create_app(tts, ServeOptions(ServingOptions(tts.options), max_prompt_bytes=1_000_000)))
    _register(srv.url)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _refused(r, flag: str, limit: int) -> str:
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["type"] == "request_too_large"
    assert flag in err["message"] and str(limit) in err["message"], err["message"]
    return err["message"]


def test_text_over_a_limit_is_refused_naming_it(client):
    lim = RequestLimits()
    _refused(_speech(client, "Hi.", instructions="x" * 20_000), "--max-instructions-chars", lim.instructions_chars)
    _refused(_speech(client, "Hi.", instructions="x" * 100_000), "--max-instructions-chars", lim.instructions_chars)
    # under the character limit, over the token limit (digits are one token each)
    _refused(_speech(client, "Hi.", instructions="1 " * 400), "--max-instructions-tokens", lim.instructions_tokens)
    _refused(_speech(client, "x" * (lim.input_chars + 1)), "--max-input-chars", lim.input_chars)
    # one 1,600-token sentence: up to 20 speech tokens per text token do not fit one sequence
    msg = _refused(_speech(client, "word " * 800), "--max-seq-tokens", SEQ_TOKENS)
    assert "LLM positions" in msg
    h = _wait_idle(client, llm=True)
    assert h["llm"]["n_ctx"] == PARALLEL * SEQ_TOKENS  # made once at start, never grown
    assert _speech(client, "Hi.", instructions="Speak slowly.").status_code == 200
    assert client.get("/health").json()["llm"]["n_ctx"] == PARALLEL * SEQ_TOKENS


def test_limits_come_from_the_serving_options(tts):
    """Tighter limits given to the serving options apply to every field (the transcript of a new voice too)."""
    small = RequestLimits(input_chars=20, instructions_tokens=12, transcript_chars=10)
    srv = LoopbackServer(create_app(tts, ServeOptions(ServingOptions(tts.options, limits=small),
                                                      max_prompt_bytes=1_000_000)))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/voices", files={"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")},
                       data={"text": "A transcript longer than ten characters.", "id": "t"})
            assert r.status_code // 100 == 4 and "--max-transcript-chars" in r.json()["error"]["message"]
            _refused(c.post("/v1/audio/speech", json={"input": "A sentence of more than twenty characters.",
                                                      "voice": "nobody"}), "--max-input-chars", 20)
    finally:
        srv.stop()
    with pytest.raises(ValueError, match="max_seq_tokens"):
        create_app(tts, ServingOptions(tts.options, limits=RequestLimits(seq_tokens=SEQ_TOKENS + 1)))


SHORT_TEXT = "Hi there."  # 5 text tokens; each segment of the long input has at least SPLIT_MERGE_LEN (20)
BESIDE_SEGMENTS = 4  # segments of the long input that may start while one short request runs (fair: about 1)


class _Normalizing:
    """The served pipeline's text normalizer, delegating, that appends ``("long normalizing", n)`` and
    ``("long normalized", segments)`` to ``events`` around a text of ``n`` >= 1,000 characters."""

    def __init__(self, inner, events: list):
        self.inner, self.events = inner, events

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def normalize(self, text, *args, **kw):
        long = len(text) >= 1000
        if long:
            self.events.append(("long normalizing", len(text)))
        out = self.inner.normalize(text, *args, **kw)
        if long:
            self.events.append(("long normalized", len(out)))
        return out


class _Segments:
    """The served pipeline's token source, delegating, that appends ``("long segment", n)`` to
    ``events`` when a segment of ``n`` >= SPLIT_MERGE_LEN text tokens starts decoding (a segment of
    the long input, not SHORT_TEXT)."""

    def __init__(self, inner, events: list):
        self.inner, self.events = inner, events

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def generate(self, prefill, n_text_tokens, *args, **kw):
        if n_text_tokens >= SPLIT_MERGE_LEN:
            self.events.append(("long segment", n_text_tokens))
        return self.inner.generate(prefill, n_text_tokens, *args, **kw)


def _short(url: str, events: list, i: int) -> None:
    events.append(("short start", i))
    with httpx.Client(base_url=url, timeout=WAIT_S) as c:
        try:
            r = _speech(c, SHORT_TEXT)
        except httpx.TimeoutException:
            pytest.fail(f"short request {i} had no answer after {WAIT_S} s beside the long input: {events}")
    assert r.status_code == 200, r.text
    events.append(("short done", i))


def _between(events: list, first, last) -> list:
    return events[events.index(first) + 1:events.index(last)]


def test_long_input_beside_a_short_request(tts):
    """A 4,000-character input (20 segments) beside short requests, asserted by the order of what
    the server did and by counts, never by how long it took (a busy machine only makes it slower):

    * in its frontend: while its text is in the normalization process (stopped with SIGSTOP for as
      long as the test likes), a short request completes. Normalized in the server's process,
      wetext would hold the GIL and the lock every text's normalization takes: no short request
      could finish before the long text's normalization;
    * streaming: each of three short requests completes while at most BESIDE_SEGMENTS of the long
      input's segments start (the scheduler decodes them in the same steps: about one), and
      before the long input ends; a long input run to completion first starts all of its
      remaining segments meanwhile."""
    app = create_app(tts, ServeOptions(ServingOptions(tts.options), max_prompt_bytes=1_000_000))
    served = app.state.server.tts
    events: list = []  # appended by the server's threads and the test's, in the order they happened
    served.normalizer = _Normalizing(served.normalizer, events)
    served.token_source = _Segments(served.token_source, events)
    child = served.normalizer.inner._worker.pid  # the normalization process of long texts
    srv = LoopbackServer(app)
    long_text = (PROSE * 40)[:4000]
    stop = threading.Event()
    statuses = []

    def run_long():
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            with c.stream("POST", "/v1/audio/speech", json={"input": long_text, "voice": "en", "greedy": True,
                                                            "stream": True, "response_format": "pcm"}) as r:
                statuses.append(r.status_code)
                for _ in r.iter_bytes():
                    if stop.is_set():
                        return  # leaving the block drops the connection: the server cancels it
        events.append(("long done", None))

    t = threading.Thread(target=run_long)
    stopped = False
    try:
        _register(srv.url)
        os.kill(child, signal.SIGSTOP)
        stopped = True
        t.start()
        wait_until(lambda: events and events[0][0] == "long normalizing", "the long input never reached its frontend")
        _short(srv.url, events, 0)  # beside the long input's normalization, held
        os.kill(child, signal.SIGCONT)
        stopped = False
        wait_until(lambda: ("long segment" in (e[0] for e in events)), "the long input does not decode")
        for i in (1, 2, 3):
            _short(srv.url, events, i)
        stop.set()
        t.join(WAIT_S)
        assert not t.is_alive(), "the long request did not end when its client left"
        with httpx.Client(base_url=srv.url, timeout=WAIT_S) as c:
            _wait_idle(c, llm=True)  # its sequence is freed
    finally:
        if stopped:
            os.kill(child, signal.SIGCONT)
        stop.set()
        if t.ident is not None:
            t.join(WAIT_S)
        srv.stop()
    print("\n".join(f"{what} {detail}" for what, detail in events))
    assert statuses == [200]
    whats = [e[0] for e in events]
    n_segments = next(n for what, n in events if what == "long normalized")
    assert n_segments >= 15, n_segments
    assert whats.index("short done") < whats.index("long normalized"), \
        "a short request waited for the long input's normalization"
    for i in (1, 2, 3):
        beside = [e for e in _between(events, ("short start", i), ("short done", i)) if e[0] == "long segment"]
        assert len(beside) <= BESIDE_SEGMENTS, f"short request {i}: {len(beside)} segments of the long input beside it"
    assert ("long done", None) not in events[:events.index(("short done", 3))], "the long input ended first"


def test_client_leaving_during_a_long_prefill_frees_its_sequence(tts, backend):
    """A 1,300-position prompt prefilled at 2 ms per position (11 pieces of 128 positions, 0.26 s
    each): the client leaves once its first piece has run and its sequence is freed before the
    prompt is all in. Counted in pieces, not timed: the client leaves when the prefill has begun,
    whatever the machine's speed, and a busy machine makes the pieces slower, not more."""
    import json

    app = create_app(tts, ServingOptions(tts.options, limits=RequestLimits(instructions_chars=8000,
                                                                           instructions_tokens=2000)))
    srv = LoopbackServer(app)

    def pieces() -> int:
        return app.state.server.serving.scheduler.stats()["prefill_pieces"]

    body = json.dumps({"input": "Hi.", "voice": "en", "greedy": True,
                       "instructions": "1" * 1280 + " Speak slowly."}).encode()
    try:
        _register(srv.url)
        backend.position_delay = 0.002
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            wait_until(lambda: pieces() >= 1, "the prompt is not being prefilled")
        # the socket is closed: the client left during the prefill
        with httpx.Client(base_url=srv.url, timeout=WAIT_S) as c:
            h = _wait_idle(c, timeout=WAIT_S, llm=True)  # only a hang reaches the timeout
        assert not backend.prefilling, h
        ran = pieces()
    finally:
        backend.position_delay = 0.0
        srv.stop()
    print(f"{ran} prefill pieces ran")
    assert 1 <= ran < 10  # it was prefilling in pieces and stopped before the 11th


# ----------------------------------------------------------------------------------------------
# Soak: `cosyllama serve` in its own process, 500 mixed requests


SOAK_TEXTS = [f"{w} number {i}." for i, w in enumerate(
    ["Hello there", "Good morning to you", "How are you today", "See you soon, my friend", "One two three four",
     "Nice to meet you at last", "It is raining again", "Thank you very much for coming", "Where is the station",
     "The weather is lovely this week"] * 3)]


def _server_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _soak_request(url: str, i: int) -> tuple[str, object]:
    """Request ``i`` of the soak: (kind, HTTP status or "left")."""
    body = {"input": SOAK_TEXTS[i % len(SOAK_TEXTS)], "voice": "bare" if i % 3 == 1 else "en", "seed": i,
            "response_format": ("wav", "pcm", "flac")[i % 3]}
    kind = ("valid", "valid", "valid", "stream", "stream", "instruct", "invalid", "invalid", "left", "left")[i % 10]
    if kind == "stream":
        body.update(stream=True, response_format="pcm")
    elif kind == "instruct":
        body["instructions"] = "Speak slowly."
    elif kind == "invalid":
        body = ({"input": "Hi.", "voice": "nobody"}, {"input": "Hi.", "voice": "en", "instructions": "x" * 5000},
                {"input": "Hi.", "voice": "en", "temperature": 1}, {"input": " ", "voice": "en"})[i // 10 % 4]
    with httpx.Client(base_url=url, timeout=120) as c:
        if kind == "left":
            body.update(stream=True, response_format="pcm")
            with c.stream("POST", "/v1/audio/speech", json=body) as r:
                if r.status_code == 200:
                    next(r.iter_bytes())  # one chunk, then the connection is dropped
                return kind, "left" if r.status_code == 200 else r.status_code
        return kind, c.post("/v1/audio/speech", json=body).status_code


@pytest.mark.slow
def test_soak_rss_flat_and_no_request_lost(tiny_gguf, tmp_path):
    """500 mixed requests (valid, invalid, clients leaving mid-stream), 8 at a time, against
    `cosyllama serve` in its own process: RSS after the last (once the requests in flight are
    done) is within 5 % of RSS after the 100th, and every request got its expected answer."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(Path(__file__).parents[1] / "src"),
                                                                 os.environ.get("PYTHONPATH", "")] if p))
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "cosyllama.cli", "serve", "--model-dir", str(MODEL_DIR),
                             "--gguf", str(tiny_gguf("speech", "F32")), "--port", str(port), "--threads", "1"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url, tmp_path / "serve.log", 120)
        _register(url)
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.post("/v1/voices", files={"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")},
                          data={"id": "bare"}).status_code == 200
        n_ctx = httpx.get(f"{url}/health").json()["llm"]["n_ctx"]
        rss, outcomes = {}, [None] * 500

        def run(i):
            outcomes[i] = _soak_request(url, i)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool, httpx.Client(base_url=url, timeout=10) as c:
            for lo, hi in ((0, 100), (100, 500)):  # RSS once the requests in flight are done
                list(pool.map(run, range(lo, hi)))
                h = _wait_idle(c, llm=True)
                rss[hi] = _server_rss_mb(proc.pid)
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    expected = {"valid": {200}, "stream": {200}, "instruct": {200}, "invalid": {404, 413, 422}, "left": {"left"}}
    wrong = [(i, o) for i, o in enumerate(outcomes) if o is None or o[1] not in expected[o[0]]]
    counts = {k: sum(o[0] == k for o in outcomes) for k in expected}
    print(f"soak: 500 requests {counts} in {wall:.0f} s, 8 concurrent, on {platform.machine()} "
          f"{os.cpu_count()} CPUs; server RSS after 100: {rss[100]:.0f} MB, after 500: {rss[500]:.0f} MB "
          f"({100 * (rss[500] / rss[100] - 1):+.1f} %)")
    assert not wrong, wrong[:10]
    assert h["llm"]["n_ctx"] == n_ctx and h["decoded_tokens"] > 0
    assert rss[500] <= 1.05 * rss[100]
