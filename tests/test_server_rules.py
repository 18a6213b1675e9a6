"""One rule per thing across the server's doors (issue #53): one voice resolver with one not-found error, one
error mapper that every path reaches (a route just raises the project's exceptions), one OpenAI error body, one
request vocabulary that the HTTP route and the WebSocket codec both import, and one place where the server's
defaults meet what a client sent, which leaves the client's body as it came."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest

from test_structure import PACKAGE, import_graph

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from cosyllama.errors import InputError  # noqa: E402
from cosyllama.limits import LimitExceeded, RequestLimits  # noqa: E402
from cosyllama.request import RequestError, SynthesisOptions  # noqa: E402
from cosyllama.server.admission import ServerBusyError  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.errors import Refusal, api_error, error_body  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from cosyllama.server.voice_names import VoiceNames  # noqa: E402
from cosyllama.tts import TTS  # noqa: E402
from cosyllama.voices import UnknownVoiceError, VoiceStore  # noqa: E402

SERVER = "cosyllama.server"


@pytest.fixture(scope="module")
def view(tts, voice):
    v = TTS.from_models(tts.models, voices=VoiceStore())
    v.voices.add("en", voice)
    return v


# -- the vocabulary -------------------------------------------------------------------------------------------


def test_the_websocket_codec_and_the_http_route_share_the_vocabulary_not_each_other():
    """Following a field from a ``session.config`` to the synthesis enters the codec and the vocabulary once
    each: the codec imports the vocabulary and the job, never the HTTP route's modules."""
    graph = import_graph()
    codec = graph[f"{SERVER}.speech_stream"]
    assert f"{SERVER}.openai_speech" in codec and f"{SERVER}.openai_speech" in graph[f"{SERVER}.speech_route"]
    assert not codec & {f"{SERVER}.speech", f"{SERVER}.speech_route"}, codec
    # Wyoming (its own extra, without fastapi) finds its voices where the HTTP app does
    assert f"{SERVER}.voice_names" in graph[f"{SERVER}.wyoming_service"] & graph[f"{SERVER}.app"]


def test_the_servers_defaults_fill_in_and_the_clients_body_is_left_as_it_came(tts, voice):
    """``--seed``, ``--greedy``, ``--speed``, ``--loudness``, ``--retries`` reach a request that gives none
    through ``ServingOptions.request_options``, the overlay Wyoming uses too; the body the client sent is not
    written to (it once was, field by field)."""
    from cosyllama.server.openai_speech import SpeechRequest, check_request

    defaults = SynthesisOptions(seed=5, greedy=True, speed=1.25, loudness=-20.0, retries=2)
    options = ServingOptions(tts.options, defaults=defaults)
    store = VoiceStore()
    store.add("en", voice)
    state = SimpleNamespace(serving=SimpleNamespace(options=options), tts=SimpleNamespace(voices=store,
                            frontend=tts.frontend), limits=RequestLimits(), voice_names=VoiceNames())

    body = SpeechRequest(input="Hi there.", voice="en")
    sent = body.model_dump()
    streaming, request = asyncio.run(check_request(body, state))
    assert body.model_dump() == sent and body.model_fields_set == {"input", "voice"}
    assert streaming is None and request.options == replace(defaults, stream=False)
    assert request.options == options.request_options(streams=True)  # Wyoming's, at a speed other than 1

    own = SpeechRequest(input="Hi there.", voice="en", speed=1, seed=None, response_format="pcm",
                        stream_format="audio")
    _, request = asyncio.run(check_request(own, state))
    assert (own.speed, own.seed, own.greedy) == (1, None, False)
    assert request.options == replace(defaults, speed=1.0, seed=None, stream=True)  # a null seed is the client's


# -- the voice resolver ---------------------------------------------------------------------------------------


