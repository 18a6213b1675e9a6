"""The PyTorch LLM with a static KV cache and fixed-shape decode steps, captured as CUDA graphs on a
GPU (see docs/architecture.md#static-kv-cache-decode).

On a GPU, a decode step of the 0.5B speech LLM is a few hundred small kernels; launched one by one
from Python they take longer than the arithmetic. Here every tensor a step touches has a shape
fixed in advance, so the whole step can be recorded once as a CUDA graph and replayed with one
launch:

* **Slots.** The KV memory is one pool ``(layers, slots, kv_heads, ctx, head_dim)``; a sequence
  owns one slot for its life. Batch row ``j`` of a step is slot ``j``: a step over ``b`` rows
  covers slots ``0 .. b-1`` without gathering anything.
* **Buckets.** A step runs at the smallest bucket size (1, 2, 4, 8, ...) that covers the highest
  slot in the batch. Rows whose slot is not in the batch (free, or not stepped this time) are
  padding: they feed token 0 at position ``ctx - 1``, a scratch column no real query ever reads
  (a sequence may use positions ``0 .. ctx - 2`` only).
* **Compaction.** When a sequence ends, the sequence in the highest occupied slot moves into the
  freed one (one copy of its cache), so the buckets stay as small as the live batch.
* **Attention** of each row covers the slot's whole ``ctx`` under a mask ``key <= position``.

The same code runs eagerly on the CPU (no graphs), where the tests hold it to the dynamic-cache
backend (:class:`~cosyllama.llm.torch_backend.TorchLLM`). Float32 is the parity mode; bf16 and
fp16 weights are explicit choices for a GPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..config import LLMConfig
from ..device import on_true_fp32, resolve_device, true_fp32
from ..errors import BackendBusyError, InputError
from .backend import Prefill
from .model import KVCache, SpeechLM, apply_rope, rope_cos_sin

log = logging.getLogger("cosyllama.llm")

LLM_PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_CTX = 4096  # positions per slot (prefill + new tokens + the scratch column)


def buckets_for(slots: int) -> tuple[int, ...]:
    """Batch sizes a step is padded to: powers of two below ``slots``, then ``slots`` itself."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return (*out, slots)


class _SlotCache(KVCache):
    """A :class:`KVCache` whose storage is one slot of the pool (views, never reallocated), so the
    prefill runs through the model's ordinary cached forward and writes straight into the pool."""

    def __init__(self, pool: "StaticTorchLLM", slot: int):
        self.qwen, self.device, self.dtype = pool.model.cfg.qwen, pool.device, pool.dtype
        self.length = 0
        self.k, self.v = pool.k[:, slot], pool.v[:, slot]
        self.capacity = pool.ctx - 1  # the last column is the padding rows' scratch

    def reserve(self, extra: int) -> None:
        if self.length + extra > self.capacity:
            raise InputError(f"the sequence needs {self.length + extra} positions; a slot holds {self.capacity}")


class _Slot:
    __slots__ = ("index", "length", "released", "pending")

    def __init__(self, index: int):
        self.index, self.length, self.released = index, 0, False
        self.pending: torch.Tensor | None = None  # prompt embeddings while the prefill runs in pieces


