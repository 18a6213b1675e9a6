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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from urllib.parse import urlparse

from .. import __version__
from ..errors import BackendBusyError, CosyllamaError, InputError, MissingDependencyError
from ..heap import trim_heap
from ..limits import LimitExceeded
from ..llm.scheduler import CancelToken, RequestCancelled, SchedulerBusyError
from ..text.normalize import is_only_punctuation
from .serving import Gate, SentenceStream, ServerBusyError, pcm16

try:
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.error import Error
    from wyoming.event import Event
    from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
    from wyoming.server import AsyncEventHandler, AsyncServer
    from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise MissingDependencyError("the Wyoming server needs its extra: pip install 'cosyllama[wyoming]'") from e

log = logging.getLogger("cosyllama.wyoming")

DEFAULT_VOICE = "default"  # the voice name that means "the server's default voice"
# the languages CosyVoice3 was trained on (ISO 639-1); it also speaks Chinese dialects through
# instructions, which a Wyoming request cannot give
LANGUAGES = ("zh", "en", "ja", "ko", "de", "es", "fr", "it", "ru")
SAMPLE_WIDTH = 2  # bytes: 16-bit PCM
CHANNELS = 1
MODEL_ATTRIBUTION = Attribution(name="FunAudioLLM (Fun-CosyVoice3-0.5B)", url="https://github.com/FunAudioLLM/CosyVoice")
VOICE_ATTRIBUTION = Attribution(name="a voice registered with this server", url="")


class RequestRefused(InputError):
    """A request the server answers with an ``error`` event; ``code`` is its machine-readable reason."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def error_event(e: BaseException) -> Event:
    """The ``error`` event answering an exception raised by a request."""
    if isinstance(e, RequestRefused):
        code = e.code
    elif isinstance(e, LimitExceeded):
        code = "limit_exceeded"
    elif isinstance(e, (ServerBusyError, SchedulerBusyError, BackendBusyError)):
        code = "busy"
    elif isinstance(e, InputError):
        code = "invalid_input"
    elif isinstance(e, CosyllamaError):
        code = "invalid_request"
    else:
        log.error("synthesis failed", exc_info=e)
        return Error(text=f"synthesis failed: {type(e).__name__}: {e}", code="internal_error").event()
    return Error(text=str(e), code=code).event()


# ----------------------------------------------------------------------------------------------
# What every connection shares


class WyomingService:
    """The served TTS (a :class:`~cosyllama.server.serving.Serving`), its admission gate, the default
    voice, the synthesis options of every request (e.g. ``greedy``/``seed``, which the protocol
    cannot carry) and the threads that run model code (never the event loop)."""

    def __init__(self, serving, gate: Gate, *, default_voice: str | None = None, options=None):
        from ..tts import SynthesisOptions

        self.serving, self.tts, self.gate = serving, serving.tts, gate
        self.default_voice = default_voice
        self.options = replace(options or SynthesisOptions(), stream=True)
        self.executor = ThreadPoolExecutor(serving.max_concurrent + 2, thread_name_prefix="cosyllama-wyoming")

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
                raise RequestRefused(f"the default voice {self.default_voice!r} is not registered; registered "
                                     f"voices: {', '.join(ids) or 'none'}", "voice_not_found")
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
            raise RequestRefused(f"unknown voice {name!r}; voices: {', '.join([DEFAULT_VOICE, *ids])}",
                                 "voice_not_found")
        return name, self.tts.voices.get(name)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


# ----------------------------------------------------------------------------------------------
# One sentence's synthesis, advanced chunk by chunk from the service's threads


class _Job:
    """``lock`` keeps ``close`` from running while a chunk is being made in another thread; the
    cancel token frees the LLM sequence without waiting for that chunk."""

    def __init__(self, tts, text: str, voice, options):
        self.tts, self.text, self.voice, self.options = tts, text, voice, options
        self.token = CancelToken()
        self.lock = threading.Lock()
        self.syn = None

    def open(self) -> None:
        with self.lock, self.token.bound():
            self.syn = self.tts.synthesize(self.text, voice=self.voice, options=self.options)

    def next(self):
        """The next chunk's float32 samples, or None at the end."""
        with self.lock, self.token.bound():
            chunk = next(self.syn, None) if self.syn is not None else None
        return None if chunk is None else chunk.samples

    def close(self) -> None:
        self.token.cancel()
        with self.lock:
            if self.syn is not None:
                self.syn.close()
        trim_heap()


