"""The decoding loop: length limits, stop rule and sampling around any :class:`LLMBackend`.

Rules (see docs/reference.md#length-limits and docs/design.md#sampling-rules):

* ``min_len = int(2 * n_text)``, ``max_len = int(20 * n_text)`` with ``n_text`` the number of
  target-text tokens (prompt/instruct text excluded).
* While fewer than ``min_len`` tokens are out, ALL special ids (6561..6760) are masked. This
  deliberately fixes upstream's min_len mask, where only id 6561 was masked (see docs/reference.md#q1-min_len-mask
  and docs/reference.md#full-min-length-mask).
* Any special id ends decoding and is not emitted; at most ``max_len`` tokens are emitted.

The per-request policy lives in :class:`TokenDecoder` so that a scheduler can advance many
requests in one backend batch (the server's scheduler) with the same rules as :func:`generate`.

A *token source* (:class:`TokenSource`) is what a synthesis pipeline decodes through:
:class:`DirectTokens` decodes each request on its own (the Python API's default),
:class:`~cosyllama.llm.scheduler.BatchScheduler` advances concurrent requests in one backend step (the
servers' and batch's). Both take a :class:`CancelToken` as an argument of ``generate``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..config import LLMConfig
from ..errors import CosyllamaError, InputError
from .backend import LLMBackend, Prefill
from .sampling import Sampler

MIN_LEN_RATIO = 2  # speech tokens per target-text token, lower bound
MAX_LEN_RATIO = 20  # upper bound


@dataclass(frozen=True)
class DecodeOptions:
    """How one request chooses its tokens.

    greedy: argmax instead of RAS (deterministic; parity tests). seed: RAS generator seed
    (None = fresh entropy). min_len/max_len: override the text-derived limits.
    ignore_stop: mask the stop ids at every step so exactly ``max_len`` tokens come out
    (benchmarks compare equal work this way).
    """

    greedy: bool = False
    seed: int | None = None
    min_len: int | None = None
    max_len: int | None = None
    ignore_stop: bool = False


class RequestCancelled(CosyllamaError, RuntimeError):
    """The request was cancelled through its :class:`CancelToken`."""


class CancelToken:
    """Cancels the requests it is passed to (``token_source.generate(..., cancel=token)``), from any
    thread: their sequences are freed at the next decode step and their iterators raise
    :class:`RequestCancelled`. A request given a token already cancelled raises at once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cancelled = False
        self._hooks: dict[int, Callable[[], None]] = {}
        self._next = 0

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Cancel the token's requests; returns at once (their token source frees the sequences)."""
        with self._lock:
            self._cancelled = True
            hooks, self._hooks = list(self._hooks.values()), {}
        for hook in hooks:
            hook()

    def attach(self, on_cancel: Callable[[], None]) -> Callable[[], None]:
        """Call ``on_cancel`` (from the cancelling thread) when the token is cancelled; returns the
        function that detaches it again (a finished request). Raises :class:`RequestCancelled` when
        the token is cancelled already."""
        with self._lock:
            if self._cancelled:
                raise RequestCancelled("the request was cancelled")
            key, self._next = self._next, self._next + 1
            self._hooks[key] = on_cancel

        def detach() -> None:
            with self._lock:
                self._hooks.pop(key, None)
        return detach

    def check(self) -> None:
        """Raise :class:`RequestCancelled` if the token is cancelled."""
        if self._cancelled:
            raise RequestCancelled("the request was cancelled")


