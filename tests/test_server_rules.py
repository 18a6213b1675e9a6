"""One rule per thing across the server's doors (issue #53): one error mapper that every path reaches (a route
just raises the project's exceptions) and one OpenAI error body."""

from __future__ import annotations

import re

import pytest

from test_structure import PACKAGE

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from cosyllama.errors import InputError  # noqa: E402
from cosyllama.limits import LimitExceeded  # noqa: E402
from cosyllama.request import RequestError  # noqa: E402
from cosyllama.server.admission import ServerBusyError  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.errors import Refusal, api_error, error_body  # noqa: E402
from cosyllama.tts import TTS  # noqa: E402
from cosyllama.voices import UnknownVoiceError, VoiceStore  # noqa: E402


@pytest.fixture(scope="module")
def view(tts, voice):
    v = TTS.from_models(tts.models, voices=VoiceStore())
    v.voices.add("en", voice)
    return v


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
