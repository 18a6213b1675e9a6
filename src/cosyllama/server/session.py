"""One client's streamed speech, whatever carries it: :class:`Session`, which owns the connection's life.

The WebSocket endpoint (:mod:`cosyllama.server.speech_stream`) and the Wyoming server
(:mod:`cosyllama.server.wyoming`) are codecs over it, each a :class:`Door`: it reads its client's messages
(:meth:`Door.read`), turns each into calls here (:meth:`Door.take`: :meth:`Session.configure`,
:meth:`~Session.add_text`, :meth:`~Session.add_whole`, :meth:`~Session.end_utterance`, :meth:`~Session.close`),
writes the session's events as its frames (:meth:`Door.send`) and says the connection's end in its protocol
(:meth:`Door.end`). What the session does is the same for both:

* **The life.** :meth:`Session.run` reads the client's messages and hands each to the door while a speaker
  task speaks what they queued, until the connection ends one of three ways, which the door then says: closed
  (the client's close, once what it queued is spoken), gone (the client left, or was cut for reading nothing:
  there is no one to tell) or an error (a refusal, the idle timeout, the server stopping, a failure of the
  server's: an ``error`` and a close). Then, in one place, the sentence being spoken is cancelled (its LLM
  sequence goes at the next decode step) and the slot freed; every task of the session has its exception
  retrieved, so a client that leaves while a write waits is no traceback in the log.
* **In order.** A door may refuse a message after what was queued before it (:class:`AfterQueued`; Wyoming's
  requests are answered in order): the earlier utterances are spoken, then the refusal ends the connection.
* **Sentences.** Text as it is written is cut into sentences (:class:`~cosyllama.server.sentences.SentenceStream`),
  each one :class:`~cosyllama.request.SynthesisRequest` made from the utterance's template, checked
  when it is queued (a refusal is the client's error at once) and spoken in order.
* **The seed rule.** Sentence ``k`` of an utterance is seeded with the utterance's seed ``+ k``
  (:func:`cosyllama.seeds.offset_seed`), as segment ``k`` of one request is: a text streamed sentence by
  sentence gets the seeds it would get sent whole and split the same way. A sentence after the first keeps
  the whitespace before it (``SynthesisRequest.lead``), as the whole text's segments keep theirs: so it is
  the same LLM input as well.
* **Admission.** An utterance holds one of the server's running slots
  (:class:`~cosyllama.server.admission.Admission`, the gate HTTP requests take) from its first
  sentence to its end; an utterance without sentences takes none.
* **Idle timeout.** :meth:`Session.receive` waits for the client's next message; with nothing queued
  or being spoken it waits at most ``idle_timeout`` seconds from the last message (or from when
  the last audio was sent), then refuses with ``idle_timeout``.
* **Write bound.** A door's :meth:`Door.send` waits as long as its client reads (no deadline of its own);
  the connection's :class:`~cosyllama.server.conn.WriteWatch` aborts it once nothing has left for
  ``--write-timeout``, and the send raises ``ConnectionError``: the client is gone.
* **The server's stop** (:mod:`cosyllama.server.shutdown`): :meth:`Session.stop` takes no new utterance (the
  client is told ``server_stopping`` after what it queued) and ends the session once its work is spoken,
  at once when it has none; :meth:`Session.cut` ends it now.

Model code runs in the serving's threads (:meth:`~cosyllama.server.serving.Serving.call`), never in
the event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Protocol

from ..limits import LimitExceeded
from ..llm.scheduler import RequestCancelled
from ..request import SynthesisRequest
from ..seeds import offset_seed
from .errors import CLOSE_GOING_AWAY, Refusal
from .job import SynthesisJob
from .sentences import SentenceStream

STOPPING = "server_stopping"  # the code of the refusal a stopping server answers with


def stopping_refusal() -> Refusal:
    """What a session is told when the server stops (WebSocket: then close 1001, going away)."""
    return Refusal("the server is stopping; connect again (to another server) for more", STOPPING,
                   close=CLOSE_GOING_AWAY)


class AfterQueued(Exception):
    """Raised by :meth:`Door.take`: ``error`` answers this message once what was queued before it is spoken
    (no message is taken after it), instead of at once."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class Template:
    """What an utterance's sentences are made from: ``request`` (checked, with its voice; its text
    a stand-in), ``whole`` (the utterance is one sentence, spoken at its end) and ``door`` (the codec's
    own per-utterance data, e.g. the WebSocket's audio format; its ``job(tts, request)`` makes a sentence's
    synthesis, :meth:`SynthesisJob.output` being what :class:`Audio` carries)."""

    request: SynthesisRequest
    whole: bool = False
    door: object = None


