"""What the server puts on the wire around the audio: the media type of each encoding, and the ASGI
pieces around the routes (a request-body limit, an ``x-request-id`` on every response, a streaming
response that always cleans up). Needs the ``server`` extra. The encodings themselves (wav, pcm, flac,
mp3, opus, aac; whole or chunk by chunk) are :mod:`cosyllama.audio_out`'s, imported here for the routes.
"""

from __future__ import annotations

import re
import uuid

import anyio
from fastapi.responses import JSONResponse, StreamingResponse

from ..audio_out import (  # noqa: F401 - the encoders the routes use, from the one audio-output module
    AAC_HINT,
    FORMATS,
    PCM_BYTES,
    STREAMABLE,
    StreamEncoder,
    aac_available,
    encode,
    wav_header,
)
from .errors import error_body, server_failure

MEDIA_TYPES = {"mp3": "audio/mpeg", "wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "opus": "audio/ogg",
               "aac": "audio/aac"}
DEFAULT_FORMAT = "mp3"  # OpenAI's default response_format


class AudioStream(StreamingResponse):
    """A streaming response that always runs ``cleanup`` when it ends, also when the client left
    before the body started (an async generator that never started would not run its ``finally``)."""

    def __init__(self, content, cleanup, media_type: str, headers: dict[str, str] | None = None):
        super().__init__(content, media_type=media_type, headers=headers)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup()


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413, by its Content-Length before
    anything reads it, or (a chunked body, counted as it arrives) as soon as the count passes the
    limit: the app sees the client gone, and what it answers to that is replaced by the 413."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def _too_large(self) -> JSONResponse:
        msg = f"the request body is larger than {self.limit} bytes"
        return JSONResponse(error_body(msg, "request_too_large"), status_code=413, headers={"Connection": "close"})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._too_large()(scope, receive, send)
        seen = 0
        over = started = False

        async def counted():
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    over = True
                    return {"type": "http.disconnect"}  # stop reading; the request fails as abandoned
            return message

        async def checked_send(message):
            nonlocal started
            if over and not started:
                return  # the app's answer to a body it did not get whole: the 413 goes instead
            started = True
            await send(message)

        try:
            await self.app(scope, counted, checked_send)
        except Exception:
            if not over or started:
                raise
        if over and not started:
            await self._too_large()(scope, receive, send)


REQUEST_ID_HEADER = "x-request-id"
# a client's id is echoed when it is 1-128 printable ASCII characters without spaces; otherwise the
# response carries a new one (a header a client sets is bounded like everything else it sends)
_CLIENT_ID = re.compile(rb"[\x21-\x7e]{1,128}")


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


class RequestId:
    """ASGI middleware: every HTTP response carries ``x-request-id``, the request's own when it sent
    a usable one, else a new ``req_<32 hex digits>`` (OpenAI's header; clients such as LiveKit's log
    it). It stands outermost, so refusals (401, 403, 413) carry it too, and an unexpected error
    gets the 500 answer here, with the header, before Starlette's last-resort handler sees it. The
    id is also on ``scope["state"]["request_id"]`` for the routes' log lines."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers") or ()).get(REQUEST_ID_HEADER.encode())
        rid = sent.decode("ascii") if sent is not None and _CLIENT_ID.fullmatch(sent) else new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(REQUEST_ID_HEADER.encode(), rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, with_id)
        except Exception:
            if not started:
                failure = server_failure()
                await JSONResponse(failure.body(), status_code=failure.status)(scope, receive, with_id)
            raise