# ----------------------------------------------------------------------------------------------
# A session: the sentences of one synthesize, or of one synthesize-start ... -stop


class _Session:
    def __init__(self, conn: _Connection, voice_id: str, voice, streaming: bool, after: asyncio.Task | None):
        self.conn, self.service = conn, conn.service
        self.voice_id, self.voice, self.streaming = voice_id, voice, streaming
        self.sentences: asyncio.Queue[str | None] = asyncio.Queue()
        self.text = SentenceStream(self.service.serving.limits)  # streamed text, cut into sentences
        self.job: _Job | None = None
        self.task = asyncio.create_task(self._run(after), name=f"cosyllama-wyoming-{voice_id}")

    def add_text(self, piece: str) -> None:
        """Streamed text: queue each sentence it completes."""
        for s in self.text.add(piece):
            self.sentences.put_nowait(s)

    def add_whole(self, text: str) -> None:
        self.sentences.put_nowait(text)  # checked by the caller: one request, as it is

    def finish(self) -> None:
        """No more text: queue the rest (a last sentence without end punctuation)."""
        for s in self.text.finish():
            self.sentences.put_nowait(s)
        if not self.text.n_sentences:
            raise RequestRefused("the stream ended without text to speak; send synthesize-chunk events with text "
                                 "between synthesize-start and synthesize-stop", "empty_text")
        self.sentences.put_nowait(None)

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

    async def _speak(self) -> None:
        service, tts, conn = self.service, self.service.tts, self.conn
        rate, ms, k = tts.sample_rate, 0.0, 0
        started = False
        while (text := await self.sentences.get()) is not None:
            opts = service.options if service.options.seed is None else replace(service.options,
                                                                                  seed=service.options.seed + k)
            job = self.job = _Job(tts, text, self.voice, opts)
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
            k += 1
        if not started:  # every sentence was silent: still one (empty) audio stream
            await conn.write_event(AudioStart(rate=rate, width=SAMPLE_WIDTH, channels=CHANNELS, timestamp=0).event())
        await conn.write_event(AudioStop(timestamp=round(ms)).event())
        if self.streaming:
            await conn.write_event(SynthesizeStopped().event())


# ----------------------------------------------------------------------------------------------
# A connection


class _Connection(AsyncEventHandler):
    def __init__(self, service: WyomingService, reader, writer):
        super().__init__(reader, writer)
        self.service = service
        self.stream: _Session | None = None  # the open synthesize-start ... -stop
        self.sessions: list[_Session] = []  # in order; the last one may still be speaking
        self.failed = False

    async def handle_event(self, event: Event) -> bool:
        try:
            if Describe.is_type(event.type):
                await self.write_event((await self.service.call(self.service.info)).event())
            elif SynthesizeStart.is_type(event.type):
                if self.stream is not None:
                    raise RequestRefused("synthesize-start inside a stream; end it with synthesize-stop first",
                                         "protocol_error")
                self.stream = await self._open(SynthesizeStart.from_event(event).voice, streaming=True)
            elif SynthesizeChunk.is_type(event.type):
                self._stream("synthesize-chunk").add_text(SynthesizeChunk.from_event(event).text)
            elif SynthesizeStop.is_type(event.type):
                stream, self.stream = self._stream("synthesize-stop"), None
                stream.finish()
            elif Synthesize.is_type(event.type) and self.stream is None:  # inside a stream: its copy for old servers
                request = Synthesize.from_event(event)
                if is_only_punctuation(request.text.strip()):  # empty, blank or nothing to say
                    raise RequestRefused("text is empty; give some text to speak", "empty_text")
                self.service.serving.limits.check_chars("input", request.text)
                session = await self._open(request.voice, streaming=False)
                session.add_whole(request.text)
                session.sentences.put_nowait(None)
            return True  # other events are not for a TTS server
        except Exception as e:
            await self.fail(e)
            return False

    def _stream(self, what: str) -> _Session:
        if self.stream is None:
            raise RequestRefused(f"{what} without synthesize-start", "protocol_error")
        return self.stream

    async def _open(self, voice, streaming: bool) -> _Session:
        voice_id, features = await self.service.call(self.service.voice, voice)
        self.sessions = [s for s in self.sessions if not s.task.done()]
        after = self.sessions[-1].task if self.sessions else None
        session = _Session(self, voice_id, features, streaming, after)
        self.sessions.append(session)
        return session

    async def fail(self, e: BaseException) -> None:
        """Answer ``e`` with an ``error`` event, then close the connection."""
        if self.failed:
            return
        self.failed = True
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.write_event(error_event(e))
        await self.stop()

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


