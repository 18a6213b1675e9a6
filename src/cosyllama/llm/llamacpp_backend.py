"""The speech-token LLM on llama.cpp (llama-cpp-python's low-level API), behind :class:`LLMBackend`.

One llama.cpp model and one context serve every request. Each request (a *sequence*) takes a
sequence id from a pool of ``n_seq_max`` ids and its KV cells from a unified pool; :meth:`step`
advances all listed sequences in one ``llama_decode``; :meth:`release` removes the sequence's
cells at once. The only lock guards each ``llama_decode`` plus the read of its logits (the logits
buffer belongs to the context and is overwritten by the next decode) and the small bookkeeping of
ids and cells; nothing is held across a generation.

Only the last position of each sequence produces logits; only its 6761 speech logits are read and
turned into log-probabilities here. Sampling is the shared sampler's job, never llama.cpp's.

``llama_cpp`` is imported lazily (:mod:`cosyllama.llm.llamacpp_lib`), so ``import cosyllama`` works without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import ModelConfig
from ..cpu import llama_extra_buffer_types, llama_flash_attention
from ..defaults import LLM_WEIGHTS, N_SEQ_MAX
from ..errors import BackendBusyError, CheckpointError, DeviceError, InputError
from ..weights import load_llm_weights
from .backend import Prefill, check_max_seq_tokens
from .gguf_read import inspect_gguf, llm_fingerprint
from .llamacpp_lib import INSTALL_HINT, import_llama_cpp, llama_log_handler, openmp_serving_hint, set_llama_verbose
from .load_threads import LoadThreads

DEFAULT_N_SEQ_MAX = N_SEQ_MAX  # concurrent sequences one context holds
DEFAULT_N_BATCH = 512  # positions per llama_decode call (longer prefills are split)
MIN_CELLS_PER_SEQ = 1024  # lazily sized contexts reserve at least this many KV cells per sequence
_CELL_ROUND = 256

KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")

# ----------------------------------------------------------------------------------------------
# Sequences


@dataclass(eq=False)
class LlamaSequence:
    """Handle of one request's sequence. Opaque to callers; ``seq_id`` is for tests/diagnostics."""

    seq_id: int
    n_past: int  # positions already in the KV cache
    capacity: int  # positions reserved for it (prefill + max_new_tokens)
    released: bool = field(default=False)
    n_prompt: int = 0  # prefill positions
    # the prefill inputs (token ids or embedding rows) while the prompt is not all in; then None
    pending: np.ndarray | None = field(default=None, repr=False)