class StaticTorchLLM:
    """PyTorch backend with a slot pool and fixed-shape decode steps (CUDA graphs on a GPU).

    slots: sequences held at once (a start beyond them raises BackendBusyError, which the server's
    scheduler answers by queueing). ctx: positions per slot. precision: ``fp32`` | ``bf16`` |
    ``fp16`` weights and cache. graphs: capture the steps as CUDA graphs (default: on CUDA).
    """

    name = "torch"
    n_threads = None  # shares PyTorch's threads

    def __init__(self, cfg: LLMConfig, weights: dict[str, torch.Tensor], device="cpu", *,
                 slots: int = 16, ctx: int = DEFAULT_CTX, precision: str = "fp32", graphs: bool | None = None):
        if precision not in LLM_PRECISIONS:
            raise InputError(f"LLM precision must be one of {', '.join(LLM_PRECISIONS)}, got {precision!r}")
        if slots < 1 or ctx < 2:
            raise InputError(f"slots must be >= 1 and ctx >= 2, got slots={slots}, ctx={ctx}")
        self.cfg = cfg
        self.device = resolve_device(device)
        self.dtype = LLM_PRECISIONS[precision]
        self.precision = precision
        with torch.device("meta"):
            model = SpeechLM(cfg)
        model.load_state_dict(weights, strict=True, assign=True)
        self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)
        q = cfg.qwen
        self.slots, self.ctx = slots, ctx
        self.n_seq_max = slots  # the batching scheduler decodes this many at once
        # prompt + new tokens one sequence may hold: the last new token is never fed back, so ctx - 1 positions
        # (see begin)
        self.max_seq_tokens = ctx
        shape = (q.num_hidden_layers, slots, q.num_key_value_heads, ctx, q.head_dim)
        # Zeros, not empty: masked keys still enter the attention product (times a zero weight),
        # and uninitialised memory may hold NaNs.
        self.k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.buckets = buckets_for(slots)
        self._owner: list[_Slot | None] = [None] * slots
        self._tok = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._pos = torch.full((slots,), ctx - 1, dtype=torch.long, device=self.device)
        self._keys = torch.arange(ctx, device=self.device)
        self._graphs: dict[int, tuple[object, torch.Tensor]] = {}
        # One lock for the pool: the step buffers and compaction are shared by every sequence, and the
        # Python API may drive sequences from several threads (the server's scheduler uses one).
        self._lock = threading.RLock()
        self.graphs = (self.device.type == "cuda") if graphs is None else bool(graphs)
        if self.graphs:
            if self.device.type != "cuda":
                raise InputError("CUDA graphs need device='cuda'")
            self._capture()

    def stats(self) -> None:
        """No counters (the scheduler's are the server's)."""
        return None

    def __repr__(self) -> str:
        return (f"StaticTorchLLM(device={str(self.device)!r}, precision={self.precision!r}, slots={self.slots}, "
                f"ctx={self.ctx}, graphs={self.graphs})")

    # -- the fixed-shape step ------------------------------------------------------------------

    def _step_rows(self, b: int) -> torch.Tensor:
        """Advance slots ``0 .. b-1`` by the tokens/positions in ``self._tok[:b]``/``self._pos[:b]``;
        return their log-probs ``(b, vocab)`` in float32. Every shape depends on ``b`` alone."""
        m, q = self.model, self.cfg.qwen
        tok, pos = self._tok[:b], self._pos[:b]
        rows = torch.arange(b, device=self.device)
        x = m.speech_embedding.weight[tok][:, None, :]
        cos, sin = rope_cos_sin(pos, q.head_dim, q.rope_theta)
        cos, sin = cos[:, None, None, :], sin[:, None, None, :]
        mask = (self._keys[None, :] <= pos[:, None])[:, None, None, :]
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            qh = a.q_proj(h).view(b, 1, a.n_heads, a.head_dim).transpose(1, 2)
            kh = a.k_proj(h).view(b, 1, a.n_kv, a.head_dim).transpose(1, 2)
            vh = a.v_proj(h).view(b, 1, a.n_kv, a.head_dim).transpose(1, 2)
            qh, kh = apply_rope(qh, cos, sin), apply_rope(kh, cos, sin)
            keys, values = self.k[i, :b], self.v[i, :b]
            keys[rows, :, pos] = kh[:, :, 0]
            values[rows, :, pos] = vh[:, :, 0]
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, enable_gqa=True)
            x = x + a.o_proj(out.transpose(1, 2).reshape(b, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return torch.log_softmax(m.llm_decoder(m.norm(x)[:, 0]).float(), dim=-1)

    def _capture(self) -> None:
        """Record one CUDA graph per bucket. Runs before any sequence exists: the warm-up and
        capture steps write only the pool's position-(ctx-1) scratch column."""
        self._pos.fill_(self.ctx - 1)
        pool = None
        # TF32 off while recording: a graph keeps the matrix-product kernels chosen at capture
        with torch.inference_mode(), true_fp32(self.device):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for b in self.buckets:
                    for _ in range(2):  # lets lazy initialisation (cuBLAS handles, autotuning) happen outside capture
                        self._step_rows(b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            for b in reversed(self.buckets):  # the largest first: the smaller ones reuse its pool
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._step_rows(b)
                pool = graph.pool()
                self._graphs[b] = (graph, out)
        log.info("LLM decode: %d CUDA graphs captured (batch buckets %s, %s, %d positions per slot)",
                 len(self._graphs), ",".join(map(str, self.buckets)), self.precision, self.ctx)

    # -- the backend protocol ------------------------------------------------------------------

    @torch.inference_mode()
    def begin(self, prefill: Prefill, max_new_tokens: int) -> _Slot:
        """Take a slot for ``prefill`` + ``max_new_tokens``; the prompt runs in :meth:`prefill_step`
        pieces (the batching scheduler interleaves them with other sequences' decode steps)."""
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = len(prefill) + max_new_tokens - 1  # the last new token is emitted, never fed back
        if need > self.ctx - 1:
            raise InputError(f"the request needs up to {need} LLM positions ({len(prefill)} prompt + "
                             f"{max_new_tokens} new tokens); this backend holds {self.ctx - 1} per sequence")
        with self._lock:
            try:
                index = self._owner.index(None)
            except ValueError:
                raise BackendBusyError(f"all {self.slots} LLM sequence slots are in use") from None
            slot = _Slot(index)
            self._owner[index] = slot
        try:
            slot.pending = self.model.prefill_embeddings(prefill.text_ids, prefill.prompt_speech_tokens).to(self.dtype)
        except BaseException:
            self.release(slot)
            raise
        return slot

    @on_true_fp32
    @torch.inference_mode()
    def prefill_step(self, slot: _Slot, max_positions: int) -> torch.Tensor | None:
        """Run the next ``max_positions`` prompt positions of ``slot``; the logp of its first new
        token once the prompt is complete, else None. Pieces equal one pass up to float rounding."""
        with self._lock:
            if slot.released or slot.pending is None:
                raise RuntimeError("prefill_step() on a released sequence or one whose prompt is complete")
            cache = _SlotCache(self, slot.index)  # the slot's current index: compaction may have moved it
            cache.length = lo = slot.length
            hi = min(slot.pending.shape[0], lo + max(1, int(max_positions)))
            hidden = self.model.forward_hidden(slot.pending[None, lo:hi], cache)
            slot.length = cache.length
            if hi < slot.pending.shape[0]:
                return None
            slot.pending = None
            return self.model.logp(hidden[0, -1]).cpu()

    def start(self, prefill: Prefill, max_new_tokens: int) -> tuple[_Slot, torch.Tensor]:
        """Take a slot and run the whole prompt in one pass; ``(handle, logp)``."""
        slot = self.begin(prefill, max_new_tokens)
        try:
            return slot, self.prefill_step(slot, len(prefill))
        except BaseException:
            self.release(slot)
            raise

    @on_true_fp32
    @torch.inference_mode()
    def step(self, batch: Sequence[tuple[_Slot, int]]) -> list[torch.Tensor]:
        """Feed one speech token to each listed sequence in one fixed-shape step; return their logps."""
        with self._lock:
            return self._step(batch)

    def _step(self, batch: Sequence[tuple[_Slot, int]]) -> list[torch.Tensor]:
        slots = [s for s, _ in batch]
        for s in slots:
            if s.released or s.pending is not None:
                raise RuntimeError("step() on a released sequence or one still in its prefill")
        if len({id(s) for s in slots}) != len(slots):
            raise InputError("a sequence may appear only once per step")
        if not batch:
            return []
        top = max(s.index for s in slots) + 1
        b = next(x for x in self.buckets if x >= top)
        tok = torch.zeros(b, dtype=torch.long)
        pos = torch.full((b,), self.ctx - 1, dtype=torch.long)
        for s, t in batch:
            if s.length >= self.ctx - 1:
                raise InputError(f"the sequence is at its slot's {self.ctx - 1} positions")
            tok[s.index], pos[s.index] = int(t), s.length
        self._tok[:b].copy_(tok, non_blocking=True)
        self._pos[:b].copy_(pos, non_blocking=True)
        if self.graphs:
            graph, out = self._graphs[b]
            graph.replay()
        else:
            out = self._step_rows(b)
        host = out.cpu()  # one copy per step; the sampler runs on the host (exact RAS)
        for s in slots:
            s.length += 1
        return [host[s.index].clone() for s in slots]

    def release(self, handle: _Slot) -> None:
        """Free the slot; the sequence in the highest occupied slot moves into it (one cache copy)."""
        with self._lock:
            self._release(handle)

    def _release(self, handle: _Slot) -> None:
        if handle.released:
            return
        handle.released = True
        hole = handle.index
        self._owner[hole] = None
        top = max((i for i, o in enumerate(self._owner) if o is not None), default=-1)
        if top > hole:
            mover = self._owner[top]
            n = mover.length
            with torch.inference_mode():
                self.k[:, hole, :, :n] = self.k[:, top, :, :n]
                self.v[:, hole, :, :n] = self.v[:, top, :, :n]
            self._owner[top], self._owner[hole] = None, mover
            mover.index = hole

    @property
    def active(self) -> int:
        return sum(o is not None for o in self._owner)
