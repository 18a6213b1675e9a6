"""The Wyoming codec: Home Assistant's voice pipeline (and any Wyoming client) speaks with cosyllama's voices.
A connection's events become calls on a :class:`~cosyllama.server.session.Session` (sentences, the seed rule,
admission, cancel, the idle timeout), whose events become Wyoming events; the server that listens and stops
is :mod:`cosyllama.server.wyoming_server`, what every connection shares :mod:`cosyllama.server.wyoming_service`,
the wire format and its bounds :mod:`cosyllama.server.wyoming_wire`. Needs the ``wyoming`` extra.

* ``describe`` -> ``info``: one TTS program; its voices are the registered voices plus ``default`` (``--default-
  voice``, else the first registered voice in alphabetical order); every voice speaks every language.
* ``synthesize`` (text, optional voice) -> ``audio-start``, ``audio-chunk``s as streaming synthesis makes them
  (24 kHz, 16-bit, mono; at a ``--speed`` other than 1 each text segment's audio once it is whole), ``audio-stop``.
* ``synthesize-start`` (optional voice), ``synthesize-chunk``s (text as it is written), ``synthesize-stop``: each
  sentence is spoken as soon as it is complete, one after the other, as one audio stream, then
  ``synthesize-stopped``. The ``synthesize`` a client sends inside the stream for older servers is ignored.

A request (one ``synthesize``, or ``synthesize-start`` to ``-stop``) is one of the session's utterances: it holds
one of the server's running slots from its first sentence to its end; each sentence is one scheduler request.
The protocol carries no synthesis options: every request takes the server's (``--seed``, ``--greedy``,
``--speed``, ``--loudness``, ``--retries``, ``--first-chunk-tokens``). Requests are answered in the order they
came: a bad one (unknown voice, no text, over a limit, the connection's fifth, an event out of order) gets an
``error`` event once the requests accepted before it are spoken, then the connection is closed. A malformed
event gets ``error`` ``protocol_error`` with a one-line reason; the log has one warning line per client
(rate-limited), never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from ..audio_out import pcm16
from ..defaults import LANGUAGES
from ..errors import InputError, MissingDependencyError
from ..request import API_NAMES, SynthesisRequest
from ..text.normalize import is_only_punctuation
from .conn import WriteWatch
from .errors import log_refusal, wyoming_error
from .job import SynthesisJob
from .session import AfterQueued, Audio, Session, Template, UtteranceDone
from .wyoming_wire import (
    ProtocolError,
    RequestRefused,
    event_bytes,
    event_caps,
    optional_str,
    read_event,
    text_field,
    voice_field,
)

try:
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.error import Error
    from wyoming.event import Event
    from wyoming.info import Describe
    from wyoming.ping import Ping, Pong
    from wyoming.tts import (
        Synthesize,
        SynthesizeChunk,
        SynthesizeStart,
        SynthesizeStop,
        SynthesizeStopped,
    )
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise MissingDependencyError("the Wyoming server needs its extra: pip install 'cosyllama[wyoming]'") from e

from .wyoming_service import DEFAULT_VOICE, WyomingService  # noqa: E402

log = logging.getLogger("cosyllama.wyoming")

SAMPLE_WIDTH = 2  # bytes: 16-bit PCM
CHANNELS = 1

MAX_SESSIONS = 4  # requests one connection may have waiting or speaking
QUEUED_INPUTS = 8  # text one connection may have waiting to be spoken, in --max-input-chars
# the text a request's template is checked with: each sentence's own is checked as it comes
STAND_IN_TEXT = "synthesize"


def error_event(e: BaseException) -> Event:
    """The ``error`` event answering an exception raised by a request
    (:func:`cosyllama.server.errors.wyoming_error`): its text says what the client can act on, never
    the server's files, libraries or exception texts (the log has those)."""
    text, code = wyoming_error(e, API_NAMES)
    return Error(text=text, code=code).event()


# ----------------------------------------------------------------------------------------------
# A connection


@dataclass(frozen=True)
class _Request:
    """A request's kind (:attr:`Template.door <cosyllama.server.session.Template.door>`): a stream ends with
    ``synthesize-stopped``; :meth:`job` makes a sentence's synthesis (its samples, encoded here)."""

    streaming: bool

    def job(self, tts, request: SynthesisRequest) -> SynthesisJob:
        return SynthesisJob(tts, request)


