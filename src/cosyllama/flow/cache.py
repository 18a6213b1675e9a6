"""The per-request streaming cache of the flow: K/V and conv context of the attention blocks an
earlier call of the same request completed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import InputError
from .dit import CONV_POS_KERNEL

if TYPE_CHECKING:
    from .dit import CausalConvPositionEmbedding

CONV_CONTEXT = 2 * (CONV_POS_KERNEL - 1)  # input frames back that one conv position embedding frame reads

DEFAULT_STREAM_CACHE_MB = 2048.0  # MiB per request (how many frames that is: docs/benchmarks.md)

# How the mixed-precision solvers (bf16, int8) keep cached K/V. The int8 solver computes K/V in
# float32; stored in bfloat16 they take half the memory (1.72 instead of 3.44 MiB per frame at full
# size), with a rounding (2^-9 relative) far below the int8 products' own error: on the full random
# model's 3 s + 10 s streaming calls the mel error against float32 stayed at mean 0.0087 / max 0.051
# (0.0086 / 0.046 with float32 storage), same speed (docs/benchmarks.md#memory-of-the-streaming-caches).
# bfloat16 rather than float16: it keeps float32's range, whatever magnitudes trained K/V reach.
LOWP_KV_DTYPE = torch.bfloat16


class FlowStreamCache:
    """What one streaming request's flow calls can reuse from its earlier calls.

    Why it is valid: in a streaming, non-final call (block-causal attention over
    ``static_chunk_size``-frame blocks, the real next 3 tokens as look-ahead) a frame depends only
    on frames of its own and earlier blocks: the mask hides later blocks, the two position convs
    are causal, the pre-lookahead layer reads the actual next tokens, and the ODE starts from the
    same fixed noise prefix. So frames of blocks an earlier call of the request completed have,
    at every Euler step and block and in both CFG rows, the same hidden states in every later call
    that extends its tokens. Such a call computes only its new frames, attending to the cached K
    (after RoPE) and V of the earlier ones; the result equals recomputing from scratch up to float
    rounding: the reference itself does not reproduce earlier blocks bit for bit from call to call
    (their attention runs over more, masked, keys, which rounds differently), so cached frames
    differ from recomputed ones by ~1e-6 at fp32 (observed <= 3e-6 on mels of magnitude ~10), and
    at bf16 by its own rounding (~2e-3). A call with nothing to reuse runs the same operations as
    the uncached path.

    Held (per Euler step): for each DiT block K and V of the cached frames for both CFG rows,
    each ``(2, frames, inner)`` in the storage dtype the solver names (float32 for the float32
    reference solver; bfloat16 for the bf16 and int8 solvers, see :data:`LOWP_KV_DTYPE`); the last
    ``CONV_CONTEXT`` (60) input-projection frames ``(2, 60, dim)`` float32 (what the position convs of
    the next frames read back); plus the
    finished mel of the cached frames and the prompt/token ids they came from. K/V dominate:
    ``steps x blocks x 2 rows x 2 x inner`` values per frame (:meth:`CFM.kv_bytes_per_frame`;
    sizes at full size: see docs/benchmarks.md#memory-of-the-streaming-caches).

    Bound: the K/V kept never exceed ``max_mb`` megabytes (MiB; default ``DEFAULT_STREAM_CACHE_MB`` =
    2048) nor ``max_frames`` frames if given. Past the bound the cache keeps its prefix and later calls
    recompute the frames after it every time (slower, same result); a bound below one block (e.g.
    ``max_mb=0``) disables caching. The count is rounded down to whole blocks.

    Validity: every call checks that the cache belongs to it — same module and weights (any
    ``load_state_dict`` / ``.to()`` / ``set_precision`` invalidates), compute dtype, steps, prompt
    mel and speaker embedding, and prompt + token ids that start with the ids of the call that
    filled it (its look-ahead tokens included); otherwise the cache is dropped and the call
    recomputes from scratch (``rebuilds`` counts it). Only streaming, non-final calls use it; any
    other call leaves it alone. The frames kept are whole blocks, so a later call never resumes
    inside a block.

    One object per request, never shared between requests or threads; :meth:`clear` frees it.
    Counters for tests and benchmarks: ``calls``, ``reused_frames``, ``computed_frames``,
    ``rebuilds``, ``last_start`` (frames taken from the cache by the last call).
    """

    def __init__(self, max_mb: float = DEFAULT_STREAM_CACHE_MB, max_frames: int | None = None):
        if not max_mb >= 0 or (max_frames is not None and max_frames < 0):
            raise InputError(f"stream cache bounds must be >= 0, got max_mb={max_mb!r}, max_frames={max_frames!r}")
        self.max_mb = float(max_mb)
        self.max_frames = max_frames
        self.marks: tuple[int, ...] = ()  # also keep the conv context at these frames (for :meth:`prefix`)
        # The frames end inside an attention block whose frames were solved without the frames after them (a
        # prompt's frames for the low-latency first chunk, Token2Wav._prompt_entry): not what any later call
        # would compute, so only a cache made for that one call holds such frames; start() accepts them.
        self.open_block = False
        self.calls = self.reused_frames = self.computed_frames = self.rebuilds = self.last_start = 0
        self.clear()

    def clear(self) -> None:
        """Free everything cached (the counters stay)."""
        self.frames = 0  # cached frames, a whole number of attention blocks
        # (step, block) -> K (after RoPE), V of the cached frames, each (2, frames, inner)
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.conv: dict[int, torch.Tensor] = {}  # step -> input-projection frames before `frames` (2, <=60, dim)
        self.conv_mark: dict[int, dict[int, torch.Tensor]] = {}  # mark -> step -> the same before the mark
        self.mel: torch.Tensor | None = None  # (1, mel, frames) float32: x at t=1
        self._key: tuple = ()  # what besides the ids the frames depend on
        self._ids: torch.Tensor | None = None  # (1, P+T) prompt + token ids of the call that filled it

    def mark_prefix(self, *frames: int) -> None:
        """Also keep the conv context at each of these frames while filling, so that :meth:`prefix` can
        give away the first ``frames`` frames later."""
        self.marks = tuple(f for f in frames if f > 0)

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        ts = [t for kv in self.kv.values() for t in kv] + list(self.conv.values())
        ts += [t for ctx in self.conv_mark.values() for t in ctx.values()]
        ts += [self.mel] if self.mel is not None else []
        return sum(t.numel() * t.element_size() for t in ts)

    def limit_frames(self, bytes_per_frame: int, chunk: int) -> int:
        """Most frames this cache may hold at ``bytes_per_frame`` (K/V bytes), a multiple of ``chunk``."""
        frames = int(self.max_mb * 2**20 // bytes_per_frame)
        if self.max_frames is not None:
            frames = min(frames, self.max_frames)
        return frames // chunk * chunk

    def start(self, key: tuple, ids: torch.Tensor, n: int, chunk: int) -> int:
        """Frames a call of ``n`` frames with this ``key`` and these ``ids`` may take from the
        cache; drops the cache (counted in ``rebuilds``) when it does not belong to the call."""
        if self.frames == 0:
            self.clear()
            return 0
        old = self._ids
        ok = (len(key) == len(self._key) and all(_same(a, b) for a, b in zip(key, self._key))
              and old is not None and ids.shape[1] >= old.shape[1] and torch.equal(ids[:, :old.shape[1]], old)
              and (self.frames % chunk == 0 or self.open_block) and self.frames <= n)
        if not ok:
            self.clear()
            self.rebuilds += 1
            return 0
        return self.frames

    def commit(self, key: tuple, ids: torch.Tensor, keep: int, mel: torch.Tensor) -> None:
        """After a solve that stored frames ``0..keep-1``: remember them and what they belong to."""
        self.frames = keep
        self.mel = mel[:, :, :keep].clone()
        self._key = tuple(k.clone() if isinstance(k, torch.Tensor) else k for k in key)
        self._ids = ids.clone()

    # Sharing frames between requests. Entries are only ever replaced, never written in place
    # (``StepCache`` assigns new tensors, ``commit``/``clear`` new objects), so caches may share
    # tensors: a copy costs two small dicts, and a later call of either cache leaves the other intact.

    def prefix(self, n_ids: int, frames: int | None = None, marks: tuple[int, ...] = (),
               copy: bool = True) -> FlowStreamCache | None:
        """A cache holding this one's first ``frames`` frames (default: all), valid for any call whose
        ids start with this one's first ``n_ids`` — the caller vouches that those frames depend on
        no later id. ``frames`` short of all needs the conv context a solve kept at that mark
        (:meth:`mark_prefix`); ``marks``: kept marks the result keeps too (so a prefix of it can be
        taken later). ``copy`` False: a shorter prefix views this one's tensors (for a cache used once
        while this one is kept) instead of copying them (for one kept on its own). None when there
        is nothing to give. Shares the tensors where it can."""
        frames = self.frames if frames is None else frames
        if frames <= 0 or frames > self.frames or self._ids is None or n_ids > self._ids.shape[1]:
            return None
        out = FlowStreamCache(self.max_mb, self.max_frames)
        if frames == self.frames:
            out.kv, out.conv, out.mel = dict(self.kv), dict(self.conv), self.mel
        else:
            ctx = self.conv_mark.get(frames)
            if ctx is None or set(ctx) != set(self.conv):
                return None
            cut = (lambda t: t[:, :frames].clone()) if copy else (lambda t: t[:, :frames])
            out.kv = {slot: (cut(k), cut(v)) for slot, (k, v) in self.kv.items()}
            out.conv, out.mel = dict(ctx), cut(self.mel[0])[None]
        out.conv_mark = {m: dict(self.conv_mark[m]) for m in marks if m < frames and m in self.conv_mark}
        out.marks = tuple(out.conv_mark)
        out.frames, out._key, out._ids = frames, self._key, self._ids[:, :n_ids]
        return out

    def load(self, other: FlowStreamCache) -> None:
        """Take ``other``'s frames (shared, see :meth:`prefix`) in place of this cache's own; the
        next call still checks that they belong to it."""
        self.clear()
        self.frames, self.kv, self.conv, self.mel = other.frames, dict(other.kv), dict(other.conv), other.mel
        self.open_block = other.open_block
        self._key, self._ids = other._key, other._ids


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))
    return a is b or a == b


class StepCache:
    """One Euler step of a solve that resumes from ``cache`` at frame ``start = cache.frames`` (a
    whole number of attention blocks) and leaves the cache holding frames ``0..keep-1``. Both
    solvers (reference DiT and :class:`FastDiT`) call it at the same two places:

    * :meth:`conv_pos` — the causal conv position embedding of the new frames. A frame reads
      ``CONV_CONTEXT`` (60) input-projection frames back (two k=31 convs), so the cache keeps the
      last 60 before ``start``; with them the unpadded convs give exactly the new frames (with all
      frames from 0, the module's own zero padding does).
    * :meth:`kv` — per block, the new frames' K (after RoPE) and V with the cached frames' put
      in front: ``(B, N, inner)``, what the new queries attend to.

    Entries are replaced one by one as the solve goes (old and new caches never both exist whole),
    so the caller must :meth:`FlowStreamCache.commit` afterwards, or clear the cache if it fails."""

    def __init__(self, cache: FlowStreamCache, step: int, keep: int, streaming: bool, store_dtype: torch.dtype):
        if not streaming:
            raise ValueError("the streaming cache needs the block-causal (streaming) mask")
        self.cache, self.step, self.keep = cache, step, keep
        self.store_dtype = store_dtype  # K/V kept in this dtype (CFM.kv_cache_dtype)
        self.start = cache.frames
        self.store = keep > self.start

    def conv_pos(self, cpe: CausalConvPositionEmbedding, h: torch.Tensor) -> torch.Tensor:
        """``h (B, m, dim)``: input projection of frames ``start..N-1`` -> their position embedding."""
        start, keep = self.start, self.keep
        if start == 0:
            hx, first, y = h, 0, cpe(h)  # hx holds frames first..N-1
        else:
            ctx = self.cache.conv[self.step]
            hx, first = torch.cat([ctx, h], dim=1), start - ctx.shape[1]
            if first == 0:
                y = cpe(hx)[:, start:]
            else:
                y = cpe.conv2(cpe.conv1(hx.transpose(1, 2))).transpose(1, 2)
        if self.store:
            self.cache.conv[self.step] = hx[:, max(keep - CONV_CONTEXT, 0) - first:keep - first].clone()
            for mark in self.cache.marks:
                if mark <= keep and first <= max(mark - CONV_CONTEXT, 0):
                    ctx = hx[:, max(mark - CONV_CONTEXT, 0) - first:mark - first].clone()
                    self.cache.conv_mark.setdefault(mark, {})[self.step] = ctx
        return y

    def kv(self, block: int, k: torch.Tensor, v: torch.Tensor,
           pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K (rotated), V ``(B, m, inner)`` of the new frames -> those of all N frames, in the
        dtype of the new ones (cached frames converted back from the storage dtype), followed by
        ``pad`` zero frames (keys the caller's mask hides; see :func:`joined`)."""
        slot = (self.step, block)
        if self.start:
            k0, v0 = self.cache.kv[slot]
            k, v = joined(k0, k, pad), joined(v0, v, pad)
        elif pad:
            k, v = joined(None, k, pad), joined(None, v, pad)
        if self.store:
            self.cache.kv[slot] = (self._stored(k), self._stored(v))
        return k, v

    def segments(self, block: int, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor, torch.Tensor]:
        """:meth:`kv` for an attention that reads keys in two segments (``native_attention.attention``'s
        ``before``): ``(K0, V0), K1, V1`` whose frames in that order are all N frames, with no copy of
        them all. The first segment is what the cache holds after this step (the cached frames, and the
        new ones up to ``keep`` when storing: stored then, as :meth:`kv` stores them), the second the new
        frames after it (views of ``k``, ``v``); None for the first where it holds none. Only where the
        storage dtype is ``k``'s (the caller checks; else :meth:`kv`), so what is stored needs no conversion."""
        slot, start = (self.step, block), self.start
        if self.store:
            cut = self.keep - start
            cached = self.cache.kv[slot] if start else (None, None)
            k0, v0 = (joined(c, new[:, :cut]) for c, new in zip(cached, (k, v)))  # a copy, never a view
            self.cache.kv[slot] = (k0, v0)
            return (k0, v0), k[:, cut:], v[:, cut:]
        return (self.cache.kv[slot] if start else None), k, v

    def _stored(self, t: torch.Tensor) -> torch.Tensor:
        """The kept frames of ``t`` as the cache holds them: converted to the storage dtype, or a
        contiguous copy unless ``t`` already is exactly those frames (never a view of the solver's
        buffers, which it goes on to overwrite)."""
        t = t[:, :self.keep]
        return t.to(self.store_dtype) if t.dtype != self.store_dtype else t.contiguous()


def joined(cached: torch.Tensor | None, new: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """``cat([cached, new, pad zero frames], dim=1)`` in ``new``'s dtype, converting ``cached`` on the
    way (one pass; ``cached`` None: none)."""
    c = 0 if cached is None else cached.shape[1]
    m = new.shape[1]
    out = new.new_empty(new.shape[0], c + m + pad, new.shape[2])
    if cached is not None:
        out[:, :c].copy_(cached)
    out[:, c:c + m].copy_(new)
    if pad:
        out[:, c + m:].zero_()
    return out
