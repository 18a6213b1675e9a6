"""The serving core every door shares: :class:`Serving`, built once by :func:`prepare` from loaded
:class:`~cosyllama.models.Models` and a typed :class:`~cosyllama.server.options.ServingOptions`.

It holds the served pipeline (a :class:`~cosyllama.tts.TTS` over the models whose tokens come from one
batching scheduler, whose calls are checked against the limits, whose voices are the server's and
whose long texts normalize in a helper process), the scheduler, the admission gate
(:class:`~cosyllama.server.admission.Admission`), the threads model code runs in, and the options.
``POST /v1/audio/speech`` runs one :class:`~cosyllama.server.job.SynthesisJob` per request through it;
the WebSocket endpoint and the Wyoming server run :class:`~cosyllama.server.session.Session` over it.
One process serving both protocols (``serve --wyoming``) has one :class:`Serving`, so one gate. It knows the
streamed sessions open on it (:attr:`Serving.sessions`), so a stopping process stops every door's work in one
place (:meth:`Serving.stop_taking_work`, :meth:`Serving.cut`; :mod:`cosyllama.server.shutdown`).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from ..llm.factory import make_token_source
from ..llm.scheduler import DEFAULT_MAX_ACTIVE, DEFAULT_MAX_WAITING, BatchScheduler
from ..openmp import gives_team_back, release_thread_team
from ..voice_directory import ClipEncoder
from ..voices import VoiceStore
from .admission import Admission
from .options import ServingOptions
from .startup import report_voices

log = logging.getLogger("cosyllama.server")

EXTRA_THREADS = 2  # model-code threads beyond max_concurrent (voice lookups, the info of a describe)


class Serving:
    """What a server runs requests with (see the module docstring). ``tts``: the served pipeline;
    ``scheduler``: the :class:`BatchScheduler` every request decodes through, closed by :meth:`close`
    when ``owns_scheduler`` (made by :func:`prepare`); ``max_concurrent`` running plus ``max_queue``
    waiting requests (the gate's bounds); ``limits``: each request's bounds."""

    def __init__(self, models, tts, scheduler: BatchScheduler, options: ServingOptions, max_concurrent: int,
                 owns_scheduler: bool):
        self.models, self.tts, self.scheduler, self.options = models, tts, scheduler, options
        self.max_concurrent, self.max_queue = max_concurrent, options.max_queue
        self.limits = options.limits
        self.owns_scheduler = owns_scheduler
        self.executor = ThreadPoolExecutor(max_concurrent + EXTRA_THREADS, thread_name_prefix="cosyllama-serve")
        self._gate = Admission(max_concurrent, self.max_queue)
        self._gate_loop = None  # the event loop the gate belongs to, once used
        self.sessions: set = set()  # the streamed sessions open now (cosyllama.server.session.Session)
        self.stopping = False  # stop_taking_work() came

    @property
    def voices(self) -> VoiceStore:
        return self.tts.voices

    def admission(self) -> Admission:
        """The gate, which belongs to the running event loop that first uses it (an app started again in
        another loop gets a new one)."""
        loop = asyncio.get_running_loop()
        if self._gate_loop is None:
            self._gate_loop = loop
        elif self._gate_loop is not loop:
            self._gate, self._gate_loop = Admission(self.max_concurrent, self.max_queue), loop
        return self._gate

    @property
    def gate(self) -> Admission:
        """The gate (for reports and tests)."""
        return self._gate

    def stop_taking_work(self) -> None:
        """The server stops: the gate admits nothing more (what waits for a slot and what comes is refused:
        HTTP 503, WebSocket 1013, Wyoming ``busy``), and every session takes no new utterance and ends once
        its work is spoken (:meth:`~cosyllama.server.session.Session.stop`). Call it in the serving's loop."""
        self.stopping = True
        self.admission().close("the server is stopping; retry in a moment (another server may answer)")
        for session in list(self.sessions):
            session.stop()

    def busy(self) -> bool:
        """Work runs or waits: a request holds or waits for a slot, or a session is open."""
        return bool(self.sessions) or self._gate.running > 0 or self._gate.waiting > 0

    def cut(self) -> None:
        """End every session now (the end of a stopping server's drain)."""
        for session in list(self.sessions):
            session.cut()

    async def call(self, fn, *args):
        """``fn(*args)`` in the threads that run model code (never the event loop); the thread gives its
        OpenMP workers back afterwards (:mod:`cosyllama.openmp`), so that an idle thread's team does not
        slow the next call on another."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, gives_team_back(fn), *args)

    def close(self) -> None:
        """Stop the model threads and the text helper process, and the scheduler when :func:`prepare` made it."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.tts.close()
        if self.owns_scheduler:
            self.scheduler.close()


def prepare(models, options: ServingOptions, *, voices: VoiceStore | None = None,
            scheduler: BatchScheduler | None = None) -> Serving:
    """The :class:`Serving` of ``models`` (a :class:`~cosyllama.models.Models`, shared and left as it is):
    its requests decode through ``scheduler`` when given (its maker closes it; it must let
    ``max_concurrent`` requests wait), else through one made here over ``models.llm`` (prefilling
    ``options.prefill_chunk`` positions between two decode steps, pausing for flow work as
    ``options.interleave`` says; closed by :meth:`Serving.close`); they speak with the voices of
    ``voices`` (default: a new store in memory), whose folders are made into voices here; every request
    speaks ``options.lexicon``'s words as their tokens (checked here against the model's vocabulary)."""
    from ..tts import TTS

    limits = options.limits
    owns_scheduler = scheduler is None
    max_concurrent = options.max_concurrent
    if max_concurrent is None:
        max_concurrent = 2 * (int(models.llm.n_seq_max or DEFAULT_MAX_ACTIVE) if owns_scheduler
                              else scheduler.max_active)
    llm_budget = models.llm.max_seq_tokens
    if llm_budget is not None and llm_budget < limits.seq_tokens:
        raise ValueError(f"the LLM holds {llm_budget} positions per sequence, fewer than limits.seq_tokens "
                         f"({limits.seq_tokens}); lower the limit or load the LLM with max_seq_tokens >= it")
    if owns_scheduler:
        interleave = options.interleave
        if interleave is None:
            interleave, why = choose_interleave(models)
            log.warning("scheduler: %s (--interleave)", why)  # start-up facts go out at warning, as the voices line
        scheduler = make_token_source(models.llm, batched=True, max_waiting=max(DEFAULT_MAX_WAITING, max_concurrent),
                                      prefill_chunk=options.prefill_chunk, interleave=interleave)
    elif scheduler.max_waiting < max_concurrent:
        raise ValueError(f"the scheduler lets {scheduler.max_waiting} requests wait, fewer than max_concurrent "
                         f"({max_concurrent}); make it with max_waiting >= {max_concurrent}")
    # long texts normalize beside, not in, the event loop
    if options.lexicon is not None:  # loaded before the model: its tokens against this model's vocabulary now
        options.lexicon.check(models.frontend.tokenizer)
    served = TTS.from_models(models, token_source=scheduler, limits=limits,
                             voices=VoiceStore() if voices is None else voices, text_worker=True,
                             lexicon=options.lexicon)
    served.voices.set_encoder(ClipEncoder.of(served))  # voice folders: made now (within the limits)
    report_voices(served.voices)
    if owns_scheduler:
        from ..engine import schedule_line

        log.warning("%s", schedule_line(options.defaults.first_chunk_tokens))  # beside the CPU line
    # the model code runs on the serving's threads from now on: this thread's OpenMP team (the loading's,
    # the voice folders') would slow their flow calls (cosyllama.openmp)
    release_thread_team()
    return Serving(models, served, scheduler, options, max_concurrent, owns_scheduler)


def choose_interleave(models) -> tuple[str, str]:
    """:func:`cosyllama.cpu.interleave_stages` for loaded models (or a TTS): their LLM's threads
    (llama.cpp's own count; the torch LLM shares PyTorch's) and PyTorch's."""
    import torch

    from ..cpu import interleave_stages

    flow_threads = torch.get_num_threads()
    llm_threads = int(models.llm.n_threads or flow_threads)
    return interleave_stages(llm_threads, flow_threads, torch.device(models.device).type)


__all__ = ["Serving", "choose_interleave", "prepare"]