class _Batch:
    """A ``llama_batch`` over numpy buffers (kept alive with the struct until the decode returns)."""

    def __init__(self, lc, pos: np.ndarray, seq: np.ndarray, logits: np.ndarray,
                 tokens: np.ndarray | None = None, embd: np.ndarray | None = None):
        n = len(pos)
        self.pos = np.ascontiguousarray(pos, dtype=np.int32)
        self.seq = np.ascontiguousarray(seq, dtype=np.int32)
        self.n_seq = np.ones(n, dtype=np.int32)
        self.logits = np.ascontiguousarray(logits, dtype=np.int8)
        self.seq_ptrs = (self.seq.ctypes.data + 4 * np.arange(n, dtype=np.uintp)).astype(np.uintp)
        b = lc.llama_batch()
        b.n_tokens = n
        if tokens is not None:
            self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
            b.token = self.tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        else:
            self.embd = np.ascontiguousarray(embd, dtype=np.float32)
            b.embd = self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.n_seq_id = self.n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = self.seq_ptrs.ctypes.data_as(ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.struct = b


# ----------------------------------------------------------------------------------------------
# The backend


class LlamaCppLLM:
    """The CosyVoice3 speech LLM from a GGUF (either layout), implementing :class:`LLMBackend`.

    ``gguf_path``: a file from :func:`cosyllama.llm.gguf.convert` or a published merged-layout GGUF.
    ``config``: the :class:`ModelConfig` of the official model directory it belongs to (read once by the
    caller, :func:`cosyllama.config.load_config`); ``llm_weights`` there, default ``llm.pt``, gives the
    prompt's text embedding rows in the speech layout and the fingerprint check (the GGUF must have been
    converted from that file).
    ``n_threads``: CPU threads (default: all available). ``n_gpu_layers``: layers offloaded to a GPU
    (a build without GPU support refuses values > 0). ``max_seq_tokens``: positions one sequence may
    use (prompt + new tokens; default: the model's context length); a request needing more is
    refused with :class:`InputError`. ``n_ctx``: KV cells shared by all sequences; ``None`` sizes
    the context from the first request (at least ``MIN_CELLS_PER_SEQ`` per sequence) and grows it
    when an idle context meets a longer request, to at most ``n_seq_max`` × ``max_seq_tokens``
    (rounded up to 256). ``n_seq_max``: concurrent sequences.
    ``kv_type``: KV cache type, one of :data:`KV_TYPES`; default ``f32`` for an all-F32 GGUF (exact
    parity with torch) and ``f16`` otherwise. ``flash_attn``: ``None`` = off with an F32 KV cache
    (its CPU kernel works in F16), off on the AMX class (decodes ~12 % faster there:
    :func:`cosyllama.cpu.llama_flash_attention`), else llama.cpp decides.
    ``layout``: refuse files of the other layout. ``verbose``: show llama.cpp's log.
    """

    name = "llamacpp"

    def __init__(self, gguf_path: str | os.PathLike, config: ModelConfig,
                 n_threads: int | None = None, n_gpu_layers: int = 0, n_ctx: int | None = None, *,
                 n_seq_max: int = DEFAULT_N_SEQ_MAX, n_batch: int = DEFAULT_N_BATCH, kv_type: str | None = None,
                 flash_attn: bool | None = None, layout: str | None = None, verbose: bool = False,
                 llm_weights: str | os.PathLike = LLM_WEIGHTS, max_seq_tokens: int | None = None):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig (cosyllama.config.load_config), got {type(config).__name__}")
        self.cfg = config.llm  # the LLMConfig, as every backend names it (LLMBackend.cfg)
        self.vocab_size = self.cfg.vocab_size
        weights_path = config.llm_weights_path(llm_weights)
        weights = load_llm_weights(weights_path, self.cfg)
        self.info = inspect_gguf(gguf_path, self.cfg, layout=layout,
                                 fingerprint=llm_fingerprint(weights, self.cfg.qwen.num_hidden_layers),
                                 weights_name=weights_path.name)
        self.layout = self.info.layout
        # Memory-mapped rows for prompts submitted as embeddings (speech layout).
        self._text_rows = weights["embed_tokens.weight"]
        self._speech_rows = weights["speech_embedding.weight"]
        del weights

        if n_seq_max < 1:
            raise InputError(f"n_seq_max must be >= 1, got {n_seq_max}")
        if n_batch < 1:
            raise InputError(f"n_batch must be >= 1, got {n_batch}")
        self.max_seq_tokens = check_max_seq_tokens(max_seq_tokens, self.cfg)
        kv = kv_type.lower() if kv_type is not None else ("f32" if self.info.all_f32 else "f16")
        if kv not in KV_TYPES:
            raise InputError(f"unknown kv_type {kv_type!r}; allowed: {', '.join(KV_TYPES)}")
        self.kv_type = kv
        self.n_threads = int(n_threads) if n_threads else len(os.sched_getaffinity(0))
        # The threads each decode runs with: n_threads, fewer while other processes hold this process's cores
        # (load_threads.py says why a busy core stalls a multi-threaded decode).
        self.load_threads = LoadThreads(self.n_threads)
        self._ctx_threads = self.n_threads
        self.n_seq_max = int(n_seq_max)
        self.n_batch = max(int(n_batch), self.n_seq_max)
        self._fixed_n_ctx = n_ctx
        # llama.cpp's CPU flash attention rounds Q/K/V through F16 (measured: 4e-3 in log-probs), so an
        # F32 KV cache only gives F32 parity with flash attention off.
        if flash_attn is None:  # off with an F32 cache (parity), else as decodes fastest on this CPU class
            flash_attn = False if kv == "f32" else llama_flash_attention()
        self.flash_attn = flash_attn

        set_llama_verbose(verbose)
        lc = self._lc = import_llama_cpp()
        self.n_seq_max = min(self.n_seq_max, int(lc.llama_max_parallel_sequences()))
        if n_gpu_layers and not lc.llama_supports_gpu_offload():
            raise DeviceError(f"n_gpu_layers={n_gpu_layers} was asked for, but this llama-cpp-python build has "
                              "no GPU support; use n_gpu_layers=0 or reinstall llama-cpp-python with CUDA")
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = int(n_gpu_layers)
        # Never the AMX buffer type where its kernels crash (cpu.llama_extra_buffer_types says why).
        self.extra_buffer_types, self.extra_buffer_types_why = llama_extra_buffer_types()
        mparams.use_extra_bufts = self.extra_buffer_types
        self._model = lc.llama_model_load_from_file(str(self.info.path).encode(), mparams)
        if not self._model:
            raise CheckpointError(f"llama.cpp could not load {self.info.path} (run with verbose=True for its log)")
        self.n_vocab_gguf = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model)))
        if self.n_vocab_gguf != self.info.n_vocab:
            raise CheckpointError(f"llama.cpp reads {self.n_vocab_gguf} tokens from {self.info.path}, "
                                  f"expected {self.info.n_vocab}")

        self._lock = threading.Lock()
        self._ctx = None
        self._mem = None
        self.n_ctx = 0
        self._free_ids = list(range(self.n_seq_max))
        self._active: set[LlamaSequence] = set()
        self._reserved = 0
        if n_ctx is not None:
            self._make_context(int(n_ctx))

    # -- context -------------------------------------------------------------------------------

    def _make_context(self, n_ctx: int) -> None:
        lc = self._lc
        if self._ctx is not None:
            lc.llama_free(self._ctx)
            self._ctx = None
        p = lc.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = p.n_ubatch = self.n_batch
        p.n_seq_max = self.n_seq_max
        p.n_threads = p.n_threads_batch = self._ctx_threads = self.load_threads.threads
        p.kv_unified = True  # one cell pool: a long request may use what short ones leave free
        p.type_k = p.type_v = getattr(lc, f"GGML_TYPE_{self.kv_type.upper()}")
        p.flash_attn_type = (lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
                             if self.flash_attn is not None else lc.LLAMA_FLASH_ATTN_TYPE_AUTO)
        p.no_perf = True
        ctx = lc.llama_init_from_model(self._model, p)
        if not ctx:
            raise CheckpointError(f"llama.cpp could not create a context of {n_ctx} cells for {self.info.path} "
                                  f"(kv_type={self.kv_type}, n_seq_max={self.n_seq_max})")
        self._ctx = ctx
        self._mem = lc.llama_get_memory(ctx)
        self.n_ctx = int(lc.llama_n_ctx(ctx))

    def _reserve(self, need: int) -> int:
        """Take a sequence id and ``need`` cells (lock held); grow an idle lazily-sized context (a
        request over ``max_seq_tokens`` is refused first, so the context stays within
        ``n_seq_max`` × ``max_seq_tokens``)."""
        if need > self.max_seq_tokens:
            raise InputError(f"this request needs {need} LLM positions (prompt + max_new_tokens); one sequence "
                             f"may use at most max_seq_tokens={self.max_seq_tokens}")
        if not self._free_ids:
            raise BackendBusyError(f"all {self.n_seq_max} llama.cpp sequences are in use; release one "
                                   "or create the backend with a larger n_seq_max")
        if self._reserved + need > self.n_ctx:
            if self._fixed_n_ctx is not None:
                if need > self.n_ctx:
                    raise InputError(f"this request needs {need} KV cells (prompt + max_new_tokens), "
                                     f"more than the context's n_ctx={self.n_ctx}")
                raise BackendBusyError(f"the llama.cpp context has {self.n_ctx - self._reserved} free KV cells, "
                                       f"this request needs {need}; retry when another request finishes")
            if self._active:
                if need > self.n_ctx:
                    raise BackendBusyError(f"this request needs {need} KV cells; the context ({self.n_ctx}) can "
                                           "only grow while no other request is running")
                raise BackendBusyError(f"the llama.cpp context has {self.n_ctx - self._reserved} free KV cells, "
                                       f"this request needs {need}; retry when another request finishes")
            per_seq = max(MIN_CELLS_PER_SEQ, -(-need // _CELL_ROUND) * _CELL_ROUND)
            self._make_context(per_seq * self.n_seq_max)
        self._reserved += need
        return self._free_ids.pop(0)

    # -- protocol ------------------------------------------------------------------------------

    def _prefill_inputs(self, prefill: Prefill) -> tuple[np.ndarray | None, np.ndarray | None]:
        """``(tokens, None)`` for the merged layout, ``(None, embeddings)`` for the speech layout."""
        cfg, n_text = self.cfg, self.cfg.qwen.vocab_size
        text = list(prefill.text_ids)
        speech = list(prefill.prompt_speech_tokens)
        bad = [t for t in text if not 0 <= t < n_text]
        if bad:
            raise InputError(f"text ids {bad[:5]} are outside the text vocabulary 0..{n_text - 1}")
        bad = [t for t in speech if not 0 <= t < cfg.speech_token_size]
        if bad:
            raise InputError(f"prompt speech tokens {bad[:5]} are outside 0..{cfg.speech_token_size - 1}")
        if self.layout == "merged":
            ids = [n_text + cfg.sos, *text, n_text + cfg.task_id, *(n_text + t for t in speech)]
            return np.asarray(ids, dtype=np.int32), None
        rows = self._speech_rows
        parts = [rows[cfg.sos:cfg.sos + 1]]
        if text:
            parts.append(self._text_rows[torch.tensor(text, dtype=torch.long)])
        parts.append(rows[cfg.task_id:cfg.task_id + 1])
        if speech:
            parts.append(rows[torch.tensor(speech, dtype=torch.long)])
        return None, torch.cat(parts).to(torch.float32).numpy()

    def _decode(self, batch: _Batch) -> None:
        self._ctx_threads = self.load_threads.apply(self._lc, self._ctx, self._ctx_threads)
        rc = self._lc.llama_decode(self._ctx, batch.struct)
        if rc != 0:
            why = {1: "no free KV cells", 2: "aborted"}.get(rc, "invalid batch or internal error")
            raise RuntimeError(f"llama_decode failed with code {rc} ({why})")

    def _logp(self, i: int) -> torch.Tensor:
        """log_softmax over the speech logits of output position ``i`` of the last decode."""
        ptr = self._lc.llama_get_logits_ith(self._ctx, i)
        if not ptr:
            raise RuntimeError(f"llama.cpp returned no logits for batch position {i}")
        row = np.ctypeslib.as_array(ptr, shape=(self.n_vocab_gguf,))
        off = self.info.speech_offset
        logits = torch.from_numpy(row[off:off + self.vocab_size].copy())
        return torch.log_softmax(logits, dim=-1)

    def begin(self, prefill: Prefill, max_new_tokens: int) -> LlamaSequence:
        """Reserve a sequence for ``prefill`` and ``max_new_tokens``; its prompt runs in
        :meth:`prefill_step` pieces."""
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        tokens, embd = self._prefill_inputs(prefill)
        n = len(prefill)
        need = n + int(max_new_tokens)
        with self._lock:
            seq = LlamaSequence(self._reserve(need), 0, need, n_prompt=n, pending=tokens if embd is None else embd)
            self._active.add(seq)
        return seq

    def prefill_step(self, seq: LlamaSequence, max_positions: int) -> torch.Tensor | None:
        """Decode the next ``max_positions`` (at most ``n_batch``) prompt positions of ``seq``; the
        logp (6761,) of its first new token once the prompt is complete, else None."""
        if seq.released or seq.pending is None:
            raise InputError("prefill_step() got a released sequence or one whose prompt is complete")
        lo, n = seq.n_past, seq.n_prompt
        hi = min(n, lo + max(1, min(int(max_positions), self.n_batch)))
        out = np.zeros(hi - lo, dtype=np.int8)
        if hi == n:
            out[-1] = 1
        rows = seq.pending[lo:hi]  # int32 token ids (merged layout) or float32 embedding rows (speech)
        ids = rows.dtype == np.int32
        batch = _Batch(self._lc, np.arange(lo, hi), np.full(hi - lo, seq.seq_id), out,
                       tokens=rows if ids else None, embd=None if ids else rows)
        logp = None
        with self._lock:
            self._decode(batch)
            if hi == n:
                logp = self._logp(hi - lo - 1)
        seq.n_past = hi
        if hi == n:
            seq.pending = None
        return logp

    def start(self, prefill: Prefill, max_new_tokens: int) -> tuple[LlamaSequence, torch.Tensor]:
        """Run the prefill of a new sequence; return its handle and the logp (6761,) of the next token."""
        seq = self.begin(prefill, max_new_tokens)
        try:
            logp = None
            while logp is None:
                logp = self.prefill_step(seq, self.n_batch)
        except BaseException:
            self.release(seq)
            raise
        return seq, logp

    def step(self, batch: Sequence[tuple[LlamaSequence, int]]) -> list[torch.Tensor]:
        """Feed one speech token to each listed sequence in one ``llama_decode``; return their logps."""
        if not batch:
            return []
        seqs = [s for s, _ in batch]
        if len({id(s) for s in seqs}) != len(seqs):
            raise InputError("a sequence may appear only once per step")
        for s, tok in batch:
            if not isinstance(s, LlamaSequence) or s.released:
                raise InputError("step() got a released or foreign sequence handle")
            if not 0 <= int(tok) < self.vocab_size:
                raise InputError(f"speech token {tok} is outside 0..{self.vocab_size - 1}")
            if s.pending is not None:
                raise InputError(f"sequence {s.seq_id} is still in its prefill ({s.n_past} of {s.n_prompt} positions)")
            if s.n_past >= s.capacity:
                raise InputError(f"sequence {s.seq_id} has used all {s.capacity} positions it reserved "
                                 "(prompt + max_new_tokens)")
        off = self.info.speech_offset
        b = _Batch(self._lc, np.array([s.n_past for s in seqs]), np.array([s.seq_id for s in seqs]),
                   np.ones(len(seqs), dtype=np.int8), tokens=np.array([off + int(t) for _, t in batch]))
        with self._lock:
            self._decode(b)
            out = [self._logp(i) for i in range(len(seqs))]
        for s in seqs:
            s.n_past += 1
        return out

    def release(self, handle: LlamaSequence) -> None:
        """Free the sequence's KV cells and its id at once. Idempotent."""
        with self._lock:
            if handle.released or handle not in self._active:
                handle.released = True
                return
            handle.released = True
            handle.pending = None
            self._lc.llama_memory_seq_rm(self._mem, handle.seq_id, -1, -1)
            self._active.discard(handle)
            self._reserved -= handle.capacity
            self._free_ids.append(handle.seq_id)
            self._free_ids.sort()

    # -- observation ---------------------------------------------------------------------------

    def cells_used(self, seq_id: int) -> int:
        """KV cells sequence ``seq_id`` holds in llama.cpp's memory right now (0 when empty)."""
        with self._lock:
            if self._mem is None:
                return 0
            hi = self._lc.llama_memory_seq_pos_max(self._mem, seq_id)
            lo = self._lc.llama_memory_seq_pos_min(self._mem, seq_id)
        return 0 if hi < 0 else int(hi - lo + 1)

    def stats(self) -> dict:
        """Slot and cell usage, e.g. for a server's ``/health``."""
        with self._lock:
            return {"n_seq_max": self.n_seq_max, "active_sequences": len(self._active),
                    "free_sequences": len(self._free_ids), "n_ctx": self.n_ctx,
                    "reserved_cells": self._reserved, "max_seq_tokens": self.max_seq_tokens,
                    "layout": self.layout, "type": self.info.type,
                    "kv_type": self.kv_type}

    @property
    def active_sequences(self) -> int:
        return len(self._active)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the llama.cpp context and model. The backend is unusable afterwards."""
        lc = getattr(self, "_lc", None)
        lock = getattr(self, "_lock", None)
        if lc is None or lock is None:
            return
        with lock:
            if self._ctx is not None:
                lc.llama_free(self._ctx)
                self._ctx = self._mem = None
            if getattr(self, "_model", None):
                lc.llama_model_free(self._model)
                self._model = None

    def __enter__(self) -> LlamaCppLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return (f"LlamaCppLLM({str(self.info.path)!r}, layout={self.layout!r}, type={self.info.type!r}, "
                f"kv_type={self.kv_type!r}, n_threads={self.n_threads}, n_seq_max={self.n_seq_max})")


__all__ = ["LlamaCppLLM", "LlamaSequence", "BackendBusyError", "import_llama_cpp", "llama_log_handler",
           "openmp_serving_hint", "set_llama_verbose", "KV_TYPES", "INSTALL_HINT"]
