"""The CosyVoice3 speech-token LLM in plain PyTorch: a Qwen2 decoder with a KV cache plus the two
speech tables (``speech_embedding`` in, ``llm_decoder`` out).

Our own small implementation instead of transformers' classes: a decode step here is a handful of
matmuls with no framework overhead, and the cache semantics are explicit (transformers 5 changed
them under upstream's feet). Parameter names equal the ``llm.pt`` keys after the ``llm.model.model.``
prefix is stripped (see :func:`cosyllama.weights.load_llm_weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LLMConfig, QwenConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (T, head_dim) for the half-split ("rotate half") RoPE, computed in float32
    the way the reference does (inverse frequencies from an integer range, then an outer product)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device)
                                .float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, head_dim); cos/sin: (T, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class KVCache:
    """Pre-allocated per-sequence key/value storage for every layer, grown by doubling.

    k/v: (layers, kv_heads, capacity, head_dim). ``length`` positions are valid.
    """

    def __init__(self, qwen: QwenConfig, capacity: int, device, dtype):
        self.qwen, self.device, self.dtype = qwen, device, dtype
        self.length = 0
        self._alloc(max(16, capacity))

    def _alloc(self, capacity: int) -> None:
        shape = (self.qwen.num_hidden_layers, self.qwen.num_key_value_heads, capacity, self.qwen.head_dim)
        k = torch.empty(shape, device=self.device, dtype=self.dtype)
        v = torch.empty(shape, device=self.device, dtype=self.dtype)
        if self.length:
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v, self.capacity = k, v, capacity

    def reserve(self, extra: int) -> None:
        need = self.length + extra
        if need > self.capacity:
            self._alloc(max(need, 2 * self.capacity))


class Attention(nn.Module):
    def __init__(self, qwen: QwenConfig):
        super().__init__()
        h, kv = qwen.hidden_size, qwen.num_key_value_heads * qwen.head_dim
        self.q_proj = nn.Linear(h, h, bias=True)
        self.k_proj = nn.Linear(h, kv, bias=True)
        self.v_proj = nn.Linear(h, kv, bias=True)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.n_heads, self.n_kv, self.head_dim = qwen.num_attention_heads, qwen.num_key_value_heads, qwen.head_dim

    def forward(self, x: torch.Tensor, cos, sin, cache: KVCache, layer: int) -> torch.Tensor:
        """x: (1, T, hidden) new positions; attends causally to the cache plus themselves."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        start = cache.length
        cache.k[layer, :, start:start + t] = k[0]
        cache.v[layer, :, start:start + t] = v[0]
        keys = cache.k[layer, :, : start + t].unsqueeze(0)
        values = cache.v[layer, :, : start + t].unsqueeze(0)
        if t == 1:
            mask = None  # a single new query sees every cached position
        else:
            # query i (absolute start+i) sees keys j <= start+i
            qi = torch.arange(t, device=x.device)[:, None] + start
            kj = torch.arange(start + t, device=x.device)[None, :]
            mask = kj <= qi
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward_step(self, x: torch.Tensor, cos, sin, caches: list[KVCache], layer: int) -> torch.Tensor:
        """One new position for each of B sequences: x ``(B, 1, hidden)``, cos/sin ``(B, head_dim)``
        at each sequence's own position. The projections run once for the batch (the weights are
        read once); attention runs per sequence over its own cache."""
        b = x.shape[0]
        q = self.q_proj(x).view(b, 1, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, 1, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, 1, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None, None, :], sin[:, None, None, :]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        outs = []
        for j, cache in enumerate(caches):
            end = cache.length + 1
            cache.k[layer, :, end - 1] = k[j, :, 0]
            cache.v[layer, :, end - 1] = v[j, :, 0]
            outs.append(F.scaled_dot_product_attention(q[j:j + 1], cache.k[layer, :, :end].unsqueeze(0),
                                                       cache.v[layer, :, :end].unsqueeze(0), enable_gqa=True))
        return self.o_proj(torch.cat(outs).transpose(1, 2).reshape(b, 1, -1))


