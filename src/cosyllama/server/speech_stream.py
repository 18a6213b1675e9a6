"""``/v1/audio/speech/stream``: text in as it is written (an LLM's answer, piece by piece), audio out
per sentence as soon as each sentence is complete, over a WebSocket. Needs the ``server`` extra
(with ``websockets``, uvicorn's WebSocket implementation).

The messages are vLLM-Omni's (its endpoint of the same path; docs/server.md says where this one
differs). The client sends JSON text messages:

* ``session.config``: first; the fields of ``POST /v1/audio/speech`` but ``input`` (``voice``,
  ``response_format``, ``speed``, ``seed``, ``greedy``, ``instructions``, ``mode``, ``model``),
  checked the same way (:func:`cosyllama.server.openai_speech.check_request`), plus ``stream_audio``
  (send each sentence's audio as it is made, not as one frame) and ``split_granularity``
  (``sentence``, the default here, or ``none``: the whole text at ``input.done``) and
  ``word_timestamps`` (after each sentence's ``audio.done``, a ``word_timestamps`` message with its words'
  times, docs/captions.md). It may be sent again between utterances.
* ``input.text`` (``text``): a piece of text; each sentence it completes is queued
  (:class:`~cosyllama.server.sentences.SentenceStream` in the
  :class:`~cosyllama.server.session.Session`, as on Wyoming).
* ``input.done``: the end of an utterance: the rest is spoken as its last sentence, then the server
  answers ``session.done``; the connection stays open for the next one.
* ``session.close``: the queued sentences are spoken, then the server closes the connection.

The server answers, per sentence, ``audio.start`` (``utterance_index``, ``sentence_index``,
``sentence_text``, ``format``, ``sample_rate``, ``channels``), the audio as binary frames (one
whole file, or pieces of one stream with ``stream_audio``), ``audio.done`` (``total_bytes``,
``error``; ``retries``, the takes caught while making it, when there were any: docs/retries.md), with
``word_timestamps`` then a ``word_timestamps`` message (``utterance_index``,
``sentence_index``, ``word_timestamps``: ``[{word, start_ms, end_ms}]`` from the start of the sentence's
audio, ``[]`` for a sentence with no words, ``null`` with a ``reason`` when they could not be aligned);
per utterance ``session.done`` (``total_sentences``). A refusal or failure is an
``error`` message (``message``, ``code``, ``param``), after which the server closes the
connection (1008 for a client's mistake or a bound, 1009 for a message too large, 1013 when the
server is busy, 1011 for a failure of the server).

This module is the codec: it turns the client's messages into calls on a
:class:`~cosyllama.server.session.Session` (sentences, the seed rule, admission, cancel, the idle
timeout) and the session's events into frames. An utterance holds one of the server's running slots
(the admission gate of the HTTP routes) from its first sentence to its ``session.done``; each sentence
is one scheduler request, decoded with everyone else's; sentence ``k`` of an utterance is seeded with
the config's ``seed + k``. Everything a client controls is bounded: a message's size, a piece, a sentence
and the text waiting for its end (``--max-input-chars``), the session's text in all
(``--max-session-chars``), the time with nothing to do (``--idle-timeout``: no message and no
audio being made) and a client that stops reading (``--write-timeout``: the connection's write bound,
:class:`~cosyllama.server.conn.WriteWatch`; a send has no deadline of its own, so a slow reader that keeps
reading is never cut). A client that goes away cancels its sentence at once: its LLM sequence is released
at the next decode step.
"""

from __future__ import annotations

import json
import logging
from typing import Literal

from fastapi import APIRouter, WebSocket
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.websockets import WebSocketDisconnect

from ..request import HTTP_NAMES
from .client_json import ClientJSONError, clip, clip_names, clip_param
from .client_json import loads as client_loads
from .common import state_of
from .errors import (
    CLOSE_FAILED,
    CLOSE_NORMAL,
    CLOSE_REFUSED,
    CLOSE_TOO_BIG,
    Refusal,
    describe_invalid,
    log_refusal,
    websocket_error,
)
from .job import SpeechFormat
from .openai_speech import SpeechRequest, check_request
from .session import CLOSED, Audio, Sentence, SentenceDone, Session, Template, UtteranceDone

log = logging.getLogger("cosyllama.server")