class Connection:
    """One client, a :class:`~cosyllama.server.session.Door` of its :class:`~cosyllama.server.session.Session`:
    its events are read within bounds (:meth:`read`, :meth:`take`) and become calls on the session, each
    request answered in the order it came (a refused one after those accepted before it); the session's events
    are written as Wyoming events, under the connection's write bound (:class:`~cosyllama.server.conn.WriteWatch`)."""

    def __init__(self, service: WyomingService, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.service, self.reader, self.writer = service, reader, writer
        self.limits = service.limits
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "a client"
        self.watch = WriteWatch(writer.transport, self.limits.write_timeout, lambda: f"Wyoming {self.peer}")
        limits = service.serving.limits
        self.session = Session(service.serving, self, idle_timeout=self.limits.idle_timeout, text_per_utterance=True,
                               max_waiting_chars=QUEUED_INPUTS * limits.input_chars, noun="event")
        self.stream = False  # a synthesize-start ... -stop is open
        self.logged = False  # the failure being answered has its line in the log already
        self.started = False  # the request being spoken has sent audio-start
        self.ms = 0.0  # its audio so far

    async def run(self) -> None:
        """Answer events until the client leaves, breaks the protocol or is refused; never raises."""
        await self.session.run()

    # -- reading -------------------------------------------------------------------------------

    async def read(self) -> bytes | None:
        """An event's first byte (the session waits for it within the idle timeout); None when the client left."""
        return await self.reader.read(1) or None

    async def take(self, first: bytes) -> None:
        """The event that begins with ``first``, read within bounds and answered. A malformed one (or one over
        its bounds, or too slow) is refused at once; a refused request after the requests before it."""
        event = await self._read_rest(first)
        try:
            await self.handle_event(event)
        except InputError as e:  # a request refused (busy, unknown voice, no text, a stop without a start ...)
            raise AfterQueued(e) from None

    async def _read_rest(self, first: bytes) -> Event:
        """The event whose first byte is ``first``: :class:`ProtocolError` (or :class:`LimitExceeded`) for one
        this server does not read, ``request_timeout`` past ``--header-timeout``."""
        try:
            event = await read_event(self.reader, first, self.service.caps, self.limits.header_timeout,
                                     self.service.serving.limits.input_chars)
        except InputError as e:  # malformed, or over its bounds: one (rate-limited) line for the operator
            if not isinstance(e, ProtocolError):  # end() says so for a ProtocolError
                self.service.warn_bad_client(self.peer, str(e))
                self.logged = True
            raise
        except asyncio.TimeoutError:
            seconds = self.limits.header_timeout
            log.info("closed the Wyoming connection of %s: an event took more than %g s (--header-timeout)",
                     self.peer, seconds)
            self.logged = True
            raise RequestRefused(f"the event did not arrive within {seconds:g} s of its first byte "
                                 "(--header-timeout)", "request_timeout") from None
        if event is None:
            raise ConnectionResetError("the client left in the middle of an event")
        return event

    # -- answering -----------------------------------------------------------------------------

    async def handle_event(self, event: Event) -> None:
        """Answer one (well-formed) event; raises what refuses it."""
        data, kind = event.data, event.type
        if Describe.is_type(kind):
            await self.write_event((await self.service.call(self.service.info)).event())
        elif Ping.is_type(kind):
            await self.write_event(Pong(text=optional_str(data, "text", "ping")).event())
        elif SynthesizeStart.is_type(kind):
            voice = voice_field(data, kind)
            if self.stream:
                raise ProtocolError("synthesize-start inside a stream; end it with synthesize-stop first")
            await self._configure(voice, streaming=True)
            self.session.begin()
            self.stream = True
        elif SynthesizeChunk.is_type(kind):
            text = text_field(data, kind)
            self._in_stream(kind)
            self.session.add_text(text)
        elif SynthesizeStop.is_type(kind):
            self._in_stream(kind)
            self.stream = False
            self.session.end_utterance(if_empty=RequestRefused(
                "the stream ended without text to speak; send synthesize-chunk events with text between "
                "synthesize-start and synthesize-stop", "empty_text"))
        elif Synthesize.is_type(kind):
            text, voice = text_field(data, kind), voice_field(data, kind)
            if not self.stream:  # inside a stream: its copy for old servers, ignored
                if is_only_punctuation(text.strip()):  # empty, blank or nothing to say
                    raise RequestRefused("text is empty; give some text to speak", "empty_text")
                await self._configure(voice, streaming=False)
                self.session.add_whole(text)
                self.session.end_utterance()

    def _in_stream(self, what: str) -> None:
        if not self.stream:
            raise ProtocolError(f"{what} without synthesize-start")

    async def _configure(self, voice, streaming: bool) -> None:
        """The template of the next request: its voice (``voice``: a ``SynthesizeVoice`` or None) and the
        server's synthesis options (:meth:`WyomingService.voice`)."""
        service = self.service
        if self.session.pending >= MAX_SESSIONS:  # before the voice is looked up
            raise RequestRefused(f"this connection has {self.session.pending} requests waiting or speaking, at most "
                                 f"{MAX_SESSIONS}; wait for audio-stop before sending more", "busy")
        _, features = await service.call(service.voice, voice)
        request = SynthesisRequest(STAND_IN_TEXT, voice=features, options=service.options,
                                   limits=service.serving.limits)
        self.session.configure(Template(request, door=_Request(streaming)))

    # -- the session's events (its Door) -------------------------------------------------------

    async def send(self, event) -> None:
        rate = self.service.tts.sample_rate
        if isinstance(event, Audio):
            if not self.started:
                await self._audio_start(rate)
            samples = event.data
            await self.write_event(AudioChunk(rate=rate, width=SAMPLE_WIDTH, channels=CHANNELS, audio=pcm16(samples),
                                              timestamp=round(self.ms)).event())
            self.ms += 1000 * samples.size / rate
        elif isinstance(event, UtteranceDone):
            if not self.started:  # every sentence was silent: still one (empty) audio stream
                await self._audio_start(rate)
            await self.write_event(AudioStop(timestamp=round(self.ms)).event())
            if event.door.streaming:
                await self.write_event(SynthesizeStopped().event())
            self.started, self.ms = False, 0.0

    async def _audio_start(self, rate: int) -> None:
        await self.write_event(AudioStart(rate=rate, width=SAMPLE_WIDTH, channels=CHANNELS, timestamp=0).event())
        self.started = True

    # -- writing and closing -------------------------------------------------------------------

    async def write_event(self, event: Event) -> None:
        """Send ``event``, however slowly the client reads (the write bound aborts a connection whose client
        reads nothing for ``--write-timeout``); a ``ConnectionError`` when the client is gone."""
        if self.writer.transport.is_closing():
            raise ConnectionResetError("the connection is closed")
        data = event_bytes(event)
        self.writer.write(data)
        self.watch.wrote(len(data))
        await self.writer.drain()

    async def end(self, ending) -> None:
        """Answer the exception the connection ends with (if any) with an ``error`` event, then close it; the
        log has one line of it (the idle timeout's, a broken protocol's warning, a refusal's line, the server's
        own failure with its traceback)."""
        if isinstance(ending, BaseException):
            event = error_event(ending)
            code = event.data["code"]
            if code == "idle_timeout":
                log.info("closed the Wyoming connection of %s: no event for %g s (--idle-timeout)", self.peer,
                         self.limits.idle_timeout)
            elif isinstance(ending, ProtocolError):
                self.service.warn_bad_client(self.peer, str(ending))
            elif not self.logged and code != "internal_error":
                log_refusal("a Wyoming request", self.peer, code, event.data["text"])
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.write_event(event)
        self.close()

    def close(self) -> None:
        """Close the connection: what is written goes out under the write bound."""
        transport = self.writer.transport
        if not transport.is_closing():
            transport.close()
            self.watch.arm()

    def abort(self) -> None:
        """Drop the connection now (what is not sent is lost)."""
        self.writer.transport.abort()


__all__ = ["DEFAULT_VOICE", "LANGUAGES", "Connection", "ProtocolError", "RequestRefused", "WyomingService",
           "error_event", "event_bytes", "event_caps"]
