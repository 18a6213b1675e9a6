"""Wyoming protocol server: Home Assistant's voice pipeline (and any Wyoming client) speaks with
cosyllama's voices.

``cosyllama wyoming --uri tcp://127.0.0.1:10200`` serves it alone; ``cosyllama serve --wyoming URI``
beside the HTTP API, from the same model, voices, scheduler and admission gate. Needs the
``wyoming`` extra.

What a connection may send (the `wyoming` package's events):

* ``describe`` -> ``info``: one TTS program; its voices are the registered voices plus
  ``default`` (the voice of a request that names none: ``--default-voice``, else the first
  registered voice in alphabetical order); every voice speaks every language CosyVoice3 speaks.
* ``synthesize`` (text, optional voice) -> ``audio-start``, ``audio-chunk``s as streaming synthesis
  makes them (24 kHz, 16-bit, mono; at a ``--speed`` other than 1 each text segment's audio once it is
  whole), ``audio-stop``.
* ``synthesize-start`` (optional voice), ``synthesize-chunk``s (text as it is written, e.g. by an
  LLM), ``synthesize-stop``: each sentence is spoken as soon as it is complete
  (:func:`cosyllama.text.normalize.take_sentences`), in one voice, one after the other, as one audio stream
  (one ``audio-start`` ... ``audio-stop``), then ``synthesize-stopped``. The ``synthesize`` a
  client sends inside the stream for older servers is ignored.

This module is the codec: a connection's events become calls on a
:class:`~cosyllama.server.session.Session` (sentences, the seed rule, admission, cancel, the idle
timeout), whose events become Wyoming events. What every connection shares (the options, ``describe``'s
``info``, the voice a request asks for) is :mod:`cosyllama.server.wyoming_service`, the wire format
:mod:`cosyllama.server.wyoming_wire`. A request (one ``synthesize``, or ``synthesize-start``
to ``-stop``) is one of the session's utterances: it holds one of the server's running slots from its
first sentence to its end, like one HTTP request; each of its sentences is one scheduler request,
batched with everyone else's. The protocol carries no synthesis options: every request takes the server's
(``--seed``, ``--greedy``, ``--speed``, ``--loudness``, ``--retries``); with ``--seed N`` sentence ``k`` is
seeded ``N + k`` (without it, each sentence gets a fresh seed). Requests are answered in the order they
came: a bad request (unknown voice, no text, over a limit, the connection's fifth, an event out of order) is
answered with an ``error`` event once the requests accepted before it are spoken, after which the server
closes the connection (Home Assistant's client waits for audio until then). A client that closes the
connection cancels its session: the LLM sequence is released at the next decode step. On SIGTERM the server
stops as :mod:`cosyllama.server.shutdown` says (``server_stopping``).

The protocol has no authentication, so everything a client controls is bounded
(:class:`~cosyllama.server.conn.ConnectionLimits`, the flags ``serve`` has too, and
:func:`event_caps`): events are read here, not by the `wyoming` package (which buffers whatever a
header announces): a header line and its data at most so many bytes for the event's type, checked
before they are read, no payload; an event complete within ``header_timeout`` of its first byte;
no event for ``idle_timeout`` while nothing is being spoken closes the connection; a connection whose
writes make no progress for ``write_timeout`` (a client that stops reading; the one write bound of every
door, :class:`~cosyllama.server.conn.WriteWatch`) is aborted, which frees its session's sequence, flow work
and slot; ``max_connections`` open at once. A malformed
event gets ``error`` ``protocol_error`` with a one-line reason and the connection is closed; the
log says so in one warning line per client (rate-limited), never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import dataclass
from urllib.parse import urlparse

from ..audio_out import pcm16
from ..defaults import LANGUAGES
from ..errors import InputError, MissingDependencyError
from ..request import API_NAMES, SynthesisRequest
from ..text.normalize import is_only_punctuation
from .conn import WriteWatch, bound_send_buffer
from .errors import log_refusal, wyoming_error
from .job import SynthesisJob
from .session import AfterQueued, Audio, Sentence, Session, Template, UtteranceDone
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
    ``synthesize-stopped``."""

    streaming: bool


class _Connection:
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

    def job(self, sentence: Sentence) -> SynthesisJob:
        return SynthesisJob(self.service.tts, sentence.request)

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
        self._close()

    def _close(self) -> None:
        """Close the connection: what is written goes out under the write bound."""
        transport = self.writer.transport
        if not transport.is_closing():
            transport.close()
            self.watch.arm()

    def abort(self) -> None:
        """Drop the connection now (what is not sent is lost)."""
        self.writer.transport.abort()


# ----------------------------------------------------------------------------------------------
# Starting and running


def check_uri(uri: str) -> str:
    """``tcp://HOST:PORT`` or ``unix://PATH``, else an :class:`InputError` saying so."""
    u = urlparse(uri)
    if u.scheme == "tcp":
        try:
            port = u.port
        except ValueError:
            port = None
        if not u.hostname or port is None:
            raise InputError(f"Wyoming URI {uri!r} needs a host and a port, e.g. tcp://127.0.0.1:10200")
    elif u.scheme != "unix" or not u.path:
        raise InputError(f"Wyoming URI {uri!r} is not tcp://HOST:PORT or unix://PATH")
    return uri