class MLP(nn.Module):
    def __init__(self, qwen: QwenConfig):
        super().__init__()
        self.gate_proj = nn.Linear(qwen.hidden_size, qwen.intermediate_size, bias=False)
        self.up_proj = nn.Linear(qwen.hidden_size, qwen.intermediate_size, bias=False)
        self.down_proj = nn.Linear(qwen.intermediate_size, qwen.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, qwen: QwenConfig):
        super().__init__()
        self.self_attn = Attention(qwen)
        self.mlp = MLP(qwen)
        self.input_layernorm = RMSNorm(qwen.hidden_size, qwen.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(qwen.hidden_size, qwen.rms_norm_eps)

    def forward(self, x, cos, sin, cache: KVCache, layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_step(self, x, cos, sin, caches: list[KVCache], layer: int) -> torch.Tensor:
        x = x + self.self_attn.forward_step(self.input_layernorm(x), cos, sin, caches, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class SpeechLM(nn.Module):
    """Qwen2 body + ``speech_embedding`` + ``llm_decoder`` (CosyVoice3LM at inference)."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        q = cfg.qwen
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(q.vocab_size, q.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(q) for _ in range(q.num_hidden_layers))
        self.norm = RMSNorm(q.hidden_size, q.rms_norm_eps)
        self.speech_embedding = nn.Embedding(cfg.vocab_size, q.hidden_size)
        self.llm_decoder = nn.Linear(q.hidden_size, cfg.vocab_size, bias=False)

    def new_cache(self, capacity: int) -> KVCache:
        p = self.llm_decoder.weight
        return KVCache(self.cfg.qwen, capacity, p.device, p.dtype)

    def prefill_embeddings(self, text_ids, prompt_speech_tokens) -> torch.Tensor:
        """lm_input (L, hidden) = [sos] ++ text rows ++ [task] ++ prompt speech rows (see docs/reference.md#prefill)."""
        dev = self.llm_decoder.weight.device
        sp = torch.tensor([self.cfg.sos, self.cfg.task_id], dtype=torch.long, device=dev)
        text = self.embed_tokens(torch.as_tensor(list(text_ids), dtype=torch.long, device=dev))
        speech = self.speech_embedding(torch.as_tensor(list(prompt_speech_tokens), dtype=torch.long, device=dev))
        sos, task = self.speech_embedding(sp)
        return torch.cat([sos[None], text, task[None], speech], dim=0)

    def forward_hidden(self, embeds: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run new positions (1, T, hidden) through the body, appending to ``cache``.
        Returns the final-normed hidden states (1, T, hidden)."""
        t = embeds.shape[1]
        cache.reserve(t)
        pos = torch.arange(cache.length, cache.length + t, device=embeds.device)
        cos, sin = rope_cos_sin(pos, self.cfg.qwen.head_dim, self.cfg.qwen.rope_theta)
        x = embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i)
        cache.length += t
        return self.norm(x)

    def forward_step(self, embeds: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """One new position for each of B sequences (``embeds (B, hidden)``, one cache each, at its
        own length) in one pass: the linear layers see a batch of B rows. Returns the final-normed
        hidden states ``(B, hidden)``; each cache grows by one."""
        for cache in caches:
            cache.reserve(1)
        pos = torch.tensor([cache.length for cache in caches], device=embeds.device)
        cos, sin = rope_cos_sin(pos, self.cfg.qwen.head_dim, self.cfg.qwen.rope_theta)
        x = embeds[:, None, :]
        for i, layer in enumerate(self.layers):
            x = layer.forward_step(x, cos, sin, caches, i)
        for cache in caches:
            cache.length += 1
        return self.norm(x)[:, 0]

    def logp(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> float32 log-probs (..., 6761)."""
        return torch.log_softmax(self.llm_decoder(hidden_last).float(), dim=-1)
