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

from .config import FlowConfig, HiftConfig, LLMConfig
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
# Present for upstream's strict load; never used (see docs/reference.md#llm-weights).
LLM_LM_HEAD = "llm.model.lm_head.weight"


def llm_key_table(cfg: LLMConfig) -> dict[str, tuple[int, ...]]:
    """Every key of ``llm.pt`` and its shape (see docs/reference.md#llm-weights)."""
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


# ----------------------------------------------------------------------------------------------
# flow.pt


def flow_key_table(cfg: FlowConfig) -> dict[str, tuple[int, ...]]:
    """Every key of ``flow.pt`` and its shape (see docs/reference.md#flow-weights)."""
    d, mel = cfg.dit_dim, cfg.mel_dim
    ff, pc = cfg.dit_dim * cfg.dit_ff_mult, cfg.pre_lookahead_channels
    inner = cfg.dit_heads * cfg.dit_dim_head
    k = cfg.pre_lookahead_len + 1
    table: dict[str, tuple[int, ...]] = {
        "input_embedding.weight": (cfg.vocab_size, cfg.input_size),
        "spk_embed_affine_layer.weight": (cfg.output_size, cfg.spk_embed_dim),
        "spk_embed_affine_layer.bias": (cfg.output_size,),
        "pre_lookahead_layer.conv1.weight": (pc, cfg.input_size, k), "pre_lookahead_layer.conv1.bias": (pc,),
        "pre_lookahead_layer.conv2.weight": (cfg.input_size, pc, 3),
        "pre_lookahead_layer.conv2.bias": (cfg.input_size,),
    }
    e = "decoder.estimator."
    table.update({
        f"{e}time_embed.time_mlp.0.weight": (d, 256), f"{e}time_embed.time_mlp.0.bias": (d,),
        f"{e}time_embed.time_mlp.2.weight": (d, d), f"{e}time_embed.time_mlp.2.bias": (d,),
        f"{e}input_embed.proj.weight": (d, 2 * mel + cfg.mu_dim + cfg.spk_dim), f"{e}input_embed.proj.bias": (d,),
        f"{e}rotary_embed.inv_freq": (cfg.dit_dim_head // 2,),
        f"{e}norm_out.linear.weight": (2 * d, d), f"{e}norm_out.linear.bias": (2 * d,),
        f"{e}proj_out.weight": (cfg.out_channels, d), f"{e}proj_out.bias": (cfg.out_channels,),
    })
    for c in ("conv1", "conv2"):
        table[f"{e}input_embed.conv_pos_embed.{c}.0.weight"] = (d, d // 16, 31)
        table[f"{e}input_embed.conv_pos_embed.{c}.0.bias"] = (d,)
    for b in range(cfg.dit_depth):
        p = f"{e}transformer_blocks.{b}."
        table.update({
            f"{p}attn_norm.linear.weight": (6 * d, d), f"{p}attn_norm.linear.bias": (6 * d,),
            f"{p}attn.to_q.weight": (inner, d), f"{p}attn.to_q.bias": (inner,),
            f"{p}attn.to_k.weight": (inner, d), f"{p}attn.to_k.bias": (inner,),
            f"{p}attn.to_v.weight": (inner, d), f"{p}attn.to_v.bias": (inner,),
            f"{p}attn.to_out.0.weight": (d, inner), f"{p}attn.to_out.0.bias": (d,),
            f"{p}ff.ff.0.0.weight": (ff, d), f"{p}ff.ff.0.0.bias": (ff,),
            f"{p}ff.ff.2.weight": (d, ff), f"{p}ff.ff.2.bias": (d,),
        })
    return table


def load_flow_weights(path: str | Path, cfg: FlowConfig) -> dict[str, torch.Tensor]:
    """Read and check ``flow.pt``; returns its state dict unchanged (keys equal the module's)."""
    sd = read_checkpoint(path)
    check_keys(sd, flow_key_table(cfg), f"{path}")
    check_float(sd, str(path))
    return sd


# ----------------------------------------------------------------------------------------------
# hift.pt

HIFT_PREFIX = "generator."  # checkpoints saved from the GAN wrapper carry it; see docs/reference.md#hift-weights
_WN_STYLES = {  # weight-norm key suffixes: (gain g, direction v)
    "new": ("parametrizations.weight.original0", "parametrizations.weight.original1"),
    "old": ("weight_g", "weight_v"),
}


def _hift_layers(cfg: HiftConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(weight-normalised conv prefix -> weight shape, plain key -> shape) for ``hift.pt``."""
    wn: dict[str, tuple[int, ...]] = {}
    plain: dict[str, tuple[int, ...]] = {}
    base, ups = cfg.base_channels, cfg.upsample_rates
    bins = cfg.istft_n_fft // 2 + 1
    wn["conv_pre"] = (base, cfg.in_channels, cfg.conv_pre_look_right + 1)
    for i, k in enumerate(cfg.upsample_kernel_sizes):
        wn[f"ups.{i}"] = (base >> (i + 1), base >> i, k)

    def resblock(prefix: str, ch: int, k: int, dilations) -> None:
        for j in range(len(dilations)):
            wn[f"{prefix}.convs1.{j}"] = (ch, ch, k)
            wn[f"{prefix}.convs2.{j}"] = (ch, ch, k)
            plain[f"{prefix}.activations1.{j}.alpha"] = (ch,)
            plain[f"{prefix}.activations2.{j}.alpha"] = (ch,)

    for i in range(len(ups)):
        ch = base >> (i + 1)
        # source_downs.i brings the source STFT from its frame rate down to stage i's rate.
        stride = int(torch.tensor(ups[i + 1:]).prod()) if i + 1 < len(ups) else 1
        plain[f"source_downs.{i}.weight"] = (ch, 2 * bins, 2 * stride if stride > 1 else 1)
        plain[f"source_downs.{i}.bias"] = (ch,)
        resblock(f"source_resblocks.{i}", ch, cfg.source_resblock_kernel_sizes[i],
                 cfg.source_resblock_dilation_sizes[i])
        for j, (k, dil) in enumerate(zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)):
            resblock(f"resblocks.{i * len(cfg.resblock_kernel_sizes) + j}", ch, k, dil)
    wn["conv_post"] = (2 * bins, base >> len(ups), 7)
    cc = cfg.f0_cond_channels
    wn["f0_predictor.condnet.0"] = (cc, cfg.f0_in_channels, 4)
    for i in (2, 4, 6, 8):
        wn[f"f0_predictor.condnet.{i}"] = (cc, cc, 3)
    plain["f0_predictor.classifier.weight"] = (cfg.f0_num_class, cc)
    plain["f0_predictor.classifier.bias"] = (cfg.f0_num_class,)
    plain["m_source.l_linear.weight"] = (1, cfg.nb_harmonics + 1)
    plain["m_source.l_linear.bias"] = (1,)
    return wn, plain


def hift_key_table(cfg: HiftConfig, style: str = "new") -> dict[str, tuple[int, ...]]:
    """Every key of ``hift.pt`` (without the ``generator.`` prefix) and its shape (see docs/reference.md#hift-weights).
    ``style`` names the weight-norm keys: "new" (``parametrizations.weight.original0/1``) or
    "old" (``weight_g`` / ``weight_v``)."""
    g_name, v_name = _WN_STYLES[style]
    wn, plain = _hift_layers(cfg)
    table = dict(plain)
    for p, shape in wn.items():
        table[f"{p}.{g_name}"] = (shape[0], 1, 1)
        table[f"{p}.{v_name}"] = shape
        table[f"{p}.bias"] = (shape[0],)
    return table


def load_hift_weights(path: str | Path, cfg: HiftConfig) -> dict[str, torch.Tensor]:
    """Read and check ``hift.pt``; returns a state dict with weight norm folded
    (``p.weight = g * v / ||v||``, norm over all dims but 0) and any ``generator.`` prefix removed.

    The folded weights are float32 like upstream's module parameters, except ``f0_predictor.*``,
    which upstream converts to float64 after loading (float32 -> float64), so we do the same."""
    raw = read_checkpoint(path)
    if raw and all(k.startswith(HIFT_PREFIX) for k in raw):
        raw = {k[len(HIFT_PREFIX):]: v for k, v in raw.items()}
    old = any(k.endswith((".weight_g", ".weight_v")) for k in raw)
    style = "old" if old else "new"
    check_keys(raw, hift_key_table(cfg, style), f"{path} ({style}-style weight-norm keys)")
    check_float(raw, str(path))
    g_name, v_name = _WN_STYLES[style]
    wn, plain = _hift_layers(cfg)
    out: dict[str, torch.Tensor] = {}

    def dtype_of(key: str) -> torch.dtype:
        return torch.float64 if key.startswith("f0_predictor.") else torch.float32

    for p in wn:
        dt = dtype_of(p)
        # Round through float32 first: upstream loads into float32 parameters before any cast.
        g = raw[f"{p}.{g_name}"].float().to(dt)
        v = raw[f"{p}.{v_name}"].float().to(dt)
        # The very function upstream's weight-norm parametrization evaluates, so the folded weight
        # carries the same rounding.
        out[f"{p}.weight"] = torch._weight_norm(v, g, 0)
        out[f"{p}.bias"] = raw[f"{p}.bias"].float().to(dt)
    for k in plain:
        out[k] = raw[k].float().to(dtype_of(k))
    return out
