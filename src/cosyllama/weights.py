"""Strict loading of the official checkpoints through explicit key tables.

Each checkpoint has one table ``{checkpoint key: expected shape}`` built from the config. A file with
a missing, unexpected or mis-shaped tensor is refused with the offending names; nothing is loaded
partially. Tensors are memory-mapped (``mmap=True``) so that tables the model only indexes (the
151936-row text embedding) cost no resident memory until rows are touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from .config import LLMConfig
from .errors import CheckpointError

_MAX_NAMES = 12  # how many offending keys a message lists before summarising


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """``torch.load(weights_only=True, mmap=True)`` with readable errors; returns a flat state dict."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises RuntimeError/UnpicklingError/EOFError/... for bad files
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path}: expected a state dict of tensors")
    return dict(sd)


def _names(keys) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:_MAX_NAMES])
    return shown + (f" (and {len(keys) - _MAX_NAMES} more)" if len(keys) > _MAX_NAMES else "")


def check_keys(sd: Mapping[str, torch.Tensor], table: Mapping[str, tuple[int, ...]], what: str) -> None:
    """Raise :class:`CheckpointError` naming every missing, unexpected or mis-shaped key."""
    problems = []
    missing = table.keys() - sd.keys()
    unexpected = sd.keys() - table.keys()
    if missing:
        problems.append(f"missing keys: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_names(unexpected)}")
    bad = [f"{k} {tuple(sd[k].shape)} (expected {tuple(table[k])})"
           for k in sorted(table.keys() & sd.keys()) if tuple(sd[k].shape) != tuple(table[k])]
    if bad:
        problems.append("wrong shapes: " + "; ".join(bad[:_MAX_NAMES]))
    if problems:
        raise CheckpointError(f"{what} does not match this model's configuration: " + "; ".join(problems))


def check_float(sd: Mapping[str, torch.Tensor], what: str) -> None:
    bad = [k for k, v in sd.items() if not v.is_floating_point()]
    if bad:
        raise CheckpointError(f"{what}: expected floating-point tensors, got integer tensors for {_names(bad)}")


# ----------------------------------------------------------------------------------------------
# llm.pt

LLM_BODY_PREFIX = "llm.model.model."
LLM_LM_HEAD = "llm.model.lm_head.weight"  # present for upstream's strict load; never used (spec §6.1)


def llm_key_table(cfg: LLMConfig) -> dict[str, tuple[int, ...]]:
    """Every key of ``llm.pt`` and its shape (spec §15.1)."""
    q = cfg.qwen
    h, kv = q.hidden_size, q.num_key_value_heads * q.head_dim
    p = LLM_BODY_PREFIX
    table: dict[str, tuple[int, ...]] = {f"{p}embed_tokens.weight": (q.vocab_size, h)}
    for i in range(q.num_hidden_layers):
        lp = f"{p}layers.{i}."
        table.update({
            f"{lp}self_attn.q_proj.weight": (h, h), f"{lp}self_attn.q_proj.bias": (h,),
            f"{lp}self_attn.k_proj.weight": (kv, h), f"{lp}self_attn.k_proj.bias": (kv,),
            f"{lp}self_attn.v_proj.weight": (kv, h), f"{lp}self_attn.v_proj.bias": (kv,),
            f"{lp}self_attn.o_proj.weight": (h, h),
            f"{lp}mlp.gate_proj.weight": (q.intermediate_size, h),
            f"{lp}mlp.up_proj.weight": (q.intermediate_size, h),
            f"{lp}mlp.down_proj.weight": (h, q.intermediate_size),
            f"{lp}input_layernorm.weight": (h,), f"{lp}post_attention_layernorm.weight": (h,),
        })
    table[f"{p}norm.weight"] = (h,)
    table[LLM_LM_HEAD] = (q.vocab_size, h)
    table["speech_embedding.weight"] = (cfg.vocab_size, h)
    table["llm_decoder.weight"] = (cfg.vocab_size, h)
    return table


def load_llm_weights(path: str | Path, cfg: LLMConfig) -> dict[str, torch.Tensor]:
    """Read and check ``llm.pt``. Returns the state dict with the unused ``lm_head`` dropped and the
    Qwen body prefix stripped (``embed_tokens.weight``, ``layers.0...``, ``norm.weight``,
    ``speech_embedding.weight``, ``llm_decoder.weight``)."""
    sd = read_checkpoint(path)
    check_keys(sd, llm_key_table(cfg), f"{path}")
    check_float(sd, str(path))
    out = {}
    for k, v in sd.items():
        if k == LLM_LM_HEAD:
            continue
        out[k[len(LLM_BODY_PREFIX):] if k.startswith(LLM_BODY_PREFIX) else k] = v
    return out
