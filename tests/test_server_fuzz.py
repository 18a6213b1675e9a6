"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis + hypothesis):
requests that fit the schema and requests that break it, against the server on loopback (tiny
model, llama.cpp F32). No answer may be a 5xx other than 503 (busy). The default run is bounded
by examples and by a time budget; ``-m slow`` runs more, with fresh random examples."""

from __future__ import annotations

import time

import pytest

from helpers import MODEL_DIR

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cosyllama.config import load_config  # noqa: E402
from cosyllama.limits import RequestLimits  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from helpers import LoopbackServer  # noqa: E402
from server_helpers import PROMPT_WAV  # noqa: E402

VOICE = "en"
MAX_INPUT_CHARS = 48  # keeps each synthesis of generated text short; longer input gets 413


@pytest.fixture(scope="module")
def server(tiny_gguf):
    from cosyllama.llm.llamacpp_backend import LlamaCppLLM
    from cosyllama.tts import TTS

    backend = LlamaCppLLM(tiny_gguf("speech", "F32"), load_config(MODEL_DIR), n_threads=1, n_seq_max=4)
    tts = TTS(MODEL_DIR, llm="llamacpp", llm_backend=backend)
    options = ServingOptions(tts.options, limits=RequestLimits(input_chars=MAX_INPUT_CHARS))
    srv = LoopbackServer(create_app(tts, ServeOptions(options, max_prompt_bytes=1_000_000)))
    yield srv
    srv.stop()
    backend.close()


def _ensure_voice(url: str) -> None:
    ids = [v["id"] for v in httpx.get(f"{url}/v1/voices", timeout=60).json()["voices"]]
    if VOICE not in ids:
        r = httpx.post(f"{url}/v1/voices", files={"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")},
                       data={"text": "Hello, this is my voice.", "id": VOICE}, timeout=60)
        assert r.status_code == 200, r.text


def _reach_synthesis(body: dict) -> None:
    """Make a generated speech body one the route accepts, so that it reaches synthesis: a
    registered voice, and not what the route refuses whatever the values (the schema cannot say it):
    stream=false beside a stream_format, a lexicon of made-up tokens, a loudness or retries out of range."""
    body["voice"] = VOICE
    if body.get("stream_format") is not None and body.get("stream") is False:
        del body["stream"]
    body.pop("lexicon", None)
    body.pop("loudness", None)
    if isinstance(body.get("retries"), int):
        body["retries"] = min(max(body["retries"], 0), 5)
    if not (isinstance(body.get("input"), str) and body["input"].isprintable() and body["input"].strip()):
        body["input"] = "Hello there."  # the text's own rules are fuzzed where nothing is repaired
    for name in ("instructions", "mode"):  # their combinations are the request rules' tests (test_request.py)
        body.pop(name, None)


def _fuzz(server, max_examples: int, budget_s: float, derandomize: bool):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    positive, negative = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
    speech = schema["/v1/audio/speech"]["POST"].as_strategy(generation_mode=positive)
    # valid speech requests three times as often as the rest: they reach synthesis
    cases = st.one_of(speech, speech, speech, schema.as_strategy(generation_mode=positive),
                      schema.as_strategy(generation_mode=negative))
    seen: dict[str, int] = {}
    deadline = time.monotonic() + budget_s

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck))
    @given(case=cases, repair=st.integers(0, 3))
    def run(case, repair):
        if time.monotonic() > deadline:
            return  # out of time: the remaining examples pass at once
        _ensure_voice(server.url)
        if repair and isinstance(case.body, dict) and "voice" in case.body:
            _reach_synthesis(case.body)
        response = case.call(base_url=server.url, timeout=60)
        key = f"{case.method} {case.operation.path} {response.status_code}"
        seen[key] = seen.get(key, 0) + 1
        assert response.status_code < 500 or response.status_code == 503, (
            f"{response.status_code} for {case.method} {case.formatted_path} body={case.body!r}: "
            f"{response.text[:500]}")

    run()
    return seen


def test_fuzz_the_api_from_its_schema(server):
    # no time budget here: the examples are derandomized, so which of them reach synthesis must not depend on how
    # busy the machine is (with a 40 s budget a loaded machine cut the run before any speech reached a 200)
    seen = _fuzz(server, max_examples=200, budget_s=float("inf"), derandomize=True)
    print(sorted(seen.items()))
    assert any(k.startswith("POST /v1/audio/speech 200") for k in seen), seen  # synthesis was reached


@pytest.mark.slow
def test_fuzz_the_api_longer(server):
    seen = _fuzz(server, max_examples=1500, budget_s=600, derandomize=False)
    print(sorted(seen.items()))