PATH = "/v1/audio/speech/stream"
CHANNELS = 1
CONFIG_TEXT = "config"  # the text session.config is checked with: each sentence's own is checked as it comes
STREAM_NAMES = {**HTTP_NAMES, "text": "text"}  # the text comes in input.text messages
MESSAGE_SLACK_BYTES = 16 * 1024  # a message's JSON around its text (the config's other fields)
MESSAGE_TYPES = "session.config, input.text, input.done or session.close"


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
    word_timestamps: bool = False


NOT_CONFIG = {"input": "send the text with input.text messages",
              "stream": "ask for audio as it is made with stream_audio",
              "stream_format": "ask for audio as it is made with stream_audio"}


class _Connection:
    """One WebSocket: its messages become calls on a :class:`~cosyllama.server.session.Session`, the
    session's events become frames (the session's :class:`~cosyllama.server.session.Door`)."""

    def __init__(self, ws: WebSocket):
        state = state_of(ws.app)
        self.ws, self.state, self.serving = ws, state, state.serving
        self.max_bytes = message_bytes(self.serving.limits)
        self.session = Session(self.serving, self, idle_timeout=self.serving.options.connection_limits.idle_timeout)
        self.started = False  # the sentence being sent has had its audio.start
        self.sent = 0  # its bytes so far

    async def run(self) -> None:
        await self.ws.accept()
        await self.session.run()

    async def read(self) -> dict | None:
        message = await self.ws.receive()
        return None if message["type"] == "websocket.disconnect" else message

    async def end(self, ending) -> None:
        if ending is CLOSED:  # session.close, its sentences spoken
            await self._send_close(CLOSE_NORMAL)
        elif ending is not None:
            await self._fail(ending)

    # -- the client's messages ----------------------------------------------------------------

    async def take(self, message: dict) -> None:
        raw = message.get("text")
        if raw is None:
            raise Refusal("binary messages are not taken here; send JSON text messages (session.config, input.text, "
                          "input.done, session.close)", "invalid_message")
        if len(raw) > self.max_bytes or len(raw.encode()) > self.max_bytes:
            raise Refusal(f"the message is larger than {self.max_bytes} bytes; send the text in smaller input.text "
                          "pieces", "message_too_large", close=CLOSE_TOO_BIG)
        try:
            data = client_loads(raw, max_bytes=self.max_bytes)  # its nesting bounded before json.loads
        except ClientJSONError as e:
            raise Refusal(f"the message {e}; send JSON objects with a type", "invalid_json") from None
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            raise Refusal(f"a message is a JSON object with a string field type ({MESSAGE_TYPES})", "invalid_message",
                          param="type")
        kind, session = data["type"], self.session
        if kind == "session.config":
            await self._configure(data)
        elif kind not in ("input.text", "input.done", "session.close"):
            raise Refusal(f"unknown message type {clip(kind)}; send {MESSAGE_TYPES}", "unknown_message_type",
                          param="type")
        elif session.template is None:
            raise Refusal(f"{kind} before session.config; send session.config first (with the voice)",
                          "session_not_configured", param="type")
        elif kind == "input.text":
            self._fields(data, kind, "text")
            piece = data.get("text")
            if not isinstance(piece, str):
                raise Refusal("input.text needs a string field text", "invalid_message", param="text")
            session.add_text(piece)
        elif kind == "input.done":
            self._fields(data, kind)
            session.end_utterance()
        else:  # session.close: what is queued is spoken; text not yet a sentence is dropped
            self._fields(data, kind)
            session.close()

    @staticmethod
    def _fields(data: dict, kind: str, *allowed: str) -> None:
        extra = sorted(set(data) - {"type", *allowed})
        if extra:
            takes = f"only {', '.join(allowed)}" if allowed else "no fields"
            raise Refusal(f"{kind} takes {takes} besides type, not {clip_names(extra)}", "invalid_message",
                          param=clip_param(extra[0]))

    async def _configure(self, data: dict) -> None:
        if self.session.in_utterance:
            raise Refusal("session.config inside an utterance; send input.done first, then the new config",
                          "utterance_in_progress", param="type")
        try:
            config = SessionConfig.model_validate(data)
        except ValidationError as e:
            raise _invalid(e) from None
        fields = dict(config.model_extra or {})
        for name, how in NOT_CONFIG.items():
            if name in fields:
                raise Refusal(f"session.config takes no {name}; {how}", "invalid_config", param=name)
        if config.stream_audio:
            fields["stream_format"] = "audio"
        try:
            request = SpeechRequest.model_validate({**fields, "input": ""})
        except ValidationError as e:
            raise _invalid(e) from None
        # as POST /v1/audio/speech checks it, with a stand-in text: each sentence is checked as it comes
        streaming, synthesis = await check_request(request, self.state, text=CONFIG_TEXT)
        self.session.configure(Template(synthesis, whole=config.split_granularity == "none",
                                        door=SpeechFormat(request.response_format, streaming, config.word_timestamps)))

    # -- the session's events (its Door) ------------------------------------------------------

    async def send(self, event) -> None:
        if isinstance(event, Audio):
            if not self.started:
                await self._send_start(event.sentence)
            await self._send({"type": "websocket.send", "bytes": event.data})
            self.sent += len(event.data)
        elif isinstance(event, SentenceDone):
            s = event.sentence
            if not self.started:  # every token was silent: still a pair
                await self._send_start(s)
            done = {"type": "audio.done", "utterance_index": s.utterance, "sentence_index": s.index,
                    "total_bytes": self.sent, "error": False}
            if event.retries:  # takes caught and made again or cut (docs/retries.md)
                done["retries"] = [b.as_dict() for b in event.retries]
            await self._send_json(done)
            self.started, self.sent = False, 0
            if s.door.word_timestamps:
                await self._send_json({"type": "word_timestamps", "utterance_index": s.utterance,
                                       "sentence_index": s.index, **word_frame(event.segments)})
        elif isinstance(event, UtteranceDone):
            await self._send_json({"type": "session.done", "utterance_index": event.utterance,
                                   "total_sentences": event.total})

    async def _send_start(self, s: Sentence) -> None:
        await self._send_json({"type": "audio.start", "utterance_index": s.utterance, "sentence_index": s.index,
                               "sentence_text": s.text, "format": s.door.response_format,
                               "sample_rate": self.serving.tts.sample_rate, "channels": CHANNELS})
        self.started = True

    # -- sending ------------------------------------------------------------------------------

    async def _send(self, message: dict) -> None:
        """Send ``message`` when uvicorn's buffer has room, however long the client takes to read (the
        connection's write bound cuts a client that reads nothing); ``ConnectionError`` once it is gone."""
        try:
            await self.ws.send(message)
        except WebSocketDisconnect:
            raise ConnectionResetError("the client is gone") from None

    async def _send_json(self, payload: dict) -> None:
        await self._send({"type": "websocket.send", "text": json.dumps(payload, separators=(",", ":"))})

    async def _send_close(self, code: int, reason: str = "") -> None:
        await self._send({"type": "websocket.close", "code": code, "reason": reason})

    def _client(self) -> str:
        client = self.ws.client
        return f"{client.host}:{client.port}" if client else "a client"

    async def _fail(self, e: BaseException) -> None:
        """Answer ``e`` with an ``error`` message, then close the connection."""
        payload, close = websocket_error(e, STREAM_NAMES)
        if close != CLOSE_FAILED:  # the server's own failure is logged with its traceback by the mapper
            log_refusal(f"a {PATH} session", self._client(), f"{close} {payload['code']}", payload["message"])
        if self.session.partial:
            payload.update(partial_audio=True, action="discard")  # vLLM-Omni's: the sentence's audio is cut short
        try:
            await self._send_json(payload)
            await self._send_close(close, payload["code"][:120])
        except (ConnectionError, RuntimeError):
            pass  # the client is gone, or was cut for reading nothing: there is no one to tell


def word_frame(segments) -> dict:
    """The ``word_timestamps`` field of a sentence's message, from its synthesis's segments: its words in ms from
    the start of the sentence's audio; ``[]`` when it has none to speak; None, with the ``reason``, when any
    segment's words could not be aligned (a partial list would misplace the rest)."""
    failed = [s for s in segments if s.words is None]
    if failed:
        return {"word_timestamps": None, "reason": failed[0].words_why or "the words were not aligned"}
    return {"word_timestamps": [{"word": w.word, "start_ms": round(w.start * 1000), "end_ms": round(w.end * 1000)}
                                for s in segments for w in s.words]}


def _invalid(e: ValidationError) -> Refusal:
    message, param, code = describe_invalid(e.errors())
    return Refusal(f"session.config: {message}", code or "invalid_config", close=CLOSE_REFUSED, param=param)


router = APIRouter()


@router.websocket(PATH)
async def speech_stream(ws: WebSocket):
    await _Connection(ws).run()
