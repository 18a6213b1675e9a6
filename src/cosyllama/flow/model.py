"""The whole flow stage, :class:`Flow`: speech tokens + prompt -> mel."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config import FlowConfig, ModelConfig
from ..device import on_true_fp32, resolve_device
from ..errors import InputError
from ..precision import is_auto, precision_name, resolve_precision
from .auto import AUTO_ENV, AutoChoice, choose_fastest
from .cache import FlowStreamCache
from .cfm import CFM
from .check import Candidate, CheckResult, check_candidate
from .dit import PreLookaheadLayer

log = logging.getLogger("cosyllama.flow")


@dataclass(frozen=True)
class PrecisionChoice:
    """Which flow path runs and why: ``requested`` (as asked), ``chosen`` (fp32/bf16/int8),
    ``check`` (the fidelity check ``auto`` ran on a lossy candidate, or None) and ``reason``."""

    requested: str
    chosen: str
    reason: str
    check: CheckResult | None = None
    auto: AutoChoice | None = None  # the timings behind a measured ``auto``


@dataclass(frozen=True)
class FlowInputs:
    """Decoder inputs built from tokens (for inspection and tests). mu, cond ``(1, 80, N)``,
    spks ``(1, 80)``; ``prompt_frames`` = mel frames of the prompt at the start of N."""

    mu: torch.Tensor
    cond: torch.Tensor
    spks: torch.Tensor
    prompt_frames: int


class Flow(nn.Module):
    """CosyVoice3 flow: ``inference(token, prompt_token, prompt_feat, embedding, ...)`` -> mel."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.input_size, cfg.pre_lookahead_channels,
                                                     cfg.pre_lookahead_len)
        self.decoder = CFM(cfg)
        self.weights_file: Path | None = None  # the flow.pt loaded (the fidelity check's cache key)
        self.weights_file_key: tuple | None = None
        self.precision_choice = PrecisionChoice("fp32", "fp32", "the default")

    @classmethod
    def from_config(cls, config: ModelConfig, device: str | torch.device = "cpu", precision: str = "fp32",
                    n_timesteps: int | None = None) -> "Flow":
        """Build from the model's parsed config and load its ``flow.pt`` strictly; float32
        weights, eval mode.

        ``precision``: ``"fp32"`` (reference), ``"bf16"`` or ``"auto"`` (see :meth:`set_precision`).
        ``n_timesteps``: Euler steps (default: the config's 10); fewer trade quality for speed."""
        from ..weights import load_flow_weights

        dev = resolve_device(device)
        flow = cls(config.flow)
        flow.load_state_dict(load_flow_weights(Path(config.model_dir) / "flow.pt", config.flow), strict=True)
        flow = flow.to(dev).eval()
        flow.weights_file = Path(config.model_dir) / "flow.pt"
        flow.weights_file_key = flow.decoder.weights_key()
        if n_timesteps is not None:  # first: the precision's check (and calibration) runs at this step count
            flow.set_n_timesteps(n_timesteps)
        flow.set_precision(precision)
        return flow

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu", precision: str = "fp32",
                 n_timesteps: int | None = None) -> "Flow":
        """:meth:`from_config` on ``load_config(model_dir)``."""
        from ..config import load_config

        return cls.from_config(load_config(model_dir), device, precision, n_timesteps)

    @property
    def block_frames(self) -> int:
        """Mel frames per attention block of the streaming (block-causal) DiT; 0: no blocks."""
        return self.cfg.static_chunk_size

    def solver_key(self) -> tuple:
        """What a solve's frames depend on besides its inputs: this solver, its weights, precision
        and step count. Equal keys give equal frames for equal inputs."""
        dec = self.decoder
        return (id(dec), dec.weights_key(), str(self.precision), dec.int8_engine, dec.n_timesteps)

    @property
    def device(self) -> torch.device:
        return self.input_embedding.weight.device

    @property
    def precision(self) -> torch.dtype:
        """Compute dtype of the DiT: ``torch.float32`` (reference), ``torch.bfloat16`` or
        :data:`cosyllama.precision.INT8` (int8 block matrices, float32 activations)."""
        return self.decoder.compute_dtype

    def set_precision(self, precision: str | torch.dtype | None, remeasure: bool = False) -> torch.dtype:
        """Choose the DiT compute precision: ``"fp32"`` — the reference float32 solver;
        ``"bf16"`` — bfloat16 matrix products with float32 LayerNorm statistics, residual stream and
        interfaces (:class:`FastDiT`); ``"int8"`` (CPU) — the same solver with the block matrices on
        PyTorch's int8 kernels, everything else float32; ``"auto"`` — this device's candidate
        (bf16 where it computes bf16 natively, int8 on other x86 CPUs; see
        :func:`cosyllama.precision.auto_candidate`), kept only if it passes the fidelity check on
        these weights (:mod:`cosyllama.flow.check`, cached per weight file), else fp32; on the CPU the
        candidates that pass are timed and the fastest kept, unless the machine is too busy to tell
        (then the rule of thumb runs, uncached). ``remeasure``: time again even where a verdict is
        cached or the load is high (a trusted result replaces the cached verdict).
        ``precision_choice`` and the ``cosyllama.flow`` log say which path runs and why. Returns the
        dtype chosen; raises :class:`InputError` for an unknown name. The float32 weights stay (the
        fp32 path needs them); bf16/int8 add pre-packed copies of the block matrices (their size: see
        docs/benchmarks.md#memory-of-the-streaming-caches), made here. Call it before sharing the
        module between threads; ``inference`` is unchanged."""
        dtype = resolve_precision(precision, self.device)
        requested = "auto" if is_auto(precision) else precision_name(dtype)
        check = None
        if requested == "auto" and self.device.type == "cpu" and \
                os.environ.get(AUTO_ENV, "measure").strip().lower() != "rule":
            return self._choose_by_timing(remeasure)
        rule = f" (rule of thumb: {AUTO_ENV}=rule)" if self.device.type == "cpu" else ""
        if requested != "auto":
            reason = "fixed by --precision"
        elif dtype == torch.float32:
            reason = f"auto{rule}: no faster path on this device (no native bf16, no int8 kernels)"
        else:
            check = check_candidate(self, dtype)
            if check.passed:
                why = "this device computes bf16 natively" if dtype == torch.bfloat16 else \
                    "int8 matrix products (this CPU has no native bf16)"
                reason = f"auto{rule}: {why}; {check.summary()}"
            else:
                reason = f"auto{rule}: fell back to fp32, {check.summary()} misses the bound"
                dtype = torch.float32
        self.decoder.set_compute_dtype(dtype)
        self.precision_choice = PrecisionChoice(requested, precision_name(dtype), reason, check)
        log.info("flow precision %s (%s)", precision_name(dtype), reason)
        return dtype

    def _choose_by_timing(self, remeasure: bool = False) -> torch.dtype:
        """``auto`` on the CPU: the fastest path that passes the fidelity check (:func:`choose_fastest`),
        or its rule of thumb where the machine was too busy to measure."""
        auto = choose_fastest(self, remeasure)
        dtype = auto.chosen.dtype
        reason = auto.reason()
        self.precision_choice = PrecisionChoice("auto", precision_name(dtype), reason, auto.check, auto)
        log.info("flow precision %s (%s)", auto.chosen.name, reason)
        return dtype

    def attention_words(self) -> str | None:
        """For the CPU line: how this flow runs attention where its solver computes in bf16 on the CPU (bf16, the
        mixed int8 paths; :meth:`cosyllama.flow.native_attention.Choice.words`); None for any other flow."""
        from ..precision import INT8
        from . import native_attention

        engine = self.decoder.int8_engine if self.precision == INT8 else None
        bf16 = Candidate(self.precision, engine).attention_dtype == torch.bfloat16
        c = native_attention.for_flow(self) if bf16 else None
        return c.words() if c is not None else None

    def set_n_timesteps(self, n: int) -> None:
        """Euler steps of the solver (reference: 10). Fewer steps are faster and change the mel
        (``cosyllama bench --flow-precisions fp32,bf16,bf16-steps5`` measures both); an explicit
        quality/speed trade only."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 100:
            raise InputError(f"flow n_timesteps must be an integer from 1 to 100, got {n!r}")
        self.decoder.n_timesteps = n
        if self.decoder.static_scales is not None:  # static int8 scales are per step: take this grid's
            Candidate(self.precision, self.decoder.int8_engine).apply(self)

    @on_true_fp32
    def prepare(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                embedding: torch.Tensor, finalize: bool = True) -> FlowInputs:
        """Everything before the ODE solver (see docs/reference.md#flow-inputs); see :meth:`inference`."""
        self._check_inputs(token, prompt_token, prompt_feat, embedding, finalize)
        dev = self.device
        spks = self.spk_embed_affine_layer(F.normalize(embedding.to(dev, torch.float32), dim=1))
        emb = self.input_embedding(self._ids(prompt_token, token))
        look = self.cfg.pre_lookahead_len
        if finalize:
            h = self.pre_lookahead_layer(emb)
        else:
            h = self.pre_lookahead_layer(emb[:, :-look], emb[:, -look:])
        mu = h.repeat_interleave(self.cfg.token_mel_ratio, dim=1).transpose(1, 2)
        prompt_frames = prompt_feat.shape[1]
        cond = torch.zeros_like(mu)
        cond[:, :, :prompt_frames] = prompt_feat.to(dev, torch.float32).transpose(1, 2)
        return FlowInputs(mu=mu, cond=cond, spks=spks, prompt_frames=prompt_frames)

    @on_true_fp32
    @torch.inference_mode()
    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, streaming: bool = False, finalize: bool = True,
                  cache: FlowStreamCache | None = None) -> torch.Tensor:
        """Synthesize the mel of ``token``, conditioned on a prompt.

        Args:
            token: ``(1, T)`` int speech tokens (25 Hz) to synthesize.
            prompt_token: ``(1, P)`` int prompt speech tokens (P may be 0).
            prompt_feat: ``(1, 2P, 80)`` float prompt log-mel (24 kHz, 50 frames/s).
            embedding: ``(1, 192)`` float raw speaker embedding (L2-normalised here).
            streaming: block-causal DiT attention (``static_chunk_size``-frame blocks) instead of full.
            finalize: True when ``token`` ends the utterance (3 zero frames of look-ahead); False when
                its last 3 tokens are only look-ahead context, so they produce no frames.
            cache: the request's :class:`FlowStreamCache`. Used by streaming, non-final calls only:
                frames of attention blocks an earlier call of the request completed are taken from
                it instead of recomputed (same mel up to float rounding: ~1e-6 at fp32, where the
                reference DiT runs the same operations on the new rows only), and this call's
                complete blocks are added to it. Ignored by other calls.

        Returns:
            ``(1, 80, 2T)`` float32 natural-log mel (``2(T-3)`` frames when ``finalize`` is False),
            prompt frames removed, on this module's device.
        """
        inp = self.prepare(token, prompt_token, prompt_feat, embedding, finalize)
        if cache is not None and streaming and not finalize:
            dev = self.device
            key = (inp.prompt_frames, prompt_feat.to(dev, torch.float32), embedding.to(dev, torch.float32))
            feat = self.decoder.forward_cached(inp.mu, inp.spks, inp.cond, cache, key,
                                               self._ids(prompt_token, token))
        else:
            feat = self.decoder(inp.mu, inp.spks, inp.cond, streaming)
        return feat[:, :, inp.prompt_frames:]

    @on_true_fp32
    @torch.inference_mode()
    def inference_batch(self, requests: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                        streaming: bool = False, finalize: bool = True) -> list[torch.Tensor]:
        """:meth:`inference` of several requests in one batched ODE solve (no stream cache).

        ``requests``: ``(token, prompt_token, prompt_feat, embedding)`` tuples as :meth:`inference`
        takes them, all of equal length in mel frames (prompt + tokens; the split between them
        may differ). Returns each request's mel, in order. The batch rows share no arithmetic (see
        :meth:`CFM.forward`): each mel equals the request's own :meth:`inference` up to float
        rounding of differently blocked matrix products (int8 with dynamic scales: its rows are
        solved one by one).
        Whether a batch is faster than the calls one after another depends on the device:
        ``cosyllama bench --parts flow-batch`` measures it."""
        if not requests:
            return []
        inps = [self.prepare(*r, finalize=finalize) for r in requests]
        lengths = sorted({inp.mu.shape[2] for inp in inps})
        if len(lengths) > 1:
            raise InputError(f"a flow batch needs requests of equal length in mel frames (prompt included); "
                             f"got lengths {lengths}")
        feat = self.decoder(torch.cat([i.mu for i in inps]), torch.cat([i.spks for i in inps]),
                            torch.cat([i.cond for i in inps]), streaming)
        return [feat[k:k + 1, :, inp.prompt_frames:] for k, inp in enumerate(inps)]

    def _ids(self, prompt_token: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Prompt + token ids ``(1, P+T)`` as the token embedding reads them (ids clamped at >= 0)."""
        return torch.cat([prompt_token, token], dim=1).to(self.device, torch.long).clamp_min(0)

    def _check_inputs(self, token, prompt_token, prompt_feat, embedding, finalize) -> None:
        c = self.cfg
        for name, t in (("token", token), ("prompt_token", prompt_token)):
            if t.dim() != 2 or t.shape[0] != 1 or t.is_floating_point():
                raise InputError(f"flow {name} must be an integer tensor of shape (1, n), got "
                                 f"{t.dtype} {tuple(t.shape)}")
            if t.numel() and int(t.max()) >= c.vocab_size:
                raise InputError(f"flow {name} holds id {int(t.max())}; speech token ids are 0..{c.vocab_size - 1}")
        if prompt_feat.dim() != 3 or prompt_feat.shape[0] != 1 or prompt_feat.shape[2] != c.output_size \
                or prompt_feat.shape[1] != c.token_mel_ratio * prompt_token.shape[1]:
            raise InputError(f"flow prompt_feat must have shape (1, {c.token_mel_ratio}*P, {c.output_size}) "
                             f"with P = {prompt_token.shape[1]} prompt tokens, got {tuple(prompt_feat.shape)}")
        if tuple(embedding.shape) != (1, c.spk_embed_dim):
            raise InputError(f"flow embedding must have shape (1, {c.spk_embed_dim}), got {tuple(embedding.shape)}")
        need = 1 + (0 if finalize else c.pre_lookahead_len)
        if token.shape[1] < need:
            raise InputError(f"flow needs at least {need} tokens with finalize={finalize}, got {token.shape[1]}")
