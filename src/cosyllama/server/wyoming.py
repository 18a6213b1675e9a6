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
  makes them (24 kHz, 16-bit, mono), ``audio-stop``.
* ``synthesize-start`` (optional voice), ``synthesize-chunk``s (text as it is written, e.g. by an
  LLM), ``synthesize-stop``: each sentence is spoken as soon as it is complete
  (:func:`cosyllama.text.normalize.take_sentences`), in one voice, one after the other, as one audio stream
  (one ``audio-start`` ... ``audio-stop``), then ``synthesize-stopped``. The ``synthesize`` a
  client sends inside the stream for older servers is ignored.

A session (one ``synthesize``, or ``synthesize-start`` to ``-stop``) holds one of the server's
running slots from its start to its end, like one HTTP request; each of its sentences is one
scheduler request, batched with everyone else's. A bad request (unknown voice, no text, over a
limit, the server busy) is answered with an ``error`` event, after which the server closes the
connection (Home Assistant's client waits for audio until then). A client that closes the
connection cancels its session: the LLM sequence is released at the next decode step.

The protocol has no authentication, so everything a client controls is bounded
(:class:`~cosyllama.server.conn.ConnectionLimits`, the flags ``serve`` has too, and
:func:`event_caps`): events are read here, not by the `wyoming` package (which buffers whatever a
header announces): a header line and its data at most so many bytes for the event's type, checked
before they are read, no payload; an event complete within ``header_timeout`` of its first byte;
no event for ``idle_timeout`` while nothing is being spoken closes the connection; a write that
makes no progress for ``write_timeout`` (a client that stops reading) aborts the connection and
frees its session's sequence, flow work and slot; ``max_connections`` open at once. A malformed
event gets ``error`` ``protocol_error`` with a one-line reason and the connection is closed; the
log says so in one warning line per client (rate-limited), never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from urllib.parse import urlparse

from .. import __version__
from ..audio_out import pcm16
from ..errors import BackendBusyError, CosyllamaError, InputError, MissingDependencyError
from ..limits import LimitExceeded
from ..llm.scheduler import RequestCancelled, SchedulerBusyError
from ..request import SEED_RANGE, RequestError, SynthesisOptions, SynthesisRequest, check_options
from ..text.normalize import is_only_punctuation
from ..voices import describe_ids, show_id, unknown_voice
from .conn import ConnectionLimits
from .job import SynthesisJob
from .serving import INTERNAL_ERROR, Admission, SentenceStream, ServerBusyError
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
    from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
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

log = logging.getLogger("cosyllama.wyoming")
LISTED_BY = " (describe lists them)"  # where a Wyoming client finds every voice id

DEFAULT_VOICE = "default"  # the voice name that means "the server's default voice"
# the languages CosyVoice3 was trained on (ISO 639-1); it also speaks Chinese dialects through
# instructions, which a Wyoming request cannot give
LANGUAGES = ("zh", "en", "ja", "ko", "de", "es", "fr", "it", "ru")
SAMPLE_WIDTH = 2  # bytes: 16-bit PCM
CHANNELS = 1
MODEL_ATTRIBUTION = Attribution(name="FunAudioLLM (Fun-CosyVoice3-0.5B)", url="https://github.com/FunAudioLLM/CosyVoice")
VOICE_ATTRIBUTION = Attribution(name="a voice registered with this server", url="")

MAX_SESSIONS = 4  # sessions one connection may have waiting or speaking
STOP_GRACE_S = 5.0  # seconds a stopping server lets connections take their last events
SEND_BUFFER_BYTES = 128 * 1024  # a connection's kernel send buffer: 2.7 s of audio, plenty for any link
QUEUED_INPUTS = 8  # text one connection may have waiting to be spoken, in --max-input-chars
BAD_CLIENT_LINES = 10  # warnings about misbehaving clients per minute; the rest are counted


def error_event(e: BaseException) -> Event:
    """The ``error`` event answering an exception raised by a request: its text says what the
    client can act on, never the server's files, libraries or exception texts (the log has those)."""
    if isinstance(e, RequestRefused):
        code = e.code
    elif isinstance(e, LimitExceeded):
        code = "limit_exceeded"
    elif isinstance(e, (ServerBusyError, SchedulerBusyError, BackendBusyError)):
        code = "busy"
    elif isinstance(e, RequestError):  # a synthesis rule; the Wyoming event's field is text
        code = "empty_text" if e.code == "empty_string" and e.field == "text" else "invalid_input"
    elif isinstance(e, InputError):
        code = "invalid_input"
    elif isinstance(e, CosyllamaError):
        code = "invalid_request"
    else:
        log.error("synthesis failed", exc_info=e)
        return Error(text=INTERNAL_ERROR,
                     code="internal_error").event()
    return Error(text=" ".join(str(e).split()), code=code).event()  # one line


# ----------------------------------------------------------------------------------------------
# What every connection shares


class WyomingService:
    """The served TTS (a :class:`~cosyllama.server.serving.Serving`), its admission gate, the default
    voice, the synthesis options of every request (e.g. ``greedy``/``seed``, which the protocol
    cannot carry) and the threads that run model code (never the event loop)."""

    def __init__(self, serving, gate: Admission, *, default_voice: str | None = None, options=None,
                 connection_limits: ConnectionLimits | None = None):
        self.serving, self.tts, self.gate = serving, serving.tts, gate
        self.default_voice = default_voice
        self.options = replace(options or SynthesisOptions(), stream=True)
        check_options(self.options)  # e.g. a speed, which streaming synthesis cannot make: refused at start
        self.limits = connection_limits if connection_limits is not None else ConnectionLimits()
        self.caps = event_caps(serving.limits)
        self.executor = ThreadPoolExecutor(serving.max_concurrent + 2, thread_name_prefix="cosyllama-wyoming")
        self.connections: dict[asyncio.Task, _Connection] = {}
        self._warned = _RateLimitedLog(BAD_CLIENT_LINES, 60.0)

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def info(self) -> Info:
        """The ``info`` event's content (reads the voice store: run it in :meth:`call`)."""
        voices = self.tts.voices.items()
        entries = [TtsVoice(name=vid, description=f"{vid} (cloned from a {v.duration:.1f} s clip)",
                            attribution=VOICE_ATTRIBUTION, installed=True, version=None, languages=list(LANGUAGES))
                   for vid, v in sorted(voices.items())]
        if DEFAULT_VOICE not in voices:
            try:
                default = f"default ({self._default_id(sorted(voices))})"
            except RequestRefused as e:
                default = f"default (none yet: {e})"
            entries.insert(0, TtsVoice(name=DEFAULT_VOICE, description=default, attribution=VOICE_ATTRIBUTION,
                                       installed=True, version=None, languages=list(LANGUAGES)))
        program = TtsProgram(name="cosyllama", attribution=MODEL_ATTRIBUTION, installed=True, version=__version__,
                             description="CosyVoice3 text-to-speech with cloned voices (cosyllama)",
                             voices=entries, supports_synthesize_streaming=True)
        return Info(tts=[program])

    def _default_id(self, ids: list[str]) -> str:
        if self.default_voice is not None:
            if self.default_voice not in ids:
                raise RequestRefused(f"the default voice {show_id(self.default_voice)} is not registered; registered "
                                     f"voices: {describe_ids(ids, more=LISTED_BY)}", "voice_not_found")
            return self.default_voice
        if not ids:
            raise RequestRefused("no voice is registered; register one through the HTTP API (POST /v1/voices) "
                                 "or start with --voices DIR holding one", "voice_not_found")
        return ids[0]

    def voice(self, voice) -> tuple[str, object]:
        """The id and features of the voice a request asks for (a ``SynthesizeVoice`` or None);
        reads the voice store: run it in :meth:`call`."""
        name = voice.name if voice is not None else None
        language = voice.language if voice is not None else None
        if language and language.replace("_", "-").split("-")[0].lower() not in LANGUAGES:
            raise RequestRefused(f"language {language!r} is not one CosyVoice3 speaks; it speaks "
                                 f"{', '.join(LANGUAGES)}", "language_not_supported")
        ids = sorted(self.tts.voices.ids())
        if name is None or (name == DEFAULT_VOICE and name not in ids):
            name = self._default_id(ids)
        elif name not in ids:
            raise self._unknown(name, ids)
        try:
            return name, self.tts.voices.get(name)
        except Exception as e:  # e.g. its file went bad: the client learns no path, the log has it
            log.warning("voice %s cannot be read: %s", name, e)
            raise self._unknown(name, ids) from e

    @staticmethod
    def _unknown(name: str, ids: list[str]) -> RequestRefused:
        return RequestRefused(unknown_voice(name, [DEFAULT_VOICE, *ids], more=LISTED_BY), "voice_not_found")

    def warn_bad_client(self, peer: str, why: str) -> None:
        """One warning line for a client that broke the protocol (:meth:`warn`)."""
        self.warn("Wyoming client %s broke the protocol: %s", peer, why)

    def warn(self, msg: str, *args) -> None:
        """A warning about a client, at most :data:`BAD_CLIENT_LINES` a minute (the rest are counted)."""
        self._warned(msg, *args)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class _RateLimitedLog:
    """``log.warning`` at most ``n`` times per ``window`` seconds; the lines left out are counted
    and the count is logged with the next line let through."""

    def __init__(self, n: int, window: float):
        self.n, self.window = n, window
        self.start, self.count, self.dropped = time.monotonic(), 0, 0

    def __call__(self, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self.start >= self.window:
            if self.dropped:
                log.warning("%d more such Wyoming clients were not logged", self.dropped)
            self.start, self.count, self.dropped = now, 0, 0
        if self.count < self.n:
            self.count += 1
            log.warning(msg, *args)
        else:
            self.dropped += 1


# ----------------------------------------------------------------------------------------------
# A session: the sentences of one synthesize, or of one synthesize-start ... -stop


class _Session:
    def __init__(self, conn: _Connection, voice_id: str, voice, streaming: bool, after: asyncio.Task | None):
        self.conn, self.service = conn, conn.service
        self.voice_id, self.voice, self.streaming = voice_id, voice, streaming
        self.sentences: asyncio.Queue[SynthesisRequest | None] = asyncio.Queue()
        self.n_requests = 0  # sentences queued so far: the k-th is seeded with the service's seed + k
        self.text = SentenceStream(self.service.serving.limits)  # streamed text, cut into sentences
        self.job: SynthesisJob | None = None
        self.waiting_for_text = False  # an open stream has spoken all it was sent: the client's turn
        self.task = asyncio.create_task(self._run(after), name=f"cosyllama-wyoming-{voice_id}")

    def add_text(self, piece: str) -> None:
        """Streamed text: queue each sentence it completes."""
        for s in self.text.add(piece):
            self._queue(s)

    def add_whole(self, text: str) -> None:
        self._queue(text)  # checked by the caller: one request, as it is

    def finish(self) -> None:
        """No more text: queue the rest (a last sentence without end punctuation)."""
        for s in self.text.finish():
            self._queue(s)
        if not self.text.n_sentences:
            raise RequestRefused("the stream ended without text to speak; send synthesize-chunk events with text "
                                 "between synthesize-start and synthesize-stop", "empty_text")
        self.sentences.put_nowait(None)

    def _queue(self, sentence: str) -> None:
        """One sentence (or a whole text) to speak, within this connection's bound on waiting text, as
        the :class:`~cosyllama.request.SynthesisRequest` it makes (whose refusal is the client's error event)."""
        limits = self.service.serving.limits
        if self.conn.queued_chars + len(sentence) > QUEUED_INPUTS * limits.input_chars:
            raise LimitExceeded(f"this connection has {self.conn.queued_chars} characters waiting to be "
                                f"spoken, at most {QUEUED_INPUTS} x --max-input-chars "
                                f"({QUEUED_INPUTS * limits.input_chars}); send more once its audio comes",
                                field="input", limit=QUEUED_INPUTS * limits.input_chars,
                                flag="--max-input-chars")
        opts = self.service.options
        if opts.seed is not None:  # wrapped into the seeds a request takes
            opts = replace(opts, seed=(opts.seed + self.n_requests) % (SEED_RANGE[1] + 1))
        request = SynthesisRequest(sentence, voice=self.voice, options=opts, limits=limits)  # its rules: refused here
        self.n_requests += 1
        self.conn.queued_chars += len(sentence)
        self.sentences.put_nowait(request)

    def cancel(self) -> None:
        """The client is gone: free the LLM sequence now, stop the session."""
        if self.job is not None:
            self.job.token.cancel()
        self.task.cancel()

    async def _run(self, after: asyncio.Task | None) -> None:
        if after is not None:  # the connection's earlier session speaks first
            await asyncio.wait([after])
        gate = self.service.gate
        try:
            await gate.admit()
        except ServerBusyError as e:
            await self.conn.fail(e)
            return
        try:
            await self._speak()
        except (asyncio.CancelledError, ConnectionError, RequestCancelled):
            pass  # the client went away
        except Exception as e:
            await self.conn.fail(e)
        finally:
            gate.release()
            self.conn.touch()

    async def _speak(self) -> None:
        service, tts, conn = self.service, self.service.tts, self.conn
        rate, ms = tts.sample_rate, 0.0
        started = False
        while True:
            if self.sentences.empty():
                self.waiting_for_text = True  # from here the idle timeout runs
                self.conn.touch()
            try:
                request = await self.sentences.get()
            finally:
                self.waiting_for_text = False
            if request is None:
                break
            self.conn.queued_chars -= len(request.text)
            job = self.job = SynthesisJob(tts, request)
            try:
                await service.call(job.open)
                while (samples := await service.call(job.next)) is not None:
                    if not samples.size:
                        continue
                    if not started:
                        await conn.write_event(AudioStart(rate=rate, width=SAMPLE_WIDTH, channels=CHANNELS,
                                                          timestamp=0).event())
                        started = True
                    await conn.write_event(AudioChunk(rate=rate, width=SAMPLE_WIDTH, channels=CHANNELS,
                                                      audio=pcm16(samples), timestamp=round(ms)).event())
                    ms += 1000 * samples.size / rate
            finally:
                self.job = None
                await asyncio.shield(service.call(job.close))
        if not started:  # every sentence was silent: still one (empty) audio stream
            await conn.write_event(AudioStart(rate=rate, width=SAMPLE_WIDTH, channels=CHANNELS, timestamp=0).event())
        await conn.write_event(AudioStop(timestamp=round(ms)).event())
        if self.streaming:
            await conn.write_event(SynthesizeStopped().event())


# ----------------------------------------------------------------------------------------------
# A connection


class _Closed(Exception):
    """The connection ends here (the client left, or it was answered and closed)."""


class _Connection:
    """One client: reads its events (bounded, :meth:`_read_event`), answers them, and writes
    events with a bound on how long a write may make no progress (:meth:`write_event`)."""

    def __init__(self, service: WyomingService, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.service, self.reader, self.writer = service, reader, writer
        self.limits = service.limits
        self.loop = asyncio.get_running_loop()
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "a client"
        self.stream: _Session | None = None  # the open synthesize-start ... -stop
        self.sessions: list[_Session] = []  # in order; the last one may still be speaking
        self.queued_chars = 0  # text of its sessions not yet spoken
        self.failed = False
        self.quiet_since = self.loop.time()  # when the client's turn began (for the idle timeout)

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Answer events until the client leaves, breaks the protocol or is refused; never raises."""
        try:
            while not self.failed:
                try:
                    event = await self._read_event()
                except InputError as e:  # a malformed event, or one over its bounds
                    if not isinstance(e, ProtocolError):
                        self.service.warn_bad_client(self.peer, str(e))
                    await self.fail(e)
                    break
                if event is None or not await self.handle_event(event):
                    break
        except (_Closed, ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception as e:  # a bug: say so once in the log, and close
            log.error("Wyoming connection of %s failed", self.peer, exc_info=e)
        finally:
            with contextlib.suppress(Exception):
                await self.disconnect()
            self._close()

    def touch(self) -> None:
        """Nothing of this connection is being spoken from now on until it sends more: the idle timeout restarts."""
        self.quiet_since = self.loop.time()

    def _busy(self) -> bool:
        """Whether a session is waiting for a slot or speaking (the client may be silent meanwhile)."""
        return any(not s.task.done() and not s.waiting_for_text for s in self.sessions)

    # -- reading -------------------------------------------------------------------------------

    async def _first_byte(self) -> bytes:
        """The first byte of the next event; b"" when the client is gone. Closes the connection
        when the client sends nothing for ``idle_timeout`` seconds while nothing is being spoken."""
        idle = self.limits.idle_timeout
        while True:
            busy = self._busy()
            wait = idle if busy else self.quiet_since + idle - self.loop.time()
            if wait > 0:
                try:
                    return await asyncio.wait_for(self.reader.read(1), wait)
                except asyncio.TimeoutError:
                    pass
            if self._busy():  # a session that ends or waits for text touches the connection
                continue
            if self.loop.time() - self.quiet_since >= idle:
                log.info("closed the Wyoming connection of %s: no event for %g s (--idle-timeout)", self.peer, idle)
                await self.fail(RequestRefused(f"no event for {idle:g} s (--idle-timeout); the connection is "
                                               "closed", "idle_timeout"))
                raise _Closed

    async def _read_event(self) -> Event | None:
        """The next event, read within bounds: None when the client left. :class:`ProtocolError`
        (or :class:`LimitExceeded`) for an event this server does not read."""
        first = await self._first_byte()
        if not first:
            return None
        self.touch()
        try:
            return await read_event(self.reader, first, self.service.caps, self.limits.header_timeout,
                                    self.service.serving.limits.input_chars)
        except asyncio.TimeoutError:
            seconds = self.limits.header_timeout
            log.info("closed the Wyoming connection of %s: an event took more than %g s (--header-timeout)",
                     self.peer, seconds)
            await self.fail(RequestRefused(f"the event did not arrive within {seconds:g} s of its first byte "
                                           "(--header-timeout)", "request_timeout"))
            raise _Closed from None

    # -- answering -----------------------------------------------------------------------------

    async def handle_event(self, event: Event) -> bool:
        """Answer one (well-formed) event; False once the connection is to close."""
        try:
            data, kind = event.data, event.type
            if Describe.is_type(kind):
                await self.write_event((await self.service.call(self.service.info)).event())
            elif Ping.is_type(kind):
                await self.write_event(Pong(text=optional_str(data, "text", "ping")).event())
            elif SynthesizeStart.is_type(kind):
                voice = voice_field(data, kind)
                if self.stream is not None:
                    raise ProtocolError("synthesize-start inside a stream; end it with synthesize-stop first")
                self.stream = await self._open(voice, streaming=True)
            elif SynthesizeChunk.is_type(kind):
                text = text_field(data, kind)
                self._stream(kind).add_text(text)
            elif SynthesizeStop.is_type(kind):
                stream, self.stream = self._stream(kind), None
                stream.finish()
            elif Synthesize.is_type(kind):
                text, voice = text_field(data, kind), voice_field(data, kind)
                if self.stream is None:  # inside a stream: its copy for old servers, ignored
                    if is_only_punctuation(text.strip()):  # empty, blank or nothing to say
                        raise RequestRefused("text is empty; give some text to speak", "empty_text")
                    session = await self._open(voice, streaming=False)
                    session.add_whole(text)
                    session.sentences.put_nowait(None)
            return True
        except (ConnectionError, _Closed):
            return False
        except Exception as e:
            await self.fail(e)
            return False

    def _stream(self, what: str) -> _Session:
        if self.stream is None:
            raise ProtocolError(f"{what} without synthesize-start")
        return self.stream

    async def _open(self, voice, streaming: bool) -> _Session:
        self.sessions = [s for s in self.sessions if not s.task.done()]
        if len(self.sessions) >= MAX_SESSIONS:
            raise RequestRefused(f"this connection has {len(self.sessions)} requests waiting or speaking, at most "
                                 f"{MAX_SESSIONS}; wait for audio-stop before sending more", "busy")
        voice_id, features = await self.service.call(self.service.voice, voice)
        after = self.sessions[-1].task if self.sessions else None
        session = _Session(self, voice_id, features, streaming, after)
        self.sessions.append(session)
        return session

    # -- writing and closing -------------------------------------------------------------------

    async def write_event(self, event: Event) -> None:
        """Send ``event``; a ``ConnectionError`` when the client is gone, or when the write made no
        progress for ``write_timeout`` seconds (then the connection is aborted)."""
        transport = self.writer.transport
        if transport.is_closing():
            raise ConnectionResetError("the connection is closed")
        self.writer.write(event_bytes(event))
        seconds = self.limits.write_timeout
        while True:
            before = transport.get_write_buffer_size()
            try:
                await asyncio.wait_for(self.writer.drain(), seconds)
                return
            except asyncio.TimeoutError:
                if not transport.is_closing() and transport.get_write_buffer_size() < before:
                    continue  # a slow reader, but it reads
            log.info("closed the Wyoming connection of %s: it read nothing for %g s (--write-timeout)",
                     self.peer, seconds)
            self.failed = True
            transport.abort()  # its sessions are cancelled as when it leaves
            raise ConnectionResetError("the client stopped reading")

    async def fail(self, e: BaseException) -> None:
        """Answer ``e`` with an ``error`` event, then close the connection."""
        if self.failed:
            return
        self.failed = True
        if isinstance(e, ProtocolError):
            self.service.warn_bad_client(self.peer, str(e))
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.write_event(error_event(e))
        self._close()

    def _close(self) -> None:
        """Close the connection: what is written goes out, within ``write_timeout``; the reader ends."""
        transport = self.writer.transport
        if not transport.is_closing():
            transport.close()
            if transport.get_write_buffer_size():
                self.loop.call_later(self.limits.write_timeout, transport.abort)
        self.reader.feed_eof()

    async def disconnect(self) -> None:
        """The connection ended: cancel its sessions; their sequences are free when this returns."""
        for s in self.sessions:
            s.cancel()
        for s in self.sessions:
            await asyncio.wait([s.task])


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
    from .serving import check_can_listen

    u = urlparse(check_uri(uri))
    if u.scheme == "tcp":
        check_can_listen(u.hostname, u.port, uri)


class WyomingServer:
    """A running Wyoming server (from :func:`start_wyoming`); ``address`` is where it listens."""

    def __init__(self, server: asyncio.AbstractServer, service: WyomingService, address, unix_path: str | None):
        self.server, self.service, self.address, self.unix_path = server, service, address, unix_path

    async def stop(self) -> None:
        """Stop listening and end every connection (their sessions are cancelled)."""
        self.server.close()
        connections = dict(self.service.connections)
        for conn in connections.values():
            conn._close()  # each connection's reader ends, so it cancels its sessions
        if connections:
            _, stuck = await asyncio.wait(list(connections), timeout=STOP_GRACE_S)
            for task in stuck:  # a client that reads nothing: drop what it was sent
                connections[task].writer.transport.abort()
            if stuck:
                await asyncio.wait(stuck)
        if self.unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)
        self.service.close()


async def _accept(service: WyomingService, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A new connection: served, or refused with ``busy`` past ``max_connections``."""
    task = asyncio.current_task()
    limit = service.limits.max_connections
    if len(service.connections) >= limit:
        service.warn("refused a Wyoming connection: %d open, --max-connections %d", limit, limit)
        refusal = Error(text=f"the server has {limit} connections open, its limit (--max-connections); retry in "
                             "a moment", code="busy").event()
        with contextlib.suppress(Exception):
            writer.write(event_bytes(refusal))
            writer.transport.close()
            if writer.transport.get_write_buffer_size():
                asyncio.get_running_loop().call_later(service.limits.write_timeout, writer.transport.abort)
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:  # the kernel holds at most this much of what a client has not read (else up to MBs)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    conn = _Connection(service, reader, writer)
    service.connections[task] = conn
    try:
        await conn.run()
    finally:
        service.connections.pop(task, None)


async def start_wyoming(uri: str, serving, *, gate: Admission | None = None, default_voice: str | None = None,
                        options=None, connection_limits: ConnectionLimits | None = None) -> WyomingServer:
    """Listen at ``uri`` in the running event loop and answer the Wyoming protocol from ``serving``
    (a :class:`~cosyllama.server.serving.Serving`); ``gate``: the admission gate to share (default: a new
    one of ``serving``'s bounds). ``options``: the :class:`~cosyllama.tts.SynthesisOptions` of
    every request (always streaming). ``connection_limits``: what a client may hold (default
    :class:`ConnectionLimits`()). A TCP port 0 listens on a free port (see ``address``)."""
    check_uri(uri)
    gate = gate if gate is not None else Admission(serving.max_concurrent, serving.max_queue)
    service = WyomingService(serving, gate, default_voice=default_voice, options=options,
                             connection_limits=connection_limits)
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
        service.close()
        raise InputError(f"cannot listen at {uri}: {e.strerror or e}") from e
    sockets = server.sockets or ()
    address = sockets[0].getsockname() if sockets else uri
    return WyomingServer(server, service, address, unix_path)


def run_wyoming(options, uri: str) -> None:
    """Run ``cosyllama wyoming`` at ``uri`` until interrupted; ``options``: a
    :class:`~cosyllama.server.startup.ServingOptions` (the start-up is the one ``serve`` has)."""
    from .serving import prepare
    from .startup import ready, start

    uri = check_uri(uri)
    tts, voices = start(options, lambda: check_listen(uri))
    serving = prepare(tts, max_queue=options.max_queue, limits=options.limits, prefill_chunk=options.prefill_chunk,
                      interleave=options.interleave, voices=voices)
    ready(tts, voices)  # after prepare: the store has its encoder by then, so voice folders warm too
    wyoming_options = {"default_voice": options.default_voice, "connection_limits": options.connection_limits}

    async def main():
        server = await start_wyoming(uri, serving, **wyoming_options)
        log.warning("Wyoming server listening on %s (%d voices)", uri, len(serving.tts.voices))
        stopped = asyncio.Event()
        with contextlib.suppress(NotImplementedError, RuntimeError):  # SIGTERM (systemd, docker stop): stop cleanly
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
        try:
            await stopped.wait()
        finally:
            await server.stop()
        log.warning("Wyoming server stopped")

    try:
        asyncio.run(main())
    finally:
        serving.close()


__all__ = ["DEFAULT_VOICE", "LANGUAGES", "ProtocolError", "RequestRefused", "WyomingServer", "WyomingService",
           "check_listen", "check_uri", "error_event", "event_bytes", "event_caps", "run_wyoming", "start_wyoming"]