@dataclass(frozen=True)
class Sentence:
    """One sentence to speak: the ``index``-th of utterance ``utterance``."""

    utterance: int
    index: int
    text: str
    request: SynthesisRequest  # its synthesis, seeded by the seed rule
    door: object  # the utterance's Template.door


@dataclass(frozen=True)
class Audio:
    """Audio of ``sentence``, as its job makes it (not empty)."""

    sentence: Sentence
    data: object  # float32 samples (a SynthesisJob) or encoded bytes (the WebSocket's SpeechJob)


@dataclass(frozen=True)
class SentenceDone:
    sentence: Sentence
    segments: tuple = ()  # its synthesis's cosyllama.captions.Segment list (times, words when asked)
    retries: tuple = ()  # its synthesis's caught takes (cosyllama.llm.takes.BadTake), docs/retries.md


@dataclass(frozen=True)
class UtteranceDone:
    utterance: int
    total: int  # its sentences
    door: object  # its Template.door


CLOSED = "closed"  # an ending: the client's close honoured (the others: None, gone; an exception, an error)


class Door(Protocol):
    """What a codec gives the session."""

    async def read(self) -> object | None:
        """The client's next message (as the door reads it), None once the client has left."""
        ...

    async def take(self, message) -> None:
        """``message`` as calls on the session; raises what refuses it (at once, or :class:`AfterQueued`)."""
        ...

    async def send(self, event: Audio | SentenceDone | UtteranceDone) -> None:
        """Write ``event`` as the door's frames, however slowly the client reads; ``ConnectionError`` when
        the client is gone (or was cut for reading nothing)."""
        ...

    async def end(self, ending: str | Exception | None) -> None:
        """Say the connection's end and close it: :data:`CLOSED`, None (gone: nothing to say) or the
        exception it ends with (an ``error``, then a close where the protocol has one)."""
        ...


_CLOSE = object()  # the speaker's last item (close())
_FINISHED = object()  # receive(): the speaker ended after close()
GONE = (ConnectionError, RequestCancelled)  # what a client that went away (or was cut) makes a session raise


@dataclass(frozen=True)
class _Refused:
    """The speaker's item of a refusal answered in order (:class:`AfterQueued`)."""

    error: Exception


def _retrieve(task: asyncio.Future) -> None:
    """A done callback: the task's exception is retrieved (the session says what matters; asyncio would log
    the rest as "never retrieved" with a traceback when the task is collected)."""
    if not task.cancelled():
        task.exception()


