"""Speech tokens -> audio, per request: the flow + vocoder schedule, streaming included.

This is the only module that knows about streaming. All state of a request lives in a
:class:`_StreamState` created per call; the models are shared read-only, so several generators
(threads, server requests) can run interleaved without touching each other.

Streaming schedule (see docs/reference.md#chunk-schedule): the first chunk covers ``25 + pad`` tokens, where
``pad`` rounds the prompt token count up to a multiple of 25 (so chunks align with the DiT's 50-frame
attention blocks); every chunk needs 3 more tokens of look-ahead; the hop doubles after each chunk up to 100.
Each chunk runs the flow over prompt + all tokens so far (block-causal attention) and the vocoder over all mel
so far, and emits only the new samples; here the vocoder continues from a per-request
:class:`~cosyllama.vocoder.VocoderStream` instead (the same new samples up to float rounding, at a cost that
does not grow with the utterance). The last call uses full attention (see
docs/reference.md#q4-full-attention-final-call). Unlike the reference, at reduced flow precision (bf16, int8) the
flow does not recompute the attention blocks earlier chunks completed: each request keeps a
:class:`~cosyllama.flow.FlowStreamCache` (same mel up to float rounding; bounded by ``stream_cache_mb``; freed
when the request's generator ends or is closed). At fp32, the reference-parity mode, it is off unless asked
for (see :class:`Token2Wav`).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .errors import InputError
from .flow import DEFAULT_STREAM_CACHE_MB, FlowStreamCache
from .vocoder import VocoderStream

PROMPT_LEVELS = 1024  # voices whose measured prompt loudness a Token2Wav keeps (prompt_level: a few bytes each)
DEFAULT_PROMPT_CACHE_MB = 512.0  # frames shared between streaming requests of one prompt (see Token2Wav)
# The reference's streaming hops, fixed in its model wrapper whatever the yaml's chunk_size says (only the
# DiT's attention blocks follow the yaml): see docs/reference.md#chunk-schedule and #yaml-values-the-reference-ignores.
TOKEN_HOP = 25  # first hop, tokens; the prompt pad rounds the prompt up to a multiple of it
TOKEN_MAX_HOP = 100  # the hop doubles up to this
HOP_GROWTH = 2


@dataclass(frozen=True)
class AudioChunk:
    """A piece of synthesized audio.

    samples: float32 (N,) mono waveform in [-0.99, 0.99]; sample_rate: Hz (24000);
    segment: index of the text segment it belongs to; is_final: the last chunk of that segment;
    tokens: the speech tokens of the segment (filled on its final chunk, else empty); start: where its first
    sample is in the call's whole output (the samples of the chunks before it; set by the pipeline).
    """

    samples: np.ndarray
    sample_rate: int
    segment: int
    is_final: bool
    tokens: tuple[int, ...] = ()
    start: int = 0


@dataclass(frozen=True)
class FlowPrompt:
    """Flow conditioning of one request: prompt tokens (1, P) int32, prompt mel (1, 2P, 80)
    float32, raw speaker embedding (1, 192) float32."""

    tokens: torch.Tensor
    feat: torch.Tensor
    embedding: torch.Tensor


@dataclass
class _StreamState:
    """Per-request streaming progress (never stored on a shared object)."""

    prompt_pad: int
    hop: int  # tokens of the next chunk, look-ahead and prompt padding aside
    token_offset: int = 0
    tokens: list[int] = field(default_factory=list)
    vocoder: VocoderStream | None = None  # the vocoder's progress through this utterance (set by stream)
    flow_cache: FlowStreamCache | None = None  # K/V of the flow blocks earlier chunks completed
    emitted: bool = False  # a chunk with samples was yielded
    # the low-latency first chunk (opt-in; docs/streaming.md): the reference's first hop made as two chunks, this
    # many tokens and then the rest of it, after which the reference's schedule goes on unchanged; 0: the reference's
    first_chunk: int = 0

    def next_hop(self) -> int:
        first = self.hop + self.prompt_pad  # the reference's first hop
        if self.first_chunk and self.token_offset < first:
            return self.first_chunk if self.token_offset == 0 else first - self.token_offset
        return first if self.token_offset == 0 else self.hop

    def advance(self, hop: int) -> None:
        """``hop`` tokens made: the next chunk starts after them; the hop doubles (to :data:`TOKEN_MAX_HOP`) once
        the reference's first hop is done."""
        first = self.hop + self.prompt_pad
        self.token_offset += hop
        if not self.first_chunk or self.token_offset >= first:
            if self.first_chunk:
                self.first_chunk = 0  # the split first hop is done: from here on, the reference's schedule
            self.hop = min(TOKEN_MAX_HOP, HOP_GROWTH * self.hop)


