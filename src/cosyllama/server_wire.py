"""What the server puts on the wire: audio encodings (wav, pcm, flac) and the ASGI pieces around
the routes (a request-body limit, a streaming response that always cleans up). Needs the
``server`` extra."""

from __future__ import annotations

import io
import struct

import anyio
import numpy as np
from fastapi.responses import JSONResponse, StreamingResponse

PCM_BYTES = 2  # 16-bit samples on the wire
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}


def pcm16(samples: np.ndarray) -> bytes:
    """float32 samples in [-1, 1] -> 16-bit little-endian PCM (clipped)."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_header(sample_rate: int, n_data_bytes: int | None) -> bytes:
    """44-byte RIFF/WAVE header for 16-bit mono PCM. ``None``: unknown length (streaming), written
    as the largest size, which players read as "until the end of the stream"."""
    data = 0xFFFFFFFF if n_data_bytes is None else n_data_bytes
    riff = 0xFFFFFFFF if n_data_bytes is None else 36 + n_data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * PCM_BYTES, PCM_BYTES, 16)
            + b"data" + struct.pack("<I", data))


def encode(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """A whole response body in ``fmt`` (wav | pcm | flac)."""
    if fmt == "flac":
        import soundfile as sf

        buf = io.BytesIO()  # the same 16-bit samples as wav/pcm (soundfile's own float rounding differs)
        sf.write(buf, np.frombuffer(pcm16(samples), "<i2"), sample_rate, format="FLAC", subtype="PCM_16")
        return buf.getvalue()
    body = pcm16(samples)
    return wav_header(sample_rate, len(body)) + body if fmt == "wav" else body


class AudioStream(StreamingResponse):
    """A streaming response that always runs ``cleanup`` when it ends, also when the client left
    before the body started (an async generator that never started would not run its ``finally``)."""

    def __init__(self, content, cleanup, media_type: str):
        super().__init__(content, media_type=media_type)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup()


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 (by its Content-Length) or is
    cut off (a chunked body is counted as it arrives), before anything parses it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            msg = f"the request body is larger than {self.limit} bytes"
            response = JSONResponse({"error": {"message": msg, "type": "request_too_large"}}, status_code=413)
            return await response(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    return {"type": "http.disconnect"}  # stop reading; the request fails as abandoned
            return message

        return await self.app(scope, counted, send)
