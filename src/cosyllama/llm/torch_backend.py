"""The PyTorch LLM backend: :class:`SpeechLM` behind the :class:`LLMBackend` protocol."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import LLMConfig, load_config
from ..device import on_true_fp32, resolve_device
from ..errors import InputError
from ..weights import load_llm_weights
from .backend import Prefill
from .model import KVCache, SpeechLM


class _Sequence:
    __slots__ = ("cache",)

    def __init__(self, cache: KVCache):
        self.cache: KVCache | None = cache


class TorchLLM:
    """Float32 PyTorch backend. Each sequence owns its KV cache; the weights are shared read-only,
    so sequences from different threads never touch each other's state."""

    name = "torch"

    def __init__(self, config: LLMConfig, weights: dict[str, torch.Tensor], device="cpu"):
        self.config = config
        self.device = resolve_device(device)
        with torch.device("meta"):
            model = SpeechLM(config)
        # assign=True keeps the memory-mapped checkpoint tensors: the 151936-row text table only
        # becomes resident for the rows a prefill actually reads.
        model.load_state_dict(weights, strict=True, assign=True)
        self.model = model.to(self.device).eval().requires_grad_(False)

    @classmethod
    def from_dir(cls, model_dir: str | Path, device="cpu") -> "TorchLLM":
        cfg = load_config(model_dir)
        return cls(cfg.llm, load_llm_weights(cfg.model_dir / "llm.pt", cfg.llm), device)

    @on_true_fp32
    @torch.inference_mode()
    def start(self, prefill: Prefill, max_new_tokens: int) -> tuple[_Sequence, torch.Tensor]:
        embeds = self.model.prefill_embeddings(prefill.text_ids, prefill.prompt_speech_tokens)
        seq = _Sequence(self.model.new_cache(len(prefill) + max_new_tokens))
        hidden = self.model.forward_hidden(embeds[None], seq.cache)
        return seq, self.model.logp(hidden[0, -1]).cpu()

    @on_true_fp32
    @torch.inference_mode()
    def step(self, batch: Sequence[tuple[_Sequence, int]]) -> list[torch.Tensor]:
        """Feed one speech token to each listed sequence; return their logps. Two or more sequences
        go through the body together (:meth:`SpeechLM.forward_step`: the weights are read once per
        step, not once per sequence); log-probs equal stepping each alone up to float rounding."""
        for seq, _ in batch:
            if seq.cache is None:
                raise RuntimeError("step() on a released sequence")
        if len({id(seq) for seq, _ in batch}) != len(batch):
            raise InputError("a sequence may appear only once per step")
        if len(batch) == 1:
            seq, tok = batch[0]
            emb = self.model.speech_embedding.weight[tok].view(1, 1, -1)
            hidden = self.model.forward_hidden(emb, seq.cache)
            return [self.model.logp(hidden[0, -1]).cpu()]
        toks = torch.tensor([int(tok) for _, tok in batch], dtype=torch.long, device=self.device)
        hidden = self.model.forward_step(self.model.speech_embedding.weight[toks], [seq.cache for seq, _ in batch])
        return list(self.model.logp(hidden).cpu().unbind(0))

    def release(self, handle: _Sequence) -> None:
        handle.cache = None

    # -- used by parity tests ------------------------------------------------------------------

    @on_true_fp32
    @torch.inference_mode()
    def full_forward_logp(self, embeds: torch.Tensor) -> torch.Tensor:
        """Log-probs (T, vocab) of one uncached causal forward over ``embeds`` (T, hidden)."""
        cache = self.model.new_cache(embeds.shape[0])
        return self.model.logp(self.model.forward_hidden(embeds[None].to(self.device), cache)[0]).cpu()
