"""One rule per thing across the server's doors (issue #53): one voice resolver with one not-found error, one
error mapper that every path reaches (a route just raises the project's exceptions) and one OpenAI error body."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from test_structure import PACKAGE

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from cosyllama.errors import InputError  # noqa: E402
from cosyllama.limits import LimitExceeded, RequestLimits  # noqa: E402
from cosyllama.request import RequestError  # noqa: E402
from cosyllama.server.admission import ServerBusyError  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.errors import Refusal, api_error, error_body  # noqa: E402
from cosyllama.server.options import ServingOptions  # noqa: E402
from cosyllama.server.voice_names import VoiceNames  # noqa: E402
from cosyllama.tts import TTS  # noqa: E402
from cosyllama.voices import UnknownVoiceError, VoiceStore  # noqa: E402


@pytest.fixture(scope="module")
def view(tts, voice):
    v = TTS.from_models(tts.models, voices=VoiceStore())
    v.voices.add("en", voice)
    return v


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