class TokenDecoder:
    """Per-request decoding state: emitted tokens, limits, sampler."""

    def __init__(self, cfg: LLMConfig, n_text_tokens: int, options: DecodeOptions = DecodeOptions()):
        if n_text_tokens < 1 and (options.max_len is None):
            raise InputError("the target text has no tokens; give some text to speak")
        self.cfg = cfg
        self.min_len = int(MIN_LEN_RATIO * n_text_tokens) if options.min_len is None else int(options.min_len)
        self.max_len = int(MAX_LEN_RATIO * n_text_tokens) if options.max_len is None else int(options.max_len)
        if self.max_len < 1 or self.min_len < 0:
            raise InputError(f"max_len must be >= 1 and min_len >= 0, got max_len={self.max_len}, "
                             f"min_len={self.min_len}")
        self.ignore_stop = options.ignore_stop
        self.sampler = Sampler(cfg.sampling, greedy=options.greedy, seed=options.seed)
        self.tokens: list[int] = []
        self.stop_id: int | None = None  # the special id that ended decoding, if any
        self.done = False

    def choose(self, logp: torch.Tensor) -> int | None:
        """Pick the next token from log-probs (vocab,), or return None when decoding has ended."""
        if self.done:
            return None
        if self.ignore_stop or len(self.tokens) < self.min_len:
            logp = logp.clone()
            logp[self.cfg.speech_token_size:] = float("-inf")
        tok = self.sampler(logp, self.tokens)
        if tok >= self.cfg.speech_token_size:
            self.stop_id, self.done = tok, True
            return None
        self.tokens.append(tok)
        if len(self.tokens) >= self.max_len:
            self.done = True
        return tok


def generate(backend: LLMBackend, prefill: Prefill, n_text_tokens: int,
             options: DecodeOptions = DecodeOptions(), cancel: CancelToken | None = None) -> Iterator[int]:
    """Yield speech tokens of one request as they are decoded. Releases the sequence when the
    generator finishes or is closed (a cancelled request frees its KV memory at once). ``cancel``:
    checked before the prefill and before each decode step (:class:`RequestCancelled`)."""
    dec = TokenDecoder(backend.cfg, n_text_tokens, options)
    if cancel is not None:
        cancel.check()
    handle, logp = backend.start(prefill, dec.max_len)
    try:
        while True:
            tok = dec.choose(logp)
            if tok is None:
                return
            yield tok
            if dec.done:  # max_len reached: no forward for a token nobody will read
                return
            if cancel is not None:
                cancel.check()
            (logp,) = backend.step([(handle, tok)])
    finally:
        backend.release(handle)


# Silence/breath speech codes (see docs/reference.md#silent-token-filter); fixed by the reference, not in the
# model files.
SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
MAX_SILENT_RUN = 5


class SilentTokenFilter:
    """Drops the 6th and later consecutive silent tokens before they reach the flow (see
    docs/reference.md#silent-token-filter). The LLM itself still conditions on them; this only filters what is
    passed on."""

    def __init__(self):
        self.run = 0

    def keep(self, tok: int) -> bool:
        if tok in SILENT_TOKENS:
            self.run += 1
            return self.run <= MAX_SILENT_RUN
        self.run = 0
        return True

    def filter(self, tokens: Sequence[int]) -> list[int]:
        return [t for t in tokens if self.keep(t)]


@runtime_checkable
class TokenSource(Protocol):
    """Where a synthesis pipeline gets its speech tokens (:class:`DirectTokens`,
    :class:`~cosyllama.llm.scheduler.BatchScheduler`)."""

    def generate(self, prefill: Prefill, n_text_tokens: int, options: DecodeOptions,
                 cancel: CancelToken | None = None) -> Iterator[int]:
        """The speech tokens of one request, with the semantics of :func:`generate`: closing the
        iterator frees the sequence; ``cancel`` stops it from any thread (:class:`RequestCancelled`)."""
        ...

    def pause_for_flow(self, first: bool = False) -> AbstractContextManager[None]:
        """Held by the pipeline around each flow + vocoder call (``first``: the call that makes a
        streamed request's first audio); a source may pause its decoding meanwhile."""
        ...

    def close(self) -> None:
        """Stop; requests in flight fail."""
        ...


class DirectTokens:
    """Token source that decodes each request on its own (the Python API's default); it never
    pauses for flow work and holds nothing to close. The servers use a batching scheduler instead,
    which advances many requests in one backend step."""

    def __init__(self, backend: LLMBackend):
        self.backend = backend

    def generate(self, prefill: Prefill, n_text_tokens: int, options: DecodeOptions,
                 cancel: CancelToken | None = None) -> Iterator[int]:
        return generate(self.backend, prefill, n_text_tokens, options, cancel)

    def pause_for_flow(self, first: bool = False) -> AbstractContextManager[None]:
        return nullcontext()

    def close(self) -> None:
        pass