def check_listen(uri: str) -> None:
    """Refuse, before a model is loaded, a ``tcp://`` address this process cannot listen at (the
    port is taken, the host is not ours): an :class:`InputError`, so ``serve --wyoming`` and
    ``wyoming`` stop with one line instead of failing in the server's start-up later."""
    from .startup import check_can_listen

    u = urlparse(check_uri(uri))
    if u.scheme == "tcp":
        check_can_listen(u.hostname, u.port, uri)


class WyomingServer:
    """A running Wyoming server (from :func:`start_wyoming`); ``address`` is where it listens. A stopping process
    (:class:`~cosyllama.server.shutdown.Shutdown`) calls :meth:`stop_taking_work`, :meth:`busy` and :meth:`cut`
    (the sessions' own stop is the serving's); :meth:`stop` ends it."""

    def __init__(self, server: asyncio.AbstractServer, service: WyomingService, address, unix_path: str | None):
        self.server, self.service, self.address, self.unix_path = server, service, address, unix_path

    def stop_taking_work(self) -> None:
        """Stop listening: a new connection is refused."""
        self.server.close()

    def busy(self) -> bool:
        return bool(self.service.connections)

    def cut(self) -> None:
        """Abort every connection still open (its last words did not go out in time)."""
        for conn in list(self.service.connections.values()):
            conn.abort()

    async def stop(self) -> None:
        """Stop listening and end every connection now: its session ends telling the client the server stops;
        a connection whose last words did not leave within :data:`~cosyllama.server.shutdown.FAREWELL_S` is
        aborted."""
        from .shutdown import FAREWELL_S

        self.stop_taking_work()
        connections = dict(self.service.connections)
        for conn in connections.values():
            conn.session.cut()
        if connections:
            _, stuck = await asyncio.wait(list(connections), timeout=FAREWELL_S)
            for task in stuck:  # a client that reads nothing: drop what it was sent
                connections[task].abort()
            if stuck:
                await asyncio.wait(stuck)
        if self.unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)


async def _accept(service: WyomingService, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A new connection: served, or refused with ``busy`` past ``max_connections``."""
    task = asyncio.current_task()
    limit = service.limits.max_connections
    if len(service.connections) >= limit:
        service.warn("refused a Wyoming connection: %d open, --max-connections %d", limit, limit)
        refusal = event_bytes(Error(text=f"the server has {limit} connections open, its limit (--max-connections); "
                                         "retry in a moment", code="busy").event())
        with contextlib.suppress(Exception):
            watch = WriteWatch(writer.transport, service.limits.write_timeout, lambda: "a refused Wyoming client")
            writer.write(refusal)
            watch.wrote(len(refusal))
            writer.transport.close()
        return
    bound_send_buffer(writer.transport)  # the kernel holds at most 128 KiB a client has not read (else up to MBs)
    conn = _Connection(service, reader, writer)
    service.connections[task] = conn
    try:
        await conn.run()
    finally:
        service.connections.pop(task, None)
        conn._close()


async def start_wyoming(uri: str, serving) -> WyomingServer:
    """Listen at ``uri`` in the running event loop and answer the Wyoming protocol from ``serving``
    (a :class:`~cosyllama.server.serving.Serving`: its pipeline, admission gate, default voice, the
    synthesis options of every request (always streaming) and the connection limits). A TCP port 0
    listens on a free port (see ``address``)."""
    check_uri(uri)
    service = WyomingService(serving)
    u = urlparse(uri)
    line_cap = max(service.caps.values())  # the reader buffers at most about this much of a header line

    async def accept(reader, writer):
        await _accept(service, reader, writer)

    unix_path = None
    try:
        if u.scheme == "unix":
            unix_path = u.path
            with contextlib.suppress(FileNotFoundError):
                os.unlink(unix_path)
            server = await asyncio.start_unix_server(accept, path=unix_path, limit=line_cap)
        else:
            server = await asyncio.start_server(accept, host=u.hostname, port=u.port, limit=line_cap)
    except OSError as e:  # e.g. the port is taken
        raise InputError(f"cannot listen at {uri}: {e.strerror or e}") from e
    sockets = server.sockets or ()
    address = sockets[0].getsockname() if sockets else uri
    return WyomingServer(server, service, address, unix_path)


def run_wyoming(options, uri: str) -> None:
    """Run ``cosyllama wyoming`` at ``uri`` until interrupted; ``options``: a
    :class:`~cosyllama.server.startup.ServingOptions` (the start-up is the one ``serve`` has)."""
    from .serving import prepare
    from .shutdown import Shutdown
    from .startup import log_start, ready, start

    uri = check_uri(uri)
    models, voices = start(options, lambda: check_listen(uri))
    serving = prepare(models, options, voices=voices)
    ready(serving)  # after prepare: the store has its encoder by then, so voice folders warm too

    async def main():
        server = await start_wyoming(uri, serving)
        log_start(options.load, voices, uri)
        shutdown = Shutdown(serving, [server])
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # systemd, docker stop, Ctrl+C: drain, then stop
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, shutdown.ask)
        try:
            await shutdown.asked()
            await shutdown.drain()
        finally:
            await server.stop()
        log.info("Wyoming server stopped")

    try:
        asyncio.run(main())
    finally:
        serving.close()


__all__ = ["DEFAULT_VOICE", "LANGUAGES", "ProtocolError", "RequestRefused", "WyomingServer", "WyomingService",
           "check_listen", "check_uri", "error_event", "event_bytes", "event_caps", "run_wyoming", "start_wyoming"]
