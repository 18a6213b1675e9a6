"""``/v1/audio/speech/stream``: text in as it is written (an LLM's answer, piece by piece), audio out
per sentence as soon as each sentence is complete, over a WebSocket. Needs the ``server`` extra
(with ``websockets``, uvicorn's WebSocket implementation).

The messages are vLLM-Omni's (its endpoint of the same path; docs/server.md says where this one
differs). The client sends JSON text messages:

* ``session.config``: first; the fields of ``POST /v1/audio/speech`` but ``input`` (``voice``,
  ``response_format``, ``speed``, ``seed``, ``greedy``, ``instructions``, ``mode``, ``model``),
  checked the same way (:func:`cosyllama.server.speech.check_request`), plus ``stream_audio``
  (send each sentence's audio as it is made, not as one frame) and ``split_granularity``
  (``sentence``, the default here, or ``none``: the whole text at ``input.done``). It may be sent
  again between utterances.
* ``input.text`` (``text``): a piece of text; each sentence it completes is queued
  (:class:`~cosyllama.server.serving.SentenceStream`, the Wyoming server's sentence cutting).
* ``input.done``: the end of an utterance: the rest is spoken as its last sentence, then the server
  answers ``session.done``; the connection stays open for the next one.
* ``session.close``: the queued sentences are spoken, then the server closes the connection.

The server answers, per sentence, ``audio.start`` (``utterance_index``, ``sentence_index``,
``sentence_text``, ``format``, ``sample_rate``, ``channels``), the audio as binary frames (one
whole file, or pieces of one stream with ``stream_audio``), ``audio.done`` (``total_bytes``,
``error``); per utterance ``session.done`` (``total_sentences``). A refusal or failure is an
``error`` message (``message``, ``code``, ``param``), after which the server closes the
connection (1008 for a client's mistake or a bound, 1009 for a message too large, 1013 when the
server is busy, 1011 for a failure of the server).

An utterance holds one of the server's running slots (the admission gate of the HTTP routes) from
its first sentence to its ``session.done``; each sentence is one scheduler request, decoded with
everyone else's. Everything a client controls is bounded: a message's size, a piece, a sentence
and the text waiting for its end (``--max-input-chars``), the session's text in all
(``--max-session-chars``), the time with nothing to do (``--idle-timeout``: no message and no
audio being made) and a client that stops reading (``--write-timeout``). A client that goes
away cancels its sentence at once: its LLM sequence is released at the next decode step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, replace
from typing import Literal

import anyio
import numpy as np
from fastapi import APIRouter, WebSocket
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocketDisconnect

from ..limits import LimitExceeded
from ..llm.scheduler import RequestCancelled
from ..request import HTTP_NAMES, RequestError, SynthesisRequest
from .common import ApiError, admission
from .conn import ConnectionLimits
from .errors import describe_invalid, limit_error, synthesis_error
from .serving import SentenceStream
from .speech import SpeechJob, SpeechRequest, check_request
from .wire import encode

log = logging.getLogger("cosyllama.server")

PATH = "/v1/audio/speech/stream"
CHANNELS = 1
CONFIG_TEXT = "config"  # the text session.config is checked with: each sentence's own is checked as it comes
STREAM_NAMES = {**HTTP_NAMES, "text": "text"}  # the text comes in input.text messages
MESSAGE_SLACK_BYTES = 16 * 1024  # a message's JSON around its text (the config's other fields)
# WebSocket close codes (RFC 6455, 7.4.1)
CLOSE_NORMAL, CLOSE_REFUSED, CLOSE_TOO_BIG, CLOSE_FAILED, CLOSE_BUSY = 1000, 1008, 1009, 1011, 1013


def message_bytes(limits) -> int:
    """The largest message a client may send (``limits``: the :class:`~cosyllama.limits.RequestLimits`):
    a piece or the instructions at their longest, every character escaped as JSON allows (6 bytes)."""
    return 6 * max(limits.input_chars, limits.instructions_chars) + MESSAGE_SLACK_BYTES


def uvicorn_ws_options(limits) -> dict:
    """The ``uvicorn.run`` arguments that bound WebSocket messages at the protocol: twice
    :func:`message_bytes` (a message between the two is answered with an ``error`` message here;
    past it, the protocol closes the connection with 1009 before reading it all)."""
    return {"ws_max_size": 2 * message_bytes(limits)}


class SessionConfig(BaseModel):
    """A ``session.config`` message: these fields, and those of :class:`SpeechRequest` but its
    ``input`` and how it streams (checked by it)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["session.config"]
    stream_audio: bool = False
    split_granularity: Literal["sentence", "none"] = "sentence"