def test_a_voice_not_found_is_one_error_on_every_door(tts, voice):
    """HTTP's and Wyoming's names are one resolver's (:class:`VoiceNames`): an unknown name, a voice that cannot
    be read, no voice at all are each an :class:`UnknownVoiceError`, which every door answers as its not-found."""
    from cosyllama.server.errors import websocket_error, wyoming_error

    class Broken(VoiceStore):
        def get(self, voice_id):
            if voice_id == "broken":
                raise InputError("/srv/voices/broken.pt: not a voice file (EOFError)")
            return super().get(voice_id)

    store = Broken()
    store.add("en", voice)
    store.add("broken", voice)
    for names in (VoiceNames(), VoiceNames.wyoming(None)):
        for name in ("nobody", "broken"):
            with pytest.raises(UnknownVoiceError) as ei:
                names.resolve(store, name)
            assert "/srv" not in str(ei.value)
            err = api_error(ei.value)
            assert (err.status, err.code, err.param, err.type) == (404, "voice_not_found", "voice", "not_found_error")
            assert websocket_error(ei.value, {})[0]["code"] == wyoming_error(ei.value, {})[1] == "voice_not_found"
    assert VoiceNames.wyoming(None).voice_id(store, None) == "broken"  # the first registered voice
    with pytest.raises(UnknownVoiceError, match="no voice is registered"):
        VoiceNames.wyoming(None).resolve(VoiceStore(), None)

    pytest.importorskip("wyoming")
    from wyoming.tts import SynthesizeVoice

    from cosyllama.server.wyoming_service import WyomingService

    serving = SimpleNamespace(options=ServingOptions(tts.options), tts=SimpleNamespace(voices=store),
                              limits=RequestLimits())
    with pytest.raises(UnknownVoiceError):
        WyomingService(serving).voice(SynthesizeVoice(name="nobody"))


def test_a_voice_that_cannot_be_read_is_not_found_over_http_too(view, monkeypatch, caplog):
    """A voice whose file went bad is a 404 naming no path over HTTP, as it was on Wyoming (it was a 500)."""
    real_get = type(view.voices).get

    def get(self, voice_id):
        if voice_id == "en":
            raise InputError("/srv/voices/en.pt: not a voice file (EOFError: Ran out of input)")
        return real_get(self, voice_id)

    monkeypatch.setattr(type(view.voices), "get", get)
    with TestClient(create_app(view), raise_server_exceptions=False) as c:
        r = c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "en"})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("voice_not_found", "voice") and "/srv" not in err["message"]
    assert "en.pt" in caplog.text  # the operator's log says why


# -- the error mapper and the body ----------------------------------------------------------------------------


RAISED = {
    "refusal": Refusal("not here", "no_such_thing", status=403, param="id"),
    "unknown-voice": UnknownVoiceError("unknown voice 'x'; registered voices: en"),
    "limit": LimitExceeded("input is 10 characters; at most 5 (--max-input-chars)", field="input", limit=5,
                           flag="--max-input-chars"),
    "busy": ServerBusyError("the server is busy"),
    "request": RequestError("speed", "{speed} must be between 0.25 and 4.0"),
    "input": InputError("a bad clip"),
}


def test_a_route_just_raises_and_the_app_answers_through_the_mapper(view):
    """The app's handler maps the project's exceptions as :func:`api_error` does (status, body, Retry-After),
    so no route builds an HTTP error or calls the mapper itself (they were 500s)."""
    app = create_app(view)

    async def raising(kind: str):
        raise RAISED[kind]

    app.add_api_route("/raise/{kind}", raising)
    with TestClient(app, raise_server_exceptions=False) as c:
        for kind, e in RAISED.items():
            r = c.get(f"/raise/{kind}")
            want = api_error(e)
            assert (r.status_code, r.json()) == (want.status, want.body()), kind
            assert r.headers.get("retry-after") == (want.headers or {}).get("Retry-After")
    assert api_error(RAISED["refusal"]).type == "permission_error"  # a refusal's type is its status's


def test_the_openai_error_body_is_built_in_one_place():
    """``{"error": {...}}`` is written by ``errors.error_body`` only: the connection guard's raw answers and the
    origin and key checks use it too."""
    built = [p.name for p in sorted((PACKAGE / "server").glob("*.py"))
             if re.search(r"""["']error["']\s*:\s*\{\s*["']message["']\s*:""", p.read_text(encoding="utf-8"))]
    assert built == ["errors.py"], built
    from cosyllama.server.conn import _raw_response

    head, _, body = _raw_response(408, "Request Timeout", "late", "invalid_request_error", "request_timeout") \
        .partition(b"\r\n\r\n")
    import json

    assert json.loads(body) == error_body("late", "invalid_request_error", code="request_timeout")


# -- the options ----------------------------------------------------------------------------------------------


def test_create_app_takes_the_serving_options(view):
    """``create_app(tts, options)``: a :class:`ServingOptions` (or the :class:`ServeOptions` around one) is what a
    test or script gives, not keywords repeating their fields."""
    with TestClient(create_app(view, ServingOptions(view.options, max_concurrent=3, max_queue=1))) as c:
        health = c.get("/health").json()
    assert (health["max_concurrent"], health["max_queue"]) == (3, 1)
    app = create_app(view, ServeOptions(ServingOptions(view.options, max_queue=2), api_key="k"))
    with TestClient(app) as c:
        assert c.get("/health").json()["max_queue"] == 2
        assert c.get("/v1/voices").status_code == 401
    with pytest.raises(TypeError):
        create_app(view, max_concurrent=3)