def wyoming_options_from_args(args) -> dict:
    """The Wyoming keyword arguments of :func:`start_wyoming` from parsed options, checked."""
    if getattr(args, "default_voice", None) is not None:
        from ..voices import check_voice_id

        check_voice_id(args.default_voice)
    return {"default_voice": getattr(args, "default_voice", None)}


class WyomingServer:
    """A running Wyoming server (from :func:`start_wyoming`); ``address`` is where it listens."""

    def __init__(self, server: AsyncServer, service: WyomingService, address):
        self.server, self.service, self.address = server, service, address

    async def stop(self) -> None:
        """Stop listening and end every connection (their sessions are cancelled)."""
        await self.server.stop()  # each connection's reader ends, so its handler cancels its sessions
        handlers = list(getattr(self.server, "_handlers", ()))
        if handlers:
            await asyncio.wait(handlers)
        self.service.close()


async def start_wyoming(uri: str, serving, *, gate: Gate | None = None, default_voice: str | None = None,
                        options=None) -> WyomingServer:
    """Listen at ``uri`` in the running event loop and answer the Wyoming protocol from ``serving``
    (a :class:`~cosyllama.server.serving.Serving`); ``gate``: the admission gate to share (default: a new
    one of ``serving``'s bounds). ``options``: the :class:`~cosyllama.tts.SynthesisOptions` of
    every request (always streaming). A TCP port 0 listens on a free port (see ``address``)."""
    check_uri(uri)
    gate = gate if gate is not None else Gate(serving.max_concurrent, serving.max_queue)
    service = WyomingService(serving, gate, default_voice=default_voice, options=options)
    server = AsyncServer.from_uri(uri)
    try:
        await server.start(lambda reader, writer: _Connection(service, reader, writer))
    except OSError as e:  # e.g. the port is taken
        service.close()
        raise InputError(f"cannot listen at {uri}: {e.strerror or e}") from e
    sockets = server._server.sockets if getattr(server, "_server", None) is not None else ()
    address = sockets[0].getsockname() if sockets else uri
    return WyomingServer(server, service, address)


def run_wyoming(args) -> None:
    """Run ``cosyllama wyoming`` until interrupted."""
    from .serving import check_options, interleave_choice, load_tts, open_voice_store, openmp_hint, prepare, warm_voices

    uri = check_uri(args.uri)
    limits, chunk = check_options(args)
    wyoming_options = wyoming_options_from_args(args)
    voices = open_voice_store(getattr(args, "voices", None))
    tts = load_tts(args)
    tts.voices = voices
    warm_voices(tts)
    serving = prepare(tts, max_queue=args.max_queue, limits=limits, prefill_chunk=chunk,
                      interleave=interleave_choice(args))
    openmp_hint(tts)

    async def main():
        server = await start_wyoming(uri, serving, **wyoming_options)
        log.warning("Wyoming server listening on %s (%d voices)", uri, len(tts.voices))
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


__all__ = ["DEFAULT_VOICE", "LANGUAGES", "RequestRefused", "WyomingServer", "WyomingService", "check_uri",
           "error_event", "run_wyoming", "start_wyoming", "wyoming_options_from_args"]