class Session:
    """One connection's streamed speech over ``serving`` (a :class:`~cosyllama.server.serving.Serving`),
    its events sent through ``door``. ``text_per_utterance``: each utterance cuts its own text (its
    ``--max-session-chars`` counted per utterance; else per connection); ``max_waiting_chars``: characters
    queued and not yet being spoken (None: no bound); :attr:`pending` counts the utterances waiting or
    being spoken (a door may bound it). Made inside the running event loop; :meth:`run` it."""

    def __init__(self, serving, door: Door, *, idle_timeout: float, text_per_utterance: bool = False,
                 max_waiting_chars: int | None = None, noun: str = "message"):
        self.serving, self.door = serving, door
        self.limits = serving.limits
        self.idle_timeout, self.noun = idle_timeout, noun
        self.text_per_utterance = text_per_utterance
        self.max_waiting_chars = max_waiting_chars
        self.template: Template | None = None  # for utterances opened from now
        self.text = SentenceStream(self.limits)
        self.utterance = 0  # the open utterance's index
        self.open_template: Template | None = None  # the open utterance's template (None: none open)
        self.n_queued = 0  # sentences of the open utterance so far
        self.took_text = False  # the open utterance has taken text
        self.pending = 0  # utterances queued or being spoken
        self.waiting_chars = 0  # characters queued, not yet being spoken
        self.closing = False  # close() came, or a refusal in order: no message is taken any more
        self.stopping = False  # stop(): no new utterance
        self.cut_now = False  # cut(): end now
        self.partial = False  # the sentence that failed had sent audio
        self.job: SynthesisJob | None = None
        self._work: asyncio.Queue = asyncio.Queue()
        self._in_hand = None  # the item the speaker is on
        self._wake = asyncio.Event()  # the speaker ran out of work, or the server stops
        self._loop = asyncio.get_running_loop()
        self.quiet_since = self._loop.time()
        self._speaker: asyncio.Task | None = None
        self._reading: asyncio.Future | None = None

    # -- the life -------------------------------------------------------------------------------

    async def run(self) -> None:
        """The connection's life, from its first message to its close (the module docstring); returns when
        it is over. Cancelled, it stops its work (and the door's connection ends with its task)."""
        self._speaker = asyncio.create_task(self._speak())
        self._speaker.add_done_callback(_retrieve)
        sessions = self.serving.sessions
        sessions.add(self)
        if self.serving.stopping:
            self.stop()
        try:
            try:
                ending = await self._converse()
            finally:
                await self._stop_work()
        finally:
            sessions.discard(self)
        try:
            await self.door.end(ending)
        except GONE:
            pass  # the client went away meanwhile: there is no one to tell

    async def _converse(self) -> str | Exception | None:
        """Messages to the door until the connection ends: how it ends (:meth:`Door.end`)."""
        try:
            while True:
                message = await self.receive()
                if message is _FINISHED:
                    return CLOSED
                if message is None:
                    return None  # the client left
                if not self.closing:
                    try:
                        await self.door.take(message)
                    except AfterQueued as e:
                        self.refuse(e.error)
        except GONE:
            return None
        except Exception as e:  # a refusal, the idle timeout, the server stopping, a failure of the server's
            return e

    def refuse(self, error: Exception) -> None:
        """Answer ``error`` once what was queued before it is spoken; no message is taken after it."""
        if not self.closing:
            self.closing = True
            self._work.put_nowait(_Refused(error))

    def stop(self) -> None:
        """The server stops: no new utterance is taken (the client is told after what it queued); the session
        ends once its work is spoken, at once when it has none."""
        self.stopping = True
        self._wake.set()

    def cut(self) -> None:
        """The server's drain is over: the session ends now, telling the client the server stops."""
        self.cut_now = True
        self._wake.set()

    def has_work(self) -> bool:
        """An utterance is open, queued or being spoken."""
        return self.pending > 0 or self.busy()

    # -- what the client sends ------------------------------------------------------------------

    def configure(self, template: Template) -> None:
        """The template of the utterances opened from now, and of the open one when it has taken no
        text yet (a door refuses a new configuration inside an utterance: :attr:`in_utterance`)."""
        self.template = template
        if self.open_template is not None:
            self.open_template = template
            self.text.whole = template.whole

    @property
    def in_utterance(self) -> bool:
        """An utterance is open and has taken text."""
        return self.open_template is not None and (self.took_text or bool(self.n_queued))

    def _open(self) -> Template:
        if self.open_template is None:
            if self.stopping:
                raise AfterQueued(stopping_refusal())
            if self.template is None:
                raise Refusal("text before the session is configured", "session_not_configured")
            self.open_template = self.template
            self.pending += 1
            self.took_text = False
            if self.text_per_utterance:
                self.text = SentenceStream(self.limits)
            self.text.whole = self.template.whole
        return self.open_template

    def begin(self) -> None:
        """Open an utterance now (a Wyoming stream's start), with the current template."""
        self._open()

    def add_text(self, piece: str) -> None:
        """Text as it is written: each sentence it completes is queued."""
        self._open()
        self.took_text = self.took_text or bool(piece)
        for s, lead in zip(self.text.add(piece), self.text.leads):
            self._queue(s, lead)

    def add_whole(self, text: str) -> None:
        """One sentence, as it is (checked by the caller)."""
        self._open()
        self.took_text = True
        self._queue(text)

    def end_utterance(self, if_empty: Exception | None = None) -> int:
        """No more text in the open utterance: the rest is queued as its last sentence, then its end.
        Returns how many sentences it had; ``if_empty``: raised instead when it had none (nothing of
        it is sent then)."""
        template = self._open()
        for s, lead in zip(self.text.finish(), self.text.leads):
            self._queue(s, lead)
        total = self.n_queued
        if not total and if_empty is not None:
            raise if_empty
        self._work.put_nowait(UtteranceDone(self.utterance, total, template.door))
        self.utterance, self.n_queued, self.open_template = self.utterance + 1, 0, None
        return total

    def close(self) -> None:
        """What is queued is spoken, then the speaker ends (text not yet a sentence is dropped)."""
        self.closing = True
        self._work.put_nowait(_CLOSE)

    def _queue(self, text: str, lead: str = "") -> None:
        """One sentence to speak, within the bound on waiting text, as the request it makes (whose
        refusal is the client's error); ``lead``: the whitespace before it in the client's text, which a
        sentence after the utterance's first keeps (the whole text's segmentation does, docs/server.md)."""
        if self.max_waiting_chars is not None and self.waiting_chars + len(text) > self.max_waiting_chars:
            raise LimitExceeded(f"this connection has {self.waiting_chars} characters waiting to be "
                                f"spoken, at most {self.max_waiting_chars} "
                                f"({self.max_waiting_chars // self.limits.input_chars} x --max-input-chars); "
                                "send more once its audio comes",
                                field="input", limit=self.max_waiting_chars, flag="--max-input-chars")
        template = self.open_template
        request = template.request
        if request.options.seed is not None:  # the seed rule (module docstring)
            request = replace(request, options=replace(request.options, seed=offset_seed(request.options.seed,
                                                                                          self.n_queued)))
        request = replace(request, text=text, lead=lead if self.n_queued else "")  # its rules: refused here
        self._work.put_nowait(Sentence(self.utterance, self.n_queued, text, request, template.door))
        self.n_queued += 1
        self.waiting_chars += len(text)

    # -- waiting for the client -----------------------------------------------------------------

    def busy(self) -> bool:
        """Something is queued or being spoken (then the client may be silent)."""
        return self._in_hand is not None or not self._work.empty()

    def touch(self) -> None:
        """The client's turn begins now: the idle timeout restarts."""
        self.quiet_since = self._loop.time()

    async def receive(self):
        """The client's next message (what :meth:`Door.read` returns: None once the client left) within the
        idle timeout, or :data:`_FINISHED` once the speaker has ended after :meth:`close`. Raises what the
        speaker failed with, a :class:`~cosyllama.server.errors.Refusal` ``idle_timeout`` when the client sent
        nothing for ``idle_timeout`` seconds while nothing was being spoken, and ``server_stopping`` once the
        server stops and the session has no work (or at once, cut)."""
        loop, idle = self._loop, self.idle_timeout
        if self._reading is None:
            self._reading = asyncio.ensure_future(self.door.read())
            self._reading.add_done_callback(_retrieve)
        while True:
            if self.cut_now or (self.stopping and not self.has_work()):
                raise stopping_refusal()
            waker = asyncio.ensure_future(self._wake.wait())
            timeout = None if self.busy() else max(0.0, self.quiet_since + idle - loop.time())
            try:
                done, _ = await asyncio.wait({self._reading, waker, self._speaker}, timeout=timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                waker.cancel()
            if self._wake.is_set():
                self._wake.clear()
                self.quiet_since = max(self.quiet_since, loop.time())
            if self._speaker in done:
                if self._speaker.cancelled():  # its work was cancelled under it (the model threads stopped)
                    raise ConnectionAbortedError("the session's work was cancelled")
                self._speaker.result()  # raises what the speaker failed with
                return _FINISHED
            if self._reading in done:
                reading, self._reading = self._reading, None
                message = reading.result()
                self.touch()
                return message
            if not done and not self.busy() and loop.time() - self.quiet_since >= idle:
                raise Refusal(f"no {self.noun} for {idle:g} s with nothing being spoken (the server's "
                              "--idle-timeout); the connection is closed", "idle_timeout")

    async def _stop_work(self) -> None:
        """The one place a session's work stops: the read in progress and the sentence being spoken are
        cancelled (its LLM sequence goes at the next decode step), then the speaker; its slot is free when
        this returns."""
        reading, self._reading = self._reading, None
        if reading is not None:
            reading.cancel()
        if self.job is not None:
            self.job.token.cancel()
        self._speaker.cancel()
        await asyncio.shield(asyncio.wait([self._speaker]))

    # -- the speaker ----------------------------------------------------------------------------

    async def _speak(self) -> None:
        gate, held = self.serving.admission(), False
        try:
            while True:
                if self._work.empty():
                    self._wake.set()
                item = self._in_hand = await self._work.get()
                if item is _CLOSE:
                    return
                if isinstance(item, _Refused):
                    raise item.error
                if isinstance(item, UtteranceDone):
                    await self.door.send(item)
                    self.pending -= 1
                    if held:
                        gate.release()
                        held = False
                else:
                    self.waiting_chars -= len(item.text)
                    if not held:
                        await gate.admit()  # one slot per utterance, as an HTTP request holds one
                        held = True
                    await self._sentence(item)
                self._in_hand = None
        finally:
            self._in_hand = None
            if held:
                gate.release()

    async def _sentence(self, sentence: Sentence) -> None:
        call = self.serving.call
        job = self.job = sentence.door.job(self.serving.tts, sentence.request)
        sent = False
        try:
            await call(job.open)
            while (data := await call(job.output)) is not None:
                if len(data):
                    await self.door.send(Audio(sentence, data))
                    sent = True
            syn = job.syn
            await self.door.send(SentenceDone(sentence, tuple(syn.segments) if syn is not None else (),
                                              tuple(syn.timings.retries) if syn is not None else ()))
        except BaseException:
            self.partial = sent
            raise
        finally:
            self.job = None
            await asyncio.shield(call(job.close))


__all__ = ["CLOSED", "GONE", "STOPPING", "AfterQueued", "Audio", "Door", "Sentence", "SentenceDone", "Session",
           "Template", "UtteranceDone", "stopping_refusal"]
