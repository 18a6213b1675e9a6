"""What the HTTP server (:mod:`cosyllama.server`) and the Wyoming server
(:mod:`cosyllama.server.wyoming`) share, with neither's dependencies:

* :func:`load_tts`: the model the ``serve`` / ``wyoming`` options ask for (the start-up both run is
  :mod:`cosyllama.server.startup`);
* :func:`open_voice_store`, :func:`report_voices` and :func:`warm_voices`: the voices of ``--voices``;
* :func:`prepare`: the served pipeline over a TTS's models (its tokens from one batching scheduler,
  its calls checked against the limits, its voices, long texts normalized in a helper process), as a
  :class:`Serving`;
* :class:`Admission`: who runs now (so many requests run, so many more wait, the rest are refused);
* :class:`SentenceStream`: text as it is written (an LLM's answer, piece by piece) cut into the
  sentences to speak, within the limits (Wyoming's streamed synthesis, ``/v1/audio/speech/stream``);
* :data:`INTERNAL_ERROR`: all a client is told of a failure that is the server's (the unknown-voice
  message both use is :func:`cosyllama.voices.unknown_voice`).

One process serving both protocols (``serve --wyoming``) shares one :class:`Serving` and one gate.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from ..defaults import MAX_QUEUE
from ..errors import CosyllamaError, InputError
from ..limits import RequestLimits
from ..llm.factory import make_token_source
from ..llm.scheduler import DEFAULT_MAX_ACTIVE, DEFAULT_MAX_WAITING, BatchScheduler
from ..options import LoadOptions
from ..text.normalize import is_only_punctuation, take_sentences
from ..voices import ClipEncoder, VoiceDirectory, VoiceStore, describe_ids

log = logging.getLogger("cosyllama.server")

# what a client is told of a failure that is the server's (HTTP 500, Wyoming's internal_error): nothing
# of its files, libraries or exceptions, which go to the log
INTERNAL_ERROR = "internal error; the server's log has the details"


# ----------------------------------------------------------------------------------------------
# Admission


class ServerBusyError(CosyllamaError, RuntimeError):
    """Every running slot of the server is taken and its queue is full; retry later."""


class Admission:
    """At most ``limit`` requests run; up to ``queue`` more wait (FIFO); the rest are refused with
    :class:`ServerBusyError`. Made inside the event loop that uses it."""

    def __init__(self, limit: int, queue: int):
        self.limit, self.queue = limit, queue
        self.running = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(limit)

    async def admit(self, gone: asyncio.Future | None = None) -> bool:
        """Wait for a running slot (True); :class:`ServerBusyError` when none is free and the queue
        is full. ``gone``: a future (e.g. the task that waits for the client to leave) whose end
        takes the request out of the queue at once: False then, and no slot is held."""
        if self._sem.locked() and self.waiting >= self.queue:
            raise ServerBusyError(f"the server is busy ({self.running} requests running, {self.waiting} waiting)")
        if gone is not None and gone.done():
            return False
        self.waiting += 1
        try:
            if gone is None or not self._sem.locked():
                await self._sem.acquire()
            elif not await self._acquire_unless(gone):
                return False
        finally:
            self.waiting -= 1
        self.running += 1
        return True

    async def acquire(self, gone: asyncio.Future | None = None) -> bool:
        return await self.admit(gone)

    async def _acquire_unless(self, gone: asyncio.Future) -> bool:
        """The semaphore (True), unless ``gone`` ends first (False, nothing held)."""
        take = asyncio.ensure_future(self._sem.acquire())
        try:
            await asyncio.wait({take, gone}, return_when=asyncio.FIRST_COMPLETED)
            if take.done():
                return True
            take.cancel()
            await asyncio.wait({take})
        except BaseException:  # this request was cancelled meanwhile: a slot taken after all goes back
            take.add_done_callback(self._give_back)
            take.cancel()
            raise
        self._give_back(take)
        return False

    def _give_back(self, take: asyncio.Future) -> None:
        if not take.cancelled() and take.exception() is None:
            self._sem.release()

    def release(self) -> None:
        self.running -= 1
        self._sem.release()


# ----------------------------------------------------------------------------------------------
# Text as it is written


class SentenceStream:
    """The text of one streamed session, piece by piece, cut into the sentences to speak as soon as
    each is complete (:func:`~cosyllama.text.normalize.take_sentences`); ``whole=True`` keeps all
    of it for :meth:`finish` instead (one request for the whole text).

    Bounded by ``limits`` (a :class:`~cosyllama.limits.RequestLimits`): a piece, a sentence and the
    text waiting for its sentence's end are each at most ``input_chars`` characters (a sentence
    that never ends is refused, it does not grow), and the session at most ``session_chars`` in
    all, each piece counting at least one (so empty pieces cannot go on for ever). A refusal is a
    :class:`~cosyllama.limits.LimitExceeded`. Sentences made only of punctuation are dropped.
    """

    def __init__(self, limits: RequestLimits, whole: bool = False):
        self.limits, self.whole = limits, whole
        self.pending = ""  # text not yet a complete sentence
        self.received = 0  # characters taken, at least one per piece
        self.n_sentences = 0  # sentences handed out

    def add(self, piece: str) -> list[str]:
        """Take one piece; the sentences it completes."""
        self.limits.check_chars("input", piece)
        self.received += max(1, len(piece))
        self.limits.check_session(self.received)
        if self.whole:
            self.pending += piece
            self.limits.check_chars("input", self.pending)
            return []
        sentences, self.pending = take_sentences(self.pending + piece, known=len(self.pending))
        self.limits.check_chars("input", self.pending)
        return self._keep(sentences)

    def finish(self) -> list[str]:
        """No more text: the rest, as a last sentence (without end punctuation), if it says anything."""
        rest, self.pending = self.pending.strip(), ""
        return self._keep([rest])

    def _keep(self, sentences: list[str]) -> list[str]:
        out = [s for s in sentences if s and not is_only_punctuation(s)]
        for s in out:
            self.limits.check_chars("input", s)
        self.n_sentences += len(out)
        return out


# ----------------------------------------------------------------------------------------------
# The served pipeline


def check_can_listen(host: str, port: int, where: str) -> None:
    """An :class:`InputError` naming ``where`` when this process cannot listen at ``host``:``port``
    (taken, or not an address of this machine), found before a model is loaded; port 0 always can."""
    import socket

    if not port:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's and uvicorn's servers do
            s.bind(address)
    except OSError as e:
        raise InputError(f"cannot listen at {where}: {e.strerror or e}") from None


@dataclass
class Serving:
    """A TTS as a server runs it. ``tts``: the pipeline requests use (built by :func:`prepare` over the
    given TTS's models); ``scheduler``: the :class:`BatchScheduler` all of them decode through;
    ``max_concurrent`` running plus ``max_queue`` waiting requests (the gate's bounds); ``limits``:
    each request's bounds."""

    tts: object
    scheduler: BatchScheduler
    max_concurrent: int
    max_queue: int
    limits: RequestLimits
    owns_scheduler: bool

    def close(self) -> None:
        """Stop the text helper process, and the scheduler when :func:`prepare` made it."""
        self.tts.close()
        if self.owns_scheduler:
            self.scheduler.close()


def prepare(tts, *, max_concurrent: int | None = None, max_queue: int = MAX_QUEUE,
            limits: RequestLimits | None = None, scheduler: BatchScheduler | None = None,
            prefill_chunk: int | None = None, interleave: str | None = None,
            voices: VoiceStore | None = None) -> Serving:
    """Serve ``tts``'s models (a :class:`cosyllama.TTS`, left as it is) with a pipeline built here
    (:meth:`TTS.from_models <cosyllama.tts.TTS.from_models>`): requests decode through ``scheduler``,
    else ``tts.token_source`` when that is a :class:`BatchScheduler`, else one made here over
    ``tts.llm`` (prefilling ``prefill_chunk`` positions between two decode steps; closed by
    :meth:`Serving.close`); they speak with the voices of ``voices`` (default: ``tts.voices``).
    ``max_concurrent`` defaults to twice the scheduler's sequence slots, so the LLM stays busy while
    other requests are in the flow and vocoder. ``interleave``: when
    that scheduler pauses decoding for a request's flow work (``off``, ``first``, ``all``; None:
    :func:`cosyllama.cpu.interleave_stages` decides from the threads and cores)."""
    limits = RequestLimits() if limits is None else limits
    if scheduler is None and isinstance(tts.token_source, BatchScheduler):
        scheduler = tts.token_source
    owns_scheduler = scheduler is None
    if max_concurrent is None:
        max_concurrent = 2 * (int(tts.llm.n_seq_max or DEFAULT_MAX_ACTIVE) if owns_scheduler
                              else scheduler.max_active)
    if max_concurrent < 1 or max_queue < 0:
        raise ValueError("max_concurrent must be >= 1 and max_queue >= 0")
    llm_budget = tts.llm.max_seq_tokens
    if llm_budget is not None and llm_budget < limits.seq_tokens:
        raise ValueError(f"the LLM holds {llm_budget} positions per sequence, fewer than limits.seq_tokens "
                         f"({limits.seq_tokens}); lower the limit or load the LLM with max_seq_tokens >= it")
    if owns_scheduler:
        if interleave is None:
            interleave, why = choose_interleave(tts)
            log.warning("scheduler: %s (--interleave)", why)  # start-up facts go out at warning, as the voices line
        scheduler = make_token_source(tts.llm, batched=True, max_waiting=max(DEFAULT_MAX_WAITING, max_concurrent),
                                      prefill_chunk=prefill_chunk, interleave=interleave)
    elif scheduler.max_waiting < max_concurrent:
        raise ValueError(f"the scheduler lets {scheduler.max_waiting} requests wait, fewer than max_concurrent "
                         f"({max_concurrent}); make it with max_waiting >= {max_concurrent}")
    from ..tts import TTS

    # long texts normalize beside, not in, the event loop
    served = TTS.from_models(tts.models, token_source=scheduler, limits=limits,
                             voices=tts.voices if voices is None else voices, text_worker=True)
    served.voices.set_encoder(ClipEncoder.of(served))  # voice folders: made now (within the limits)
    report_voices(served.voices)
    return Serving(served, scheduler, max_concurrent, max_queue, limits, owns_scheduler)


# ----------------------------------------------------------------------------------------------
# Options and loading


def choose_interleave(tts) -> tuple[str, str]:
    """:func:`cosyllama.cpu.interleave_stages` for a loaded TTS: its LLM's threads (llama.cpp's own
    count; the torch LLM shares PyTorch's) and PyTorch's."""
    import torch

    from ..cpu import interleave_stages

    flow_threads = torch.get_num_threads()
    llm_threads = int(tts.llm.n_threads or flow_threads)
    return interleave_stages(llm_threads, flow_threads, torch.device(tts.device).type)


def load_tts(options: LoadOptions):
    """The TTS a server loads from ``options`` (checked when they were made, before the minutes of
    loading); the CPU line (the path that runs, and why) is logged after."""
    from ..cpu import tts_path
    from ..tts import TTS

    tts = TTS(options)
    for line in tts_path(tts, options.precision, options.threads).lines():
        log.warning("%s", line)  # the CPU line, as synth and demo print it (start-up facts go out at warning)
    return tts


def openmp_hint(tts) -> None:
    """Log, once at start, when the llama.cpp build threads with OpenMP (slower beside flow work)."""
    if tts.llm.name == "llamacpp":
        from ..llm.llamacpp_backend import openmp_serving_hint

        hint = openmp_serving_hint()
        if hint:
            log.warning("%s", hint)


# ----------------------------------------------------------------------------------------------
# Voices


def open_voice_store(path: str | None) -> VoiceStore:
    """The voice store ``--voices PATH`` asks for, read and checked (before the model loads, so a
    bad one is reported at once):

    * a directory (made when missing): a :class:`~cosyllama.voices.VoiceDirectory`; voices
      registered or deleted over HTTP are kept there and seen by every server sharing it; voice
      folders (``NAME/ref.wav`` and ``ref.txt`` or ``instruct.txt``) are made into voices by
      :func:`prepare`; a file or folder that cannot be read is skipped with a warning (it is no
      voice; ``/health`` counts it), so one bad file does not keep every replica down;
    * a voice file (:meth:`VoiceStore.save`): its voices, read-only (POST and DELETE get 403);
    * None: an empty store in memory; registered voices last until the server stops.

    :func:`prepare` says what was found (:func:`report_voices`).
    """
    if path is None:
        return VoiceStore()
    if Path(path).is_file():
        store = VoiceStore()
        store.load(path)
        store.read_only = True
        return store
    if Path(path).suffix == ".pt":
        raise InputError(f"voice file {path!r} does not exist (a directory to keep voices in needs a name "
                         "without the .pt suffix)")
    return VoiceDirectory(path)


def report_voices(store: VoiceStore) -> None:
    """The start-up line of the voices (:func:`prepare` logs it): how many are served (skipped
    files are none of them) and which files were skipped (the store logged each with its reason;
    the log is the operator's, ``/health`` says only how many without the API key)."""
    n = len(store)
    if isinstance(store, VoiceDirectory):
        skipped = store.skipped  # each was logged with its path and reason when it was found
        log.warning("voices: %d in the directory %s, where registrations are kept%s", n, store.directory,
                    f"; {len(skipped)} skipped: {describe_ids(list(skipped))}" if skipped else "")
    elif store.read_only:
        log.warning("voices: %d from a read-only voice file", n)
    else:
        log.warning("voices: %d, kept in memory only (registered voices are lost when the server stops; "
                    "--voices DIR keeps them)", n)


def warm_voices(tts, voices: VoiceStore | None = None) -> None:
    """Warm every voice of ``voices`` (default: ``tts.voices``) on ``tts``'s models in a background
    thread, beside the first requests (each voice's first stream gets a head start)."""
    voices = tts.voices if voices is None else voices
    if len(voices):
        threading.Thread(target=_warm_all, args=(tts, voices), name="cosyllama-warm-voices", daemon=True).start()


def _warm_all(tts, voices: VoiceStore) -> None:
    for vid in voices.ids():
        try:
            tts.warm_voice(voices.get(vid))
        except Exception as e:
            log.warning("warming voice %s failed: %s", vid, e)


__all__ = ["INTERNAL_ERROR", "Admission", "SentenceStream", "ServerBusyError", "Serving", "check_can_listen",
           "load_tts", "open_voice_store", "prepare", "report_voices",
           "choose_interleave", "warm_voices"]
