"""The PyTorch LLM backend: :class:`SpeechLM` behind the :class:`LLMBackend` protocol."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import LLMConfig, load_config
from ..device import on_true_fp32, resolve_device
from ..errors import InputError
from ..weights import load_llm_weights
from .backend import Prefill, check_max_seq_tokens
from .model import KVCache, SpeechLM


class _Sequence:
    __slots__ = ("cache", "pending")

    def __init__(self, cache: KVCache, pending: torch.Tensor | None = None):
        self.cache: KVCache | None = cache
        self.pending = pending  # (L, hidden) prompt embeddings while the prompt is not all in


class TorchLLM:
    """Float32 PyTorch backend. Each sequence owns its KV cache; the weights are shared read-only,
    so sequences from different threads never touch each other's state. ``max_seq_tokens``:
    positions one sequence may use (prompt + new tokens; default: the model's context length)."""

    name = "torch"
    n_seq_max = None  # no bound of its own: each sequence allocates its cache
    n_threads = None  # shares PyTorch's threads

    def __init__(self, cfg: LLMConfig, weights: dict[str, torch.Tensor], device="cpu",
                 max_seq_tokens: int | None = None):
        self.cfg = cfg
        self.max_seq_tokens = check_max_seq_tokens(max_seq_tokens, cfg)
        self.device = resolve_device(device)
        with torch.device("meta"):
            model = SpeechLM(cfg)
        # assign=True keeps the memory-mapped checkpoint tensors: the 151936-row text table only
        # becomes resident for the rows a prefill actually reads.
        model.load_state_dict(weights, strict=True, assign=True)
        self.model = model.to(self.device).eval().requires_grad_(False)

    def stats(self) -> None:
        """No counters (the scheduler's are the server's)."""
        return None

    def __repr__(self) -> str:
        return f"TorchLLM(device={str(self.device)!r}, precision='fp32', max_seq_tokens={self.max_seq_tokens})"

    @classmethod
    def from_dir(cls, model_dir: str | Path, device="cpu") -> "TorchLLM":
        config = load_config(model_dir)
        return cls(config.llm, load_llm_weights(config.model_dir / "llm.pt", config.llm), device)

    @torch.inference_mode()
    def begin(self, prefill: Prefill, max_new_tokens: int) -> _Sequence:
        """A sequence with its cache for ``prefill`` + ``max_new_tokens``; the prompt runs in
        :meth:`prefill_step` pieces."""
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = len(prefill) + int(max_new_tokens)
        if need > self.max_seq_tokens:
            raise InputError(f"this request needs {need} LLM positions (prompt + max_new_tokens); one sequence "
                             f"may use at most max_seq_tokens={self.max_seq_tokens}")
        embeds = self.model.prefill_embeddings(prefill.text_ids, prefill.prompt_speech_tokens)
        return _Sequence(self.model.new_cache(need), embeds)

    @on_true_fp32
    @torch.inference_mode()
    def prefill_step(self, seq: _Sequence, max_positions: int) -> torch.Tensor | None:
        """Run the next ``max_positions`` prompt positions; the logp of the first new token once the
        prompt is complete, else None. Pieces equal one pass over the prompt up to float rounding."""
        if seq.cache is None or seq.pending is None:
            raise RuntimeError("prefill_step() on a released sequence or one whose prompt is complete")
        lo = seq.cache.length
        hi = min(seq.pending.shape[0], lo + max(1, int(max_positions)))
        hidden = self.model.forward_hidden(seq.pending[None, lo:hi], seq.cache)
        if hi < seq.pending.shape[0]:
            return None
        seq.pending = None
        return self.model.logp(hidden[0, -1]).cpu()

    def start(self, prefill: Prefill, max_new_tokens: int) -> tuple[_Sequence, torch.Tensor]:
        """Create a sequence and run its whole prompt in one pass; ``(handle, logp)``."""
        seq = self.begin(prefill, max_new_tokens)
        return seq, self.prefill_step(seq, len(prefill))

    @on_true_fp32
    @torch.inference_mode()
    def step(self, batch: Sequence[tuple[_Sequence, int]]) -> list[torch.Tensor]:
        """Feed one speech token to each listed sequence; return their logps. Two or more sequences
        go through the body together (:meth:`SpeechLM.forward_step`: the weights are read once per
        step, not once per sequence); log-probs equal stepping each alone up to float rounding."""
        for seq, _ in batch:
            if seq.cache is None or seq.pending is not None:
                raise RuntimeError("step() on a released sequence or one still in its prefill")
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
        handle.cache = handle.pending = None

    # -- used by parity tests ------------------------------------------------------------------

    @on_true_fp32
    @torch.inference_mode()
    def full_forward_logp(self, embeds: torch.Tensor) -> torch.Tensor:
        """Log-probs (T, vocab) of one uncached causal forward over ``embeds`` (T, hidden)."""
        cache = self.model.new_cache(embeds.shape[0])
        return self.model.logp(self.model.forward_hidden(embeds[None].to(self.device), cache)[0]).cpu()