def schedule_line(first_chunk: int | None) -> str:
    """The line a command prints of the streaming schedule it runs (beside the CPU line)."""
    if first_chunk:
        return (f"streaming: low-latency first chunk of {first_chunk} speech tokens, outside the reference's "
                f"schedule (then its {TOKEN_HOP}+ → {HOP_GROWTH * TOKEN_HOP} → … {TOKEN_MAX_HOP}; docs/streaming.md)")
    return (f"streaming: the reference's schedule (first chunk {TOKEN_HOP}+ speech tokens, then "
            f"{HOP_GROWTH * TOKEN_HOP} … {TOKEN_MAX_HOP})")


FlowPause = Callable[[bool], ContextManager]  # pause(first) -> held around one flow + vocoder call


def no_pause(first: bool = False) -> ContextManager:
    """A flow pause that holds nothing (see :meth:`cosyllama.llm.decode.TokenSource.pause_for_flow`)."""
    return nullcontext()


def _as_tokens(tokens: list[int], device) -> torch.Tensor:
    return torch.tensor([tokens], dtype=torch.int32, device=device)


class Token2Wav:
    """Flow + vocoder driver. ``flow`` is a :class:`cosyllama.flow.Flow`, ``hift`` a
    :class:`cosyllama.vocoder.HiFT`; both are used read-only.

    ``stream_cache_mb``: bound of each streaming request's flow K/V cache in MiB (see
    :class:`~cosyllama.flow.FlowStreamCache`; its size per frame: see
    docs/benchmarks.md#memory-of-the-streaming-caches; past the bound the frames after it are recomputed every
    chunk); 0 turns the cache off
    (the reference's recompute-everything behaviour). None (default): ``DEFAULT_STREAM_CACHE_MB``
    (2048) when the flow runs at reduced precision, off at fp32. Why off at fp32: the reference
    itself does not give an earlier block bit-identical values in successive calls (attention over
    more, masked, keys rounds differently), so cached frames differ from recomputed ones by ~1e-6
    in the mel, and the tiny random fixture model's vocoder turns that into ~1e-2 in the audio,
    beyond the 1e-3 the fp32 parity tests allow; pass a bound to use it at fp32 anyway.

    ``prompt_cache_mb``: bound in MiB of the frames shared between streaming requests with the same
    prompt (voice). The flow's first chunk is solved over the prompt's frames too, and the attention
    blocks that end before frame ``2 * (P - 3)`` (P prompt tokens; later frames read the first new
    tokens through the look-ahead) are the same in every request of that prompt. The first request
    of a prompt solves them in a call of their own before its first chunk and keeps them; every
    request's first chunk starts after them, so a request's audio does not depend on what the cache
    held (``_prompt_entry``). 3 s of prompt shares 100 of its 150 frames (a voice that serves the low-latency
    first chunk keeps all 150, see ``stream``); least recently used prompts go first. None
    (default): ``DEFAULT_PROMPT_CACHE_MB`` (512) whenever the streaming cache is on, else off; 0
    turns it off."""

    def __init__(self, flow, hift, sample_rate: int, lookahead: int | None = None,
                 token_mel_ratio: int | None = None, stream_cache_mb: float | None = None,
                 prompt_cache_mb: float | None = None, token_hop: int = TOKEN_HOP):
        for name, v in (("stream_cache_mb", stream_cache_mb), ("prompt_cache_mb", prompt_cache_mb)):
            if v is not None and not v >= 0:
                raise InputError(f"{name} must be >= 0, got {v!r}")
        self.flow, self.hift = flow, hift
        self.sample_rate = sample_rate
        # What the flow was built with, unless the caller says otherwise (see from_config).
        self.lookahead = flow.cfg.pre_lookahead_len if lookahead is None else lookahead
        self.token_mel_ratio = flow.cfg.token_mel_ratio if token_mel_ratio is None else token_mel_ratio
        # First streaming hop: the reference's constant, not the yaml's chunk_size (a parameter only so that
        # tests can show a wrong hop fails them).
        self.token_hop = int(token_hop)
        if self.token_hop < 1:
            raise InputError(f"the streaming hop must be >= 1 token, got {self.token_hop}")
        self.stream_cache_mb = stream_cache_mb
        self.prompt_cache_mb = prompt_cache_mb
        self._prompt_frames: OrderedDict[bytes, FlowStreamCache] = OrderedDict()  # LRU, newest last
        self.prompt_drops = 0  # prompts' frames the bound let go (pushed out, or too big to keep): a server logs it
        self._prompt_lock = threading.Lock()
        self._prompt_levels: OrderedDict[bytes, object] = OrderedDict()  # prompt_level's, LRU, newest last
        self._output_levels: OrderedDict[bytes, object] = OrderedDict()  # note_output_level's, LRU, newest last

    @classmethod
    def from_config(cls, config, flow, hift, *, stream_cache_mb: float | None = None,
                    prompt_cache_mb: float | None = None) -> Token2Wav:
        """The driver for a model's ``config`` (a :class:`~cosyllama.config.ModelConfig`): its
        sample rate, and the flow's look-ahead and mel frames per token, which the reference's wrapper
        reads from its flow module (built from the yaml). The streaming hop is the reference's
        constant :data:`TOKEN_HOP`: its wrapper ignores the yaml's ``chunk_size``."""
        return cls(flow, hift, config.sample_rate, lookahead=config.flow.pre_lookahead_len,
                   token_mel_ratio=config.flow.token_mel_ratio,
                   stream_cache_mb=stream_cache_mb, prompt_cache_mb=prompt_cache_mb)

    def _stream_cache_mb(self) -> float:
        mb = self.stream_cache_mb
        if mb is None:
            mb = 0.0 if self.flow.precision == torch.float32 else DEFAULT_STREAM_CACHE_MB
        return mb

    def new_stream_cache(self) -> FlowStreamCache | None:
        """The flow cache a new streaming request gets (None: recompute every chunk)."""
        mb = self._stream_cache_mb()
        return FlowStreamCache(max_mb=mb) if mb > 0 else None

    # -- frames shared between requests of one prompt ---------------------------------------

    def shared_prompt_frames(self, n_prompt_tokens: int) -> int:
        """Leading mel frames every streaming request with a prompt of this many tokens computes
        alike: whole attention blocks before ``token_mel_ratio * (P - lookahead)``; 0 if none."""
        chunk = self.flow.block_frames
        if not chunk:
            return 0
        return max(0, self.token_mel_ratio * (n_prompt_tokens - self.lookahead)) // chunk * chunk

    def _prompt_cache_bytes(self) -> int:
        mb = self.prompt_cache_mb
        if mb is None:
            mb = DEFAULT_PROMPT_CACHE_MB if self._stream_cache_mb() > 0 else 0.0
        return int(mb * 2**20)

    def _prompt_key(self, prompt: FlowPrompt) -> bytes:
        h = hashlib.sha256()
        h.update(repr(self.flow.solver_key()).encode())
        for t in (prompt.tokens, prompt.feat, prompt.embedding):
            a = t.detach().cpu().contiguous()
            h.update(repr((tuple(a.shape), str(a.dtype))).encode())
            h.update(a.numpy().tobytes())
        return h.digest()

    def _keep_prompt_frames(self, key: bytes, frames: FlowStreamCache | None) -> None:
        limit = self._prompt_cache_bytes()
        if frames is None:
            return
        with self._prompt_lock:
            if frames.nbytes > limit:
                self.prompt_drops += 1
                return
            self._prompt_frames[key] = frames
            self._prompt_frames.move_to_end(key)
            while sum(c.nbytes for c in self._prompt_frames.values()) > limit:
                self._prompt_frames.popitem(last=False)
                self.prompt_drops += 1

    def _prompt_frames_for(self, key: bytes) -> FlowStreamCache | None:
        with self._prompt_lock:
            frames = self._prompt_frames.get(key)
            if frames is not None:
                self._prompt_frames.move_to_end(key)
            return frames

    def _stand_in_tokens(self, n_prompt_tokens: int) -> int:
        """Tokens after the prompt in the call that solves its frames for :meth:`_prompt_entry`: as many as
        complete the attention block the prompt ends in (at least one), so that the call keeps every prompt
        frame; the look-ahead comes on top."""
        chunk = self.flow.block_frames
        frames = self.token_mel_ratio * n_prompt_tokens
        end = -(-frames // chunk) * chunk if chunk else frames
        return max(1, -(-(end - frames) // self.token_mel_ratio))

    def _prompt_entry(self, prompt: FlowPrompt, shared: int, whole: bool = False) -> FlowStreamCache | None:
        """What a voice keeps for its streaming requests: the prompt's ``shared`` leading frames, which every
        request of it starts from, or with ``whole`` all its frames (those first), which the low-latency first
        chunk starts from (see :meth:`stream`). Kept from an earlier request, or solved now in a call of their
        own (and kept if the bound allows): the prompt followed by stand-in tokens (id 0) that fill its last
        attention block. None when the stream cache is off or the frames cannot be held.

        Always that call, never the first chunk's: a solver whose rows share arithmetic (int8 with
        dynamic activation scales: one scale per product call, chosen from all of the call's rows)
        would give the shared frames other values in a call that also holds a request's first
        tokens, so the first request of a voice (or one after the frames were evicted) would sound
        different in its last bits from the ones after it. Solved alone, the frames are the same
        bits in every request of the prompt, whatever the cache held before, through every door; and
        the same call serves both kinds of entry, so the shared frames are the same bits in both.

        The prompt's frames after the shared ones read the stand-in tokens (through the look-ahead, and within
        their attention block), where a request's first chunk reads its real first tokens: only the low-latency
        first chunk, which is outside the reference's schedule anyway, takes them (docs/streaming.md)."""
        key = self._prompt_key(prompt)
        p = prompt.tokens.shape[1]
        want = self.token_mel_ratio * p if whole else shared
        entry = self._prompt_frames_for(key)
        if entry is None or entry.frames < want:
            cache = self.new_stream_cache()
            if cache is None:
                return None
            cache.mark_prefix(shared, want)
            self._mel([0] * (self._stand_in_tokens(p) + self.lookahead), prompt, 0, streaming=True,
                      finalize=False, cache=cache)
            entry = cache.prefix(p, want, marks=(shared,))
            if entry is None and whole and shared:  # the stream cache's bound holds fewer frames: the shared ones
                entry, whole = cache.prefix(p, shared), False
            cache.clear()
            if entry is None:
                return None
            entry.open_block = whole and want % self.flow.block_frames != 0
            if self._prompt_cache_bytes() > 0:
                self._keep_prompt_frames(key, entry)
        return entry

    def _shared_frames(self, entry: FlowStreamCache, n_prompt_tokens: int, shared: int) -> FlowStreamCache | None:
        """A voice entry's first ``shared`` frames, for one request (views of the kept entry's tensors)."""
        return entry if entry.frames == shared else entry.prefix(n_prompt_tokens, shared, copy=False)

    def warm_prompt(self, prompt: FlowPrompt, whole: bool = False) -> bool:
        """Solve the prompt's shared blocks now and keep them, as a first streaming request of this
        prompt would (``whole``: all its frames, as a first request with the low-latency first chunk
        would). Returns whether they are kept."""
        shared = self.shared_prompt_frames(prompt.tokens.shape[1])
        whole = whole and self.flow.block_frames > 0
        if not (shared or whole) or self._prompt_cache_bytes() <= 0 or self._stream_cache_mb() <= 0:
            return False
        self._prompt_entry(prompt, shared, whole)
        return self._prompt_frames_for(self._prompt_key(prompt)) is not None

    def prompt_level(self, prompt: FlowPrompt):
        """The loudness of ``prompt``'s voice as this model renders it (a :class:`cosyllama.loudness.Level`):
        its prompt mel vocoded once (the flow's conditioning, so the level the model's speech in that voice
        starts from), measured by BS.1770, kept for the next request of the voice (:data:`PROMPT_LEVELS` voices,
        least recently used go first). A stream's loudness gain when nothing better is known (docs/loudness.md)."""
        from .loudness import Level

        key = self._level_key(prompt)
        with self._prompt_lock:
            level = self._prompt_levels.get(key)
            if level is not None:
                self._prompt_levels.move_to_end(key)
                return level
        mel = prompt.feat.reshape(1, -1, prompt.feat.shape[-1]).transpose(1, 2).contiguous()  # (1, 80, 2P)
        with torch.inference_mode():
            samples = self.hift.inference(mel, finalize=True)[0]
        level = Level.of(samples.float().cpu().numpy(), self.sample_rate)
        with self._prompt_lock:
            self._prompt_levels[key] = level
            while len(self._prompt_levels) > PROMPT_LEVELS:
                self._prompt_levels.popitem(last=False)
        return level

    @staticmethod
    def _level_key(prompt: FlowPrompt) -> bytes:
        feat = prompt.feat.detach().cpu().contiguous()
        return hashlib.sha256(repr(tuple(feat.shape)).encode() + feat.numpy().tobytes()).digest()

    def voice_level(self, prompt: FlowPrompt):
        """The loudness a stream in ``prompt``'s voice is expected at, and where it comes from: the last
        finished output in that voice as the model made it (:meth:`note_output_level`), ``"output"``; before
        any, the prompt as the model renders it (:meth:`prompt_level`), ``"prompt"``."""
        key = self._level_key(prompt)
        with self._prompt_lock:
            level = self._output_levels.get(key)
            if level is not None:
                self._output_levels.move_to_end(key)
                return level, "output"
        return self.prompt_level(prompt), "prompt"

    def known_output_level(self, prompt: FlowPrompt) -> bool:
        """Whether an output in ``prompt``'s voice has finished and left its loudness (:meth:`note_output_level`)."""
        key = self._level_key(prompt)
        with self._prompt_lock:
            return key in self._output_levels

    def note_output_level(self, prompt: FlowPrompt, level) -> None:
        """Keep ``level``, a finished output's loudness before any gain, as what the next stream in ``prompt``'s
        voice is expected at (:data:`PROMPT_LEVELS` voices, least recently used go first); an unmeasurable one
        (too short, silent) is not kept."""
        if level.lufs is None or level.lufs == float("-inf"):
            return
        key = self._level_key(prompt)
        with self._prompt_lock:
            self._output_levels[key] = level
            self._output_levels.move_to_end(key)
            while len(self._output_levels) > PROMPT_LEVELS:
                self._output_levels.popitem(last=False)

    def prompt_cache_info(self) -> dict:
        """Prompts whose shared frames are kept, and the bytes they hold."""
        with self._prompt_lock:
            return {"prompts": len(self._prompt_frames),
                    "bytes": sum(c.nbytes for c in self._prompt_frames.values())}

    def clear_prompt_cache(self) -> None:
        with self._prompt_lock:
            self._prompt_frames.clear()

    def _mel(self, tokens: list[int], prompt: FlowPrompt, offset: int, streaming: bool,
             finalize: bool, cache: FlowStreamCache | None = None) -> torch.Tensor:
        mel = self.flow.inference(_as_tokens(tokens, self.flow.device), prompt.tokens, prompt.feat,
                                  prompt.embedding, streaming=streaming, finalize=finalize, cache=cache)
        return mel[:, :, self.token_mel_ratio * offset:]

    def full(self, tokens: list[int], prompt: FlowPrompt, speed: float = 1.0) -> np.ndarray:
        """Non-streaming: all tokens -> (480 * 2 * len(tokens) / speed,) samples (one flow and one
        vocoder call: the caller holds its flow pause around this)."""
        if not tokens:
            return np.zeros(0, dtype=np.float32)
        mel = self._mel(tokens, prompt, 0, streaming=False, finalize=True)
        if speed != 1.0:  # at least one frame: a one-token output at speed > 2 would have none
            mel = F.interpolate(mel, size=max(1, int(mel.shape[2] / speed)), mode="linear")
        return self.hift.inference(mel, finalize=True)[0].float().cpu().numpy()

    def stream(self, token_iter: Iterable[int], prompt: FlowPrompt, segment: int,
               pause: FlowPause = no_pause, cut: Callable[[], int | None] | None = None,
               first_chunk: int | None = None) -> Iterator[AudioChunk]:
        """Consume tokens as they are decoded and yield audio as soon as each chunk exists; ``pause(first)``
        (the pipeline's flow pause) is held around each chunk's flow and vocoder work (``first``: no audio
        yielded yet), never while waiting for tokens. ``cut()``, asked once the tokens end: keep only that many
        (a loop cut, docs/retries.md), or None: all; tokens whose audio went out already stay, and so do the
        look-ahead tokens after them, so the final call has the new tokens it always has.

        ``first_chunk``: outside the reference's schedule, the first chunk covers only this many tokens (plus
        the look-ahead) and the second the rest of the reference's first hop; every chunk after is the
        reference's. The first chunk's frames see less of their attention block than the reference's do, and
        (where the prompt cache can keep them) the prompt's frames as the voice keeps them, solved once with
        stand-in tokens after the prompt (:meth:`_prompt_entry`), so that its call solves its own frames only;
        its audio differs a little (docs/streaming.md, "Low-latency first chunk"); None or a number not below
        the first hop: the reference's schedule."""
        p = prompt.tokens.shape[1]
        first_hop = self.token_hop
        st = _StreamState(prompt_pad=math.ceil(p / first_hop) * first_hop - p, hop=first_hop)
        if first_chunk and 0 < first_chunk < st.next_hop():
            st.first_chunk = int(first_chunk)
        st.flow_cache = self.new_stream_cache()
        st.vocoder = self.hift.new_stream()
        # The prompt's shared blocks are loaded before the first chunk (solved then if not kept), so that
        # the first chunk starts after them in every request of the prompt (see _prompt_entry). The low-latency
        # first chunk starts after all the prompt's frames, as the voice's entry holds them (with a bound to keep
        # them in: solved per request they would cost more than they save).
        shared = self.shared_prompt_frames(p) if st.flow_cache is not None else 0
        whole = (bool(st.first_chunk) and st.flow_cache is not None and self._prompt_cache_bytes() > 0
                 and self.flow.block_frames > 0)
        try:
            for tok in token_iter:
                st.tokens.append(tok)
                while len(st.tokens) - st.token_offset >= st.next_hop() + self.lookahead:
                    hop = st.next_hop()
                    end = st.token_offset + hop + self.lookahead
                    with pause(not st.emitted):
                        cache = st.flow_cache
                        if shared or whole:
                            entry = self._prompt_entry(prompt, shared, whole)
                            frames = self._shared_frames(entry, p, shared) if entry is not None and shared else None
                            if frames is not None:
                                st.flow_cache.load(frames)
                            if entry is not None and whole and entry.frames > shared:
                                # this call only: the next one goes on from the shared frames, as the reference
                                cache = FlowStreamCache(max_frames=entry.frames)  # adds no frames to it
                                cache.load(entry)
                            shared, whole = 0, False
                        mel = self._mel(st.tokens[:end], prompt, st.token_offset, streaming=True, finalize=False,
                                        cache=cache)
                        samples = self._vocode_new(st, mel, finalize=False)
                    st.advance(hop)
                    if samples.size:
                        st.emitted = True
                        yield AudioChunk(samples, self.sample_rate, segment, False)
            keep = cut() if cut is not None else None
            if keep is not None and keep < len(st.tokens):
                del st.tokens[max(keep, min(len(st.tokens), st.token_offset + self.lookahead)):]
            # The final call uses full attention (see docs/reference.md#q4-full-attention-final-call): nothing cached
            # applies to it.
            self._drop_cache(st)
            samples = np.zeros(0, dtype=np.float32)
            if st.tokens:  # a chunk always leaves >= lookahead tokens, so the final call has new tokens
                with pause(not st.emitted):
                    mel = self._mel(st.tokens, prompt, st.token_offset, streaming=False, finalize=True)
                    samples = self._vocode_new(st, mel, finalize=True)
            yield AudioChunk(samples, self.sample_rate, segment, True, tuple(st.tokens))
        finally:  # finished, failed, or closed by the consumer: free the cache now, not at GC
            self._drop_cache(st)

    @staticmethod
    def _drop_cache(st: _StreamState) -> None:
        if st.flow_cache is not None:
            st.flow_cache.clear()
            st.flow_cache = None

    def _vocode_new(self, st: _StreamState, mel: torch.Tensor, finalize: bool) -> np.ndarray:
        """The samples the reference emits for this chunk: it re-runs the vocoder over all mel so
        far and keeps the new tail; ``HiFT.stream_step`` computes that tail from the new frames and
        a window of context (equal up to float rounding), so a chunk's cost does not grow with the
        utterance."""
        return self.hift.stream_step(st.vocoder, mel, finalize)[0].float().cpu().numpy()
