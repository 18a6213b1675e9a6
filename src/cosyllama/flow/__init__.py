"""Flow stage: speech tokens -> 80-band log-mel (see docs/reference.md#flow).

Pipeline of one call: token embedding -> pre-lookahead conv (3-token right context) -> repeat by
``token_mel_ratio`` -> conditional flow matching: 10 Euler steps of a DiT with classifier-free
guidance, started from a fixed noise buffer. Module attribute names equal the keys of ``flow.pt``
so the checkpoint loads strictly.

Streaming (see docs/reference.md#flow-streaming): every call covers prompt + all tokens so far. The caller chooses
``streaming`` (50-frame block-causal DiT attention) and ``finalize`` (whether the last 3 tokens are
real content or only look-ahead), and slices off what it already emitted. The reference recomputes
everything on every call; a per-request :class:`FlowStreamCache` passed to :meth:`Flow.inference`
lets a streaming, non-final call compute only the frames after the blocks an earlier call of the
same request already finished (same result; see the class).

Modules: ``dit`` (the estimator and the pre-lookahead layer), ``fast_dit`` (the bf16 solver),
``cache`` (the streaming cache), ``cfm`` (noise, time grid, Euler/CFG solver), ``model`` (:class:`Flow`).
"""

from .cache import CONV_CONTEXT, DEFAULT_STREAM_CACHE_MB, FlowStreamCache
from .cfm import CFM, NOISE_FRAMES, NOISE_SEED, cosine_t_span, flow_noise
from .dit import DiT, PreLookaheadLayer, chunk_attention_mask
from .fast_dit import FastDiT
from .model import Flow, FlowInputs

__all__ = ["CFM", "CONV_CONTEXT", "DEFAULT_STREAM_CACHE_MB", "DiT", "FastDiT", "Flow", "FlowInputs",
           "FlowStreamCache", "NOISE_FRAMES", "NOISE_SEED", "PreLookaheadLayer", "chunk_attention_mask",
           "cosine_t_span", "flow_noise"]