NOT_CONFIG = {"input": "send the text with input.text messages",
              "stream": "ask for audio as it is made with stream_audio",
              "stream_format": "ask for audio as it is made with stream_audio"}


class Refusal(Exception):
    """A client's message this endpoint refuses: answered as an ``error`` message, then closed."""

    def __init__(self, message: str, code: str, close: int = CLOSE_REFUSED, param: str | None = None):
        super().__init__(message)
        self.message, self.code, self.close, self.param = message, code, close, param


class _Stalled(Exception):
    """The client has not read what was sent for ``--write-timeout`` seconds."""


@dataclass(frozen=True)
class _Sentence:
    utterance: int
    index: int
    text: str
    request: SpeechRequest  # the session's config when the sentence was queued
    streaming: str | None
    synthesis: SynthesisRequest  # what the config asks for (its text: CONFIG_TEXT), checked


@dataclass(frozen=True)
class _Done:
    utterance: int
    total: int


_CLOSE = object()  # the speaker's last item (session.close)


class _Session:
    """One connection: the main loop reads the client's messages and turns them into queued work;
    the speaker task speaks the queue in order and sends the audio."""

    def __init__(self, ws: WebSocket):
        state = ws.app.state
        self.ws, self.tts, self.limits = ws, state.tts, state.limits.request
        self.gate = admission(ws.app)
        conn = getattr(state, "connection_limits", None) or ConnectionLimits()
        self.idle_timeout, self.write_timeout = conn.idle_timeout, conn.write_timeout
        self.max_bytes = message_bytes(self.limits)
        self.config: SpeechRequest | None = None
        self.streaming: str | None = None
        self.synthesis: SynthesisRequest | None = None
        self.text = SentenceStream(self.limits)
        self.utterance = 0  # the open utterance's index
        self.n_queued = 0  # its sentences so far
        self.has_text = False  # it has taken text
        self.closing = False  # session.close came
        self.work: asyncio.Queue = asyncio.Queue()
        self.in_hand = None  # the item the speaker is on
        self.job: SpeechJob | None = None
        self.partial = False  # the failed sentence had sent audio
        self.wake = asyncio.Event()  # the speaker ran out of work

    def busy(self) -> bool:
        return self.in_hand is not None or not self.work.empty()

    # -- the main loop ------------------------------------------------------------------------

    async def run(self) -> None:
        await self.ws.accept()
        loop = asyncio.get_running_loop()
        speaker = asyncio.create_task(self._speak())
        receiving = None
        last = loop.time()  # of the last message, or of the speaker running out of work
        try:
            while True:
                if receiving is None:
                    receiving = asyncio.ensure_future(self.ws.receive())
                waker = asyncio.ensure_future(self.wake.wait())
                timeout = None if self.busy() else max(0.0, last + self.idle_timeout - loop.time())
                done, _ = await asyncio.wait({receiving, waker, speaker}, timeout=timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
                waker.cancel()
                if self.wake.is_set():
                    self.wake.clear()
                    last = max(last, loop.time())
                if speaker in done:
                    speaker.result()  # raises what the speaker failed with
                    await self._send_close(CLOSE_NORMAL)  # it ended after session.close
                    return
                if receiving in done:
                    message, receiving = receiving.result(), None
                    if message["type"] == "websocket.disconnect":
                        return  # the client went away
                    last = loop.time()
                    if not self.closing:
                        await self._take(message)
                elif not done and not self.busy() and loop.time() - last >= self.idle_timeout:
                    raise Refusal(f"no message for {self.idle_timeout:g} s with nothing being spoken (the server's "
                                  "--idle-timeout); the connection is closed", "idle_timeout")
        except (WebSocketDisconnect, RequestCancelled):
            return  # the client went away
        except _Stalled:
            log.info("closed a %s session: the client read nothing for %g s (--write-timeout)", PATH,
                     self.write_timeout)
        except Exception as e:
            await self._stop(speaker)
            await self._fail(e)
        finally:
            if receiving is not None:
                receiving.cancel()
            await self._stop(speaker)

    async def _stop(self, speaker: asyncio.Task) -> None:
        """Cancel the speaker; its LLM sequence and slot are free when this returns."""
        if self.job is not None:
            self.job.token.cancel()  # the sequence goes at the next decode step, not after the chunk
        speaker.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait([speaker])

    # -- the client's messages ----------------------------------------------------------------

    async def _take(self, message: dict) -> None:
        raw = message.get("text")
        if raw is None:
            raise Refusal("binary messages are not taken here; send JSON text messages (session.config, input.text, "
                          "input.done, session.close)", "invalid_message")
        if len(raw) > self.max_bytes or len(raw.encode()) > self.max_bytes:
            raise Refusal(f"the message is larger than {self.max_bytes} bytes; send the text in smaller input.text "
                          "pieces", "message_too_large", CLOSE_TOO_BIG)
        try:
            data = json.loads(raw)
        except ValueError:
            raise Refusal("the message is not JSON; send JSON objects with a type", "invalid_json") from None
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            raise Refusal("a message is a JSON object with a string field type (session.config, input.text, "
                          "input.done or session.close)", "invalid_message", param="type")
        kind = data["type"]
        if kind == "session.config":
            await self._configure(data)
        elif kind not in ("input.text", "input.done", "session.close"):
            raise Refusal(f"unknown message type {kind!r}; send session.config, input.text, input.done or "
                          "session.close", "unknown_message_type", param="type")
        elif self.config is None:
            raise Refusal(f"{kind} before session.config; send session.config first (with the voice)",
                          "session_not_configured", param="type")
        elif kind == "input.text":
            self._fields(data, kind, "text")
            piece = data.get("text")
            if not isinstance(piece, str):
                raise Refusal("input.text needs a string field text", "invalid_message", param="text")
            self.has_text = self.has_text or bool(piece)
            for s in self.text.add(piece):
                self._queue(s)
        elif kind == "input.done":
            self._fields(data, kind)
            for s in self.text.finish():
                self._queue(s)
            self.work.put_nowait(_Done(self.utterance, self.n_queued))
            self.utterance, self.n_queued, self.has_text = self.utterance + 1, 0, False
        else:  # session.close: what is queued is spoken; text not yet a sentence is dropped
            self._fields(data, kind)
            self.closing = True
            self.work.put_nowait(_CLOSE)

    @staticmethod
    def _fields(data: dict, kind: str, *allowed: str) -> None:
        extra = sorted(set(data) - {"type", *allowed})
        if extra:
            takes = f"only {', '.join(allowed)}" if allowed else "no fields"
            raise Refusal(f"{kind} takes {takes} besides type, not {', '.join(extra)}", "invalid_message",
                          param=extra[0])

    async def _configure(self, data: dict) -> None:
        if self.has_text or self.n_queued:
            raise Refusal("session.config inside an utterance; send input.done first, then the new config",
                          "utterance_in_progress", param="type")
        try:
            config = SessionConfig.model_validate(data)
        except ValidationError as e:
            raise Refusal(*_invalid(e)) from None
        fields = dict(config.model_extra or {})
        for name, how in NOT_CONFIG.items():
            if name in fields:
                raise Refusal(f"session.config takes no {name}; {how}", "invalid_config", param=name)
        if config.stream_audio:
            fields["stream_format"] = "audio"
        try:
            request = SpeechRequest.model_validate({**fields, "input": ""})
        except ValidationError as e:
            raise Refusal(*_invalid(e)) from None
        # as POST /v1/audio/speech checks it, with a stand-in text: each sentence is checked as it comes
        streaming, synthesis = await check_request(request, self.ws.app.state, text=CONFIG_TEXT)
        self.config, self.streaming, self.synthesis = request, streaming, synthesis
        self.text.whole = config.split_granularity == "none"

    def _queue(self, sentence: str) -> None:
        self.work.put_nowait(_Sentence(self.utterance, self.n_queued, sentence, self.config, self.streaming,
                                       self.synthesis))
        self.n_queued += 1

    # -- the speaker --------------------------------------------------------------------------

    async def _speak(self) -> None:
        held = False
        try:
            while True:
                if self.work.empty():
                    self.wake.set()
                item = self.in_hand = await self.work.get()
                if item is _CLOSE:
                    return
                if isinstance(item, _Done):
                    await self._send_json({"type": "session.done", "utterance_index": item.utterance,
                                           "total_sentences": item.total})
                    if held:
                        self.gate.release()
                        held = False
                else:
                    if not held:
                        await self.gate.acquire()  # one slot per utterance, as the HTTP route holds one per request
                        held = True
                    await self._sentence(item)
                self.in_hand = None
        finally:
            self.in_hand = None
            if held:
                self.gate.release()

    async def _sentence(self, item: _Sentence) -> None:
        rate = self.tts.sample_rate
        request = item.request
        job = self.job = SpeechJob(self.tts, replace(item.synthesis, text=item.text), item.streaming,
                                   request.response_format)
        start = {"type": "audio.start", "utterance_index": item.utterance, "sentence_index": item.index,
                 "sentence_text": item.text, "format": request.response_format, "sample_rate": rate,
                 "channels": CHANNELS}
        sent, started = 0, False
        try:
            await run_in_threadpool(job.open)
            if item.streaming:  # the encoded stream piece by piece, as /v1/audio/speech streams it
                while (data := await run_in_threadpool(job.next_bytes)) is not None:
                    if data:
                        if not started:
                            await self._send_json(start)
                            started = True
                        await self._send_bytes(data)
                        sent += len(data)
            else:  # one whole file, as /v1/audio/speech answers without a stream
                parts = []
                while (samples := await run_in_threadpool(job.next)) is not None:
                    parts.append(samples)
                audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
                data = await run_in_threadpool(encode, audio, rate, request.response_format)
                await self._send_json(start)
                started = True
                await self._send_bytes(data)
                sent = len(data)
            if not started:  # every token was silent: still a pair
                await self._send_json(start)
            await self._send_json({"type": "audio.done", "utterance_index": item.utterance,
                                   "sentence_index": item.index, "total_bytes": sent, "error": False})
        except BaseException:
            self.partial = sent > 0
            raise
        finally:
            self.job = None
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(job.close)

    # -- sending ------------------------------------------------------------------------------

    async def _send(self, message: dict) -> None:
        try:
            await asyncio.wait_for(self.ws.send(message), self.write_timeout)
        except TimeoutError:
            raise _Stalled() from None

    async def _send_json(self, payload: dict) -> None:
        await self._send({"type": "websocket.send", "text": json.dumps(payload, separators=(",", ":"))})

    async def _send_bytes(self, data: bytes) -> None:
        await self._send({"type": "websocket.send", "bytes": data})

    async def _send_close(self, code: int, reason: str = "") -> None:
        await self._send({"type": "websocket.close", "code": code, "reason": reason})

    async def _fail(self, e: BaseException) -> None:
        """Answer ``e`` with an ``error`` message, then close the connection."""
        payload, close = _error(e)
        if self.partial:
            payload.update(partial_audio=True, action="discard")  # vLLM-Omni's: the sentence's audio is cut short
        try:
            await self._send_json(payload)
            await self._send_close(close, payload["code"][:120])
        except (WebSocketDisconnect, _Stalled, RuntimeError):
            pass  # the client is gone or reads nothing: there is no one to tell


def _invalid(e: ValidationError) -> tuple[str, str, int, str | None]:
    message, param, code = describe_invalid(e.errors())
    return f"session.config: {message}", code or "invalid_config", CLOSE_REFUSED, param


def _error(e: BaseException) -> tuple[dict, int]:
    """The ``error`` message answering ``e`` and the close code after it."""
    if isinstance(e, Refusal):
        return {"type": "error", "message": e.message, "code": e.code, "param": e.param}, e.close
    if isinstance(e, LimitExceeded) and e.field in ("input", "session", "sequence"):
        err = limit_error(e, param="text")  # the text came in input.text messages
    elif isinstance(e, RequestError) and e.field == "text":
        err = ApiError(422, e.render(STREAM_NAMES), param="text", code=e.code)
    else:
        err = synthesis_error(e)  # logs a failure of the server
    if err.status >= 500 and err.status != 503:
        return ({"type": "error", "message": "synthesis failed (an error in the server; its log has the details)",
                 "code": "internal_error", "param": None}, CLOSE_FAILED)
    code = err.code or ("server_busy" if err.status == 503 else err.type)
    return {"type": "error", "message": err.message, "code": code, "param": err.param}, (
        CLOSE_BUSY if err.status == 503 else CLOSE_REFUSED)


router = APIRouter()


@router.websocket(PATH)
async def speech_stream(ws: WebSocket):
    await _Session(ws).run()
