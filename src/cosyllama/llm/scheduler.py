"""Continuous batching: many requests decoded together in one LLM backend.

:class:`BatchScheduler` is a token source for :class:`cosyllama.tts.TTS` (``tts.token_source``).
One worker thread owns the backend. Requests join and leave between any two decode steps; each
step advances every active sequence in one ``backend.step`` call. Tokens reach each request
through its own blocking queue; nothing polls or sleeps.

Per-request rules (min/max length, stop ids, RAS or greedy, seeds) come from
:class:`~cosyllama.llm.decode.TokenDecoder`, the same object :func:`~cosyllama.llm.decode.generate`
uses, so a greedy request gives the same tokens batched as alone.

Prefill in pieces (every backend's ``begin`` and ``prefill_step``): a new request only reserves its
sequence when it is admitted; its prompt then runs ``prefill_chunk`` positions at a time, one piece
(of one prefilling request, in turn) between two decode steps of the others. A long prompt therefore
delays the others' steps by one piece at most, and a cancelled request stops between two pieces.

Failure isolation: an error in one request's prefill (``backend.begin`` /
``prefill_step``) or token choice fails only that request. An error raised by ``backend.step``
fails the requests of that step (the backend cannot say which sequence caused it, and may have
advanced some of them); the worker keeps serving the others.

Cancellation: closing a request's iterator releases its sequence before ``close()`` returns. A
:class:`~cosyllama.llm.decode.CancelToken` passed to ``generate`` (``cancel=``) lets another thread
(a server noticing a disconnected client) cancel the request without waiting for the consumer: its
sequence is freed at the next step and its iterator raises :class:`RequestCancelled`.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import weakref
from collections import deque
from collections.abc import Iterator

import torch

from ..defaults import INTERLEAVE_MODES, PREFILL_CHUNK
from ..errors import BackendBusyError, CosyllamaError
from ..openmp import hold_thread_team, release_thread_team
from .backend import LLMBackend, Prefill
from .decode import CancelToken, DecodeOptions, RequestCancelled, TokenDecoder

DEFAULT_MAX_ACTIVE = 8  # sequences decoded together when the backend has no slot count of its own
DEFAULT_MAX_WAITING = 64  # requests that may wait for a free sequence
# When decoding pauses for flow work (BatchScheduler.pause_for_flow): never, during the flow call that makes a streamed
# request's first audio, or during every flow call.


class SchedulerBusyError(CosyllamaError, RuntimeError):
    """The admission queue is full (or the scheduler is closed); retry later."""


_END = object()  # queue sentinel: decoding finished normally


class _Request:
    __slots__ = ("prefill", "decoder", "out", "handle", "next_tok", "prefilling", "cancelled", "finished",
                 "released")

    def __init__(self, prefill: Prefill, decoder: TokenDecoder):
        self.prefill = prefill
        self.decoder = decoder
        self.out: queue.SimpleQueue = queue.SimpleQueue()  # tokens, then _END or an exception
        self.handle: object | None = None
        self.next_tok: int | None = None  # token to feed at the next step
        self.prefilling = False  # begun; prompt pieces still to run
        self.cancelled = False
        self.finished = False  # no more output will be queued
        self.released = threading.Event()  # the backend sequence is gone (or never existed)


class BatchScheduler:
    """Token source that batches the decode steps of concurrent requests on one backend.

    ``max_active``: sequences decoded at once (default: the backend's ``n_seq_max`` if it has one,
    else :data:`DEFAULT_MAX_ACTIVE`). ``max_waiting``: requests that may wait for a free sequence;
    one more raises :class:`SchedulerBusyError`. A backend that refuses a start with
    ``BackendBusyError`` (KV memory full) makes the request wait until another one finishes.
    ``prefill_chunk``: prompt positions run between two decode steps .
    """

    def __init__(self, backend: LLMBackend, *, max_active: int | None = None,
                 max_waiting: int = DEFAULT_MAX_WAITING, prefill_chunk: int = PREFILL_CHUNK,
                 interleave: str = "off"):
        if max_active is None:
            max_active = int(backend.n_seq_max or DEFAULT_MAX_ACTIVE)
        if interleave not in INTERLEAVE_MODES:
            raise ValueError(f"interleave must be one of {', '.join(INTERLEAVE_MODES)}, got {interleave!r}")
        if max_active < 1 or max_waiting < 0 or prefill_chunk < 1:
            raise ValueError(f"max_active and prefill_chunk must be >= 1 and max_waiting >= 0, got {max_active}, "
                             f"{prefill_chunk}, {max_waiting}")
        self.backend = backend
        self.prefill_chunk = prefill_chunk
        self._turn = 0  # which prefilling request runs the next piece
        self.cfg = backend.cfg
        self.max_active = max_active
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._active: list[_Request] = []  # started, not yet released (worker-owned list)
        self._n_active = 0  # len(_active), readable under the lock by other threads
        self._wake = False  # a cancellation or admission the worker has not seen yet
        self._backend_full = False  # the backend refused a start; admit again after a release
        self._closed = False
        self.interleave = interleave
        self._flows = 0  # pause_for_flow()s held now that pause decoding
        # counters for /health and tests
        self.steps = 0
        self.tokens = 0
        self.prefill_pieces = 0
        self.max_batch = 0
        self.batch_hist: dict[int, int] = {}
        self._thread = threading.Thread(target=self._run, name="cosyllama-scheduler", daemon=True)
        self._thread.start()
        # A worker still inside llama.cpp when the interpreter exits aborts the process
        # ("terminate called without an active exception"); stop it first if nobody closed us.
        ref = weakref.ref(self)
        atexit.register(lambda: (s := ref()) is not None and s.close())

    # -- token-source API ---------------------------------------------------------------------

    def generate(self, prefill: Prefill, n_text_tokens: int, options: DecodeOptions = DecodeOptions(),
                 cancel: CancelToken | None = None) -> Iterator[int]:
        """Yield the speech tokens of one request (semantics of :func:`cosyllama.llm.decode.generate`).

        Option errors raise here; the request joins the batch when iteration starts. Closing the
        iterator frees its sequence before ``close()`` returns; ``cancel.cancel()`` (any thread)
        frees it at the next step and the iterator raises :class:`RequestCancelled`.
        """
        decoder = TokenDecoder(self.cfg, n_text_tokens, options)
        return self._tokens(_Request(prefill, decoder), cancel)

    def _tokens(self, req: _Request, token: CancelToken | None) -> Iterator[int]:
        detach = token.attach(lambda: self._cancel(req, wait=False)) if token is not None else None
        try:
            self._submit(req)
        except BaseException:
            if detach is not None:
                detach()
            raise
        try:
            while True:
                item = req.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if detach is not None:
                detach()
            self._cancel(req, wait=True)

    @contextlib.contextmanager
    def pause_for_flow(self, first: bool = False) -> Iterator[None]:
        """Held by a request's thread around its flow and vocoder work (``first``: the call that makes
        a streamed request's first audio). Where ``interleave`` says so ("all": every call; "first":
        first calls only) the worker takes no decode step and no prefill piece while it is held (it
        finishes the step it is in), so the two stages take turns on the cores instead of sharing them."""
        if self.interleave == "off" or (self.interleave == "first" and not first):
            yield
            return
        with self._cond:
            self._flows += 1
        try:
            yield
        finally:
            with self._cond:
                self._flows -= 1
                self._cond.notify_all()

    def stats(self) -> dict:
        """Active sequences, waiting requests and batching counters."""
        with self._cond:
            return {"active_sequences": self._n_active, "waiting": len(self._waiting),
                    "prefilling": sum(r.prefilling for r in self._active), "prefill_pieces": self.prefill_pieces,
                    "max_active": self.max_active, "max_waiting": self.max_waiting, "steps": self.steps,
                    "tokens": self.tokens, "max_batch": self.max_batch, "batch_sizes": dict(self.batch_hist),
                    "interleave": self.interleave}

    def close(self) -> None:
        """Fail the waiting and active requests, release their sequences and stop the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> BatchScheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- consumer side ------------------------------------------------------------------------

    def _submit(self, req: _Request) -> None:
        with self._cond:
            if self._closed:
                raise SchedulerBusyError("the scheduler is closed")
            free = max(0, self.max_active - self._n_active)
            if len(self._waiting) - free >= self.max_waiting:
                raise SchedulerBusyError(f"{self._n_active} requests are decoding and {len(self._waiting)} are "
                                         f"waiting (limit {self.max_waiting}); retry later")
            self._waiting.append(req)
            self._wake = True
            self._cond.notify()

    def _cancel(self, req: _Request, wait: bool) -> None:
        with self._cond:
            if req.finished and req.released.is_set():
                return
            if req.handle is None and req in self._waiting:
                self._waiting.remove(req)
                self._finish(req, RequestCancelled("the request was cancelled"))
                req.released.set()
                return
            req.cancelled = True
            self._wake = True
            self._cond.notify()
        if wait and threading.current_thread() is not self._thread:
            req.released.wait()

    # -- worker ---------------------------------------------------------------------------------

    @staticmethod
    def _finish(req: _Request, outcome: object = _END) -> None:
        if not req.finished:
            req.finished = True
            req.out.put(outcome)

    def _release(self, req: _Request) -> None:
        try:
            if req.handle is not None:
                self.backend.release(req.handle)
        finally:
            with self._cond:
                if req in self._active:
                    self._active.remove(req)
                    self._n_active = len(self._active)
                    self._backend_full = False
                    if self._waiting:
                        self._wake = True
            req.released.set()

    def _run(self) -> None:
        try:
            while self._loop_once():
                pass
        finally:
            with self._cond:
                self._closed = True
                doomed = list(self._waiting) + list(self._active)
                self._waiting.clear()
            for req in doomed:
                self._finish(req, SchedulerBusyError("the scheduler was closed"))
                try:
                    self._release(req)
                except Exception:  # keep releasing the others; the backend is going away anyway
                    req.released.set()

    def _loop_once(self) -> bool:
        with self._cond:
            waited = False  # it gave its OpenMP team back first (cosyllama.openmp)
            while not self._closed and not self._wake and not any(r.next_tok is not None or r.prefilling
                                                                  for r in self._active):
                self._idle_wait()
                waited = True
            while self._flows and not self._closed:  # interleave: a flow call has the cores
                self._idle_wait()
                waited = True
            if self._closed:
                return False
            self._wake = False
            cancelled = [r for r in self._active if r.cancelled]
            admitted = []
            while (self._waiting and (not self._backend_full or cancelled)
                   and len(self._active) + len(admitted) - len(cancelled) < self.max_active):
                admitted.append(self._waiting.popleft())
        for req in cancelled:
            self._finish(req, RequestCancelled("the request was cancelled"))
            self._release(req)
        for i, req in enumerate(admitted):
            if not self._start(req):
                with self._cond:  # keep arrival order for the ones not tried yet
                    self._waiting.extendleft(reversed(admitted[i + 1:]))
                break
        filling = [r for r in self._active if r.prefilling and not r.cancelled]
        live = [r for r in self._active if r.next_tok is not None and not r.cancelled]
        if waited and (filling or live):
            hold_thread_team()  # decoding again, maybe beside flow calls: their workers must not spin
        if filling:
            self._turn = (self._turn + 1) % len(filling)
            self._prefill_piece(filling[self._turn])
            live = [r for r in self._active if r.next_tok is not None and not r.cancelled]
        if live:
            self._step(live)
        return True

    def _idle_wait(self) -> None:
        """Wait on the condition (held), this thread's OpenMP team given back first: while it waits, flow
        calls on other threads run alone, and libgomp lets their workers spin between regions only while
        its teams do not outnumber the cores (:mod:`cosyllama.openmp`)."""
        release_thread_team()
        self._cond.wait()

    def _start(self, req: _Request) -> bool:
        """Begin one request: its sequence reserved, its prompt to run in pieces. False when the
        backend is full (the request waits again)."""
        if req.cancelled:
            self._finish(req, RequestCancelled("the request was cancelled"))
            req.released.set()
            return True
        try:
            handle = self.backend.begin(req.prefill, req.decoder.max_len)
        except BackendBusyError as e:
            with self._cond:
                if self._active:  # room comes back when one of them finishes
                    self._waiting.appendleft(req)
                    self._backend_full = True
                    return False
            self._finish(req, e)
            req.released.set()
            return True
        except Exception as e:
            self._finish(req, e)
            req.released.set()
            return True
        req.handle = handle
        req.prefilling = True
        with self._cond:
            self._active.append(req)
            self._n_active = len(self._active)
        return True

    def _prefill_piece(self, req: _Request) -> None:
        """Run the next piece of one request's prompt; once it is all in, choose its first token."""
        try:
            logp = self.backend.prefill_step(req.handle, self.prefill_chunk)
        except Exception as e:
            self._finish(req, e)
            self._release(req)
            return
        with self._cond:
            self.prefill_pieces += 1
        if logp is not None:
            req.prefilling = False
            self._advance(req, logp)

    def _step(self, live: list[_Request]) -> None:
        batch = [(r.handle, r.next_tok) for r in live]
        for r in live:
            r.next_tok = None
        try:
            outs = self.backend.step(batch)
            if len(outs) != len(live):
                raise RuntimeError(f"backend.step returned {len(outs)} results for {len(live)} sequences")
        except Exception as e:
            for r in live:
                self._finish(r, e)
                self._release(r)
            return
        with self._cond:
            self.steps += 1
            self.max_batch = max(self.max_batch, len(live))
            self.batch_hist[len(live)] = self.batch_hist.get(len(live), 0) + 1
        for r, logp in zip(live, outs):
            self._advance(r, logp)

    def _advance(self, req: _Request, logp: torch.Tensor) -> None:
        """Choose the request's next token; hand it out and queue it for the next step, or finish."""
        if req.cancelled:
            return  # released at the top of the next loop
        try:
            tok = req.decoder.choose(logp)
        except Exception as e:
            self._finish(req, e)
            self._release(req)
            return
        if tok is None:
            self._finish(req)
            self._release(req)
            return
        self.tokens += 1
        req.out.put(tok)
        if req.decoder.done:  # max_len reached: no forward for a token nobody will read
            self._finish(req)
            self._release(req)
        else:
            req.next_tok = tok


__all__ = ["BatchScheduler", "CancelToken", "RequestCancelled", "SchedulerBusyError"]
