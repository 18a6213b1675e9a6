"""Model configuration read from an official CosyVoice3 model directory.

``cosyvoice3.yaml`` is a HyperPyYAML file whose tags (``!new:``, ``!name:``, ``!apply:``, ``!ref``)
would import and run code. We read it as *data*: tags become inert :class:`Tagged` records, ``!ref``
expressions are resolved against the document (simple arithmetic only), and nothing is imported or
executed. The values we need land in frozen dataclasses.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .defaults import LLM_WEIGHTS
from .errors import InputError, ModelDirError

YAML_NAME = "cosyvoice3.yaml"
QWEN_DIR = "CosyVoice-BlankEN"

# Files the official Fun-CosyVoice3-0.5B directory must hold; value = what it is for.
# See docs/reference.md#required-files.
REQUIRED_FILES = {
    YAML_NAME: "model configuration",
    f"{QWEN_DIR}/config.json": "Qwen2 hyper-parameters",
    f"{QWEN_DIR}/vocab.json": "Qwen2 BPE vocabulary",
    f"{QWEN_DIR}/merges.txt": "Qwen2 BPE merges",
    "llm.pt": "speech-token LLM weights",
    "flow.pt": "flow-matching DiT weights",
    "hift.pt": "HiFT vocoder weights",
    "campplus.onnx": "speaker encoder",
    "speech_tokenizer_v3.onnx": "speech tokenizer",
}

# sos, eos, task, fill and 196 reserved ids after the speech codes; see docs/reference.md#special-ids
N_SPECIAL_SPEECH_IDS = 200
FLOW_N_TIMESTEPS = 10  # Euler steps; fixed by the reference's flow.inference, not in the yaml
# The reference's frontend trims a prompt to 2 mel frames per speech token at a 24 kHz sample rate,
# whatever the yaml's token_mel_ratio (see docs/reference.md#yaml-values-the-reference-ignores).
PROMPT_MEL_PER_TOKEN = 2
PROMPT_ALIGN_RATE = 24000


# ----------------------------------------------------------------------------------------------
# Safe HyperPyYAML reading


@dataclass(frozen=True)
class Tagged:
    """An inert stand-in for a ``!new:``/``!name:``/``!apply:`` node: never instantiated."""

    kind: str  # "new" | "name" | "apply"
    target: str  # dotted name as written, e.g. "cosyvoice.llm.llm.CosyVoice3LM"
    args: Any  # mapping, list or scalar given to the tag


@dataclass(frozen=True)
class _Ref:
    expr: str


class _SafeHyperLoader(yaml.SafeLoader):
    """SafeLoader that turns HyperPyYAML tags into data."""


def _construct_tagged(kind: str):
    def construct(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Tagged:
        if isinstance(node, yaml.MappingNode):
            args: Any = loader.construct_mapping(node, deep=True)
        elif isinstance(node, yaml.SequenceNode):
            args = loader.construct_sequence(node, deep=True)
        else:
            args = loader.construct_scalar(node)
        return Tagged(kind, suffix, args)

    return construct


for _kind in ("new", "name", "apply"):
    _SafeHyperLoader.add_multi_constructor(f"!{_kind}:", _construct_tagged(_kind))
_SafeHyperLoader.add_constructor("!ref", lambda loader, node: _Ref(loader.construct_scalar(node)))
# Other HyperPyYAML tags (!copy, !tuple, !include, !PLACEHOLDER) do not occur in cosyvoice3.yaml;
# any unknown tag makes SafeLoader raise, which we report as a bad yaml.

_REF_RE = re.compile(r"<([^<>]+)>")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv}


def _eval_arith(node: ast.AST) -> Any:
    """Evaluate a parsed expression made only of numeric literals and + - * / //."""
    if isinstance(node, ast.Expression):
        return _eval_arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_arith(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval_arith(node.left), _eval_arith(node.right))
    raise ValueError("only numbers and + - * / // are allowed in a !ref expression")


def _lookup(doc: dict, path: str) -> Any:
    cur: Any = doc
    for part in path.split("/"):
        if isinstance(cur, Tagged):
            cur = cur.args
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(path)
        cur = cur[part]
    return cur


def _resolve(value: Any, doc: dict, depth: int = 0) -> Any:
    if depth > 50:
        raise ValueError("!ref chain too deep (circular reference?)")
    if isinstance(value, _Ref):
        names = _REF_RE.findall(value.expr)
        resolved = {n: _resolve(_lookup(doc, n), doc, depth + 1) for n in names}
        if value.expr.strip() == f"<{names[0]}>" and len(names) == 1:
            return resolved[names[0]]
        text = _REF_RE.sub(lambda m: repr(resolved[m.group(1)]), value.expr)
        return _eval_arith(ast.parse(text, mode="eval"))
    if isinstance(value, Tagged):
        return Tagged(value.kind, value.target, _resolve(value.args, doc, depth))
    if isinstance(value, dict):
        return {k: _resolve(v, doc, depth) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, doc, depth) for v in value]
    return value


def read_hyperpyyaml(path: Path, overrides: dict | None = None) -> dict:
    """Read a HyperPyYAML file as plain data with every ``!ref`` resolved; executes nothing."""
    try:
        doc = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_SafeHyperLoader)
    except yaml.YAMLError as e:
        raise ModelDirError(f"{path}: not a readable cosyvoice3 yaml: {e}") from e
    if not isinstance(doc, dict):
        raise ModelDirError(f"{path}: expected a mapping at the top level")
    doc.update(overrides or {})
    try:
        return _resolve(doc, doc)
    except (KeyError, ValueError, SyntaxError) as e:
        raise ModelDirError(f"{path}: cannot resolve a !ref expression: {e}") from e


# ----------------------------------------------------------------------------------------------
# Dataclasses


@dataclass(frozen=True)
class QwenConfig:
    """Qwen2 decoder hyper-parameters from ``CosyVoice-BlankEN/config.json``."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # text vocabulary rows of embed_tokens (151936 for the official model)
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class SamplingConfig:
    """Repetition-aware sampling parameters (see docs/reference.md#ras-sampling)."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


@dataclass(frozen=True)
class LLMConfig:
    qwen: QwenConfig
    speech_token_size: int = 6561
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    @property
    def vocab_size(self) -> int:
        """Rows of speech_embedding / outputs of llm_decoder (6761)."""
        return self.speech_token_size + N_SPECIAL_SPEECH_IDS

    @property
    def sos(self) -> int:
        return self.speech_token_size

    @property
    def eos(self) -> int:
        return self.speech_token_size + 1

    @property
    def task_id(self) -> int:
        return self.speech_token_size + 2

    @property
    def fill(self) -> int:
        return self.speech_token_size + 3


@dataclass(frozen=True)
class FlowConfig:
    input_size: int
    output_size: int
    spk_embed_dim: int
    vocab_size: int
    token_mel_ratio: int
    pre_lookahead_len: int
    pre_lookahead_channels: int
    dit_dim: int
    dit_depth: int
    dit_heads: int
    dit_dim_head: int
    dit_ff_mult: int
    mel_dim: int
    mu_dim: int
    spk_dim: int
    out_channels: int
    static_chunk_size: int  # mel frames per DiT attention block when streaming
    inference_cfg_rate: float
    t_scheduler: str
    n_timesteps: int = FLOW_N_TIMESTEPS


@dataclass(frozen=True)
class HiftConfig:
    in_channels: int
    base_channels: int
    nb_harmonics: int
    sampling_rate: int
    nsf_alpha: float
    nsf_sigma: float
    nsf_voiced_threshold: float
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    istft_n_fft: int
    istft_hop_len: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    lrelu_slope: float
    audio_limit: float
    conv_pre_look_right: int
    f0_num_class: int
    f0_in_channels: int
    f0_cond_channels: int


@dataclass(frozen=True)
class FeatConfig:
    """The 24 kHz flow-prompt mel (Matcha ``mel_spectrogram`` arguments)."""

    n_fft: int
    num_mels: int
    sampling_rate: int
    hop_size: int
    win_size: int
    fmin: float
    fmax: float | None
    center: bool


@dataclass(frozen=True)
class ModelConfig:
    model_dir: Path
    sample_rate: int  # Hz, output and flow-prompt rate
    token_frame_rate: int  # speech tokens per second
    token_mel_ratio: int  # mel frames per speech token
    chunk_size: int  # streaming chunk in tokens (the DiT mask follows it)
    llm: LLMConfig
    flow: FlowConfig
    hift: HiftConfig
    feat: FeatConfig

    @property
    def qwen_dir(self) -> Path:
        return self.model_dir / QWEN_DIR

    def llm_weights_path(self, llm_weights: str | Path = LLM_WEIGHTS) -> Path:
        """The LLM checkpoint ``llm_weights`` names: a file of the model directory (``llm.pt``,
        ``llm.rl.pt``) or an absolute path, the one place the name is joined onto the directory. Refuses
        a file that does not exist, listing the directory's choices."""
        path = self.model_dir / llm_weights
        if not path.is_file():
            found = sorted(p.name for p in self.model_dir.glob("llm*.pt"))
            raise InputError(f"LLM weights {str(path)!r} do not exist; {self.model_dir} has: "
                             f"{', '.join(found) or 'no llm*.pt file'}")
        return path


# ----------------------------------------------------------------------------------------------
# Loading


def absolute_path(path: str | os.PathLike) -> Path:
    """``path`` as an absolute path (``~`` expanded, a relative one taken from the current directory,
    symbolic links kept), so what is joined onto it never depends on where a later step runs."""
    return Path(path).expanduser().absolute()


def check_model_dir(model_dir: str | Path) -> Path:
    """Return the directory as an absolute Path, or raise listing every required file that is missing."""
    d = absolute_path(model_dir)
    if not d.is_dir():
        raise ModelDirError(f"model directory {str(d)!r} does not exist or is not a directory; "
                            + _expected_listing())
    missing = [name for name in REQUIRED_FILES if not (d / name).is_file()]
    if missing:
        raise ModelDirError(f"model directory {str(d)!r} lacks {', '.join(missing)}; " + _expected_listing())
    return d


def _expected_listing() -> str:
    return "a CosyVoice3 model directory must contain: " + ", ".join(
        f"{name} ({what})" for name, what in REQUIRED_FILES.items())


def _get(tree: Any, path: str, where: str) -> Any:
    try:
        return _lookup(tree if isinstance(tree, dict) else {"": tree}, path)
    except KeyError:
        raise ModelDirError(f"{where}: missing key {path!r}") from None


def _args(node: Any, where: str) -> dict:
    if isinstance(node, Tagged) and isinstance(node.args, dict):
        return node.args
    if isinstance(node, dict):
        return node
    raise ModelDirError(f"{where}: expected a mapping, got {type(node).__name__}")


def read_qwen_config(path: Path) -> QwenConfig:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{path}: cannot read Qwen2 config.json: {e}") from e
    if raw.get("model_type", "qwen2") != "qwen2":
        raise ModelDirError(f"{path}: model_type {raw.get('model_type')!r} is not 'qwen2'")
    try:
        return QwenConfig(
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw.get("num_key_value_heads", raw["num_attention_heads"])),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        )
    except KeyError as e:
        raise ModelDirError(f"{path}: missing key {e.args[0]!r}") from None


def load_config(model_dir: str | Path, *, check_files: bool = True) -> ModelConfig:
    """Read ``cosyvoice3.yaml`` and ``CosyVoice-BlankEN/config.json`` into a :class:`ModelConfig`.

    ``check_files=False`` skips the check that every other required file exists (used while a
    model directory is being written)."""
    d = check_model_dir(model_dir) if check_files else absolute_path(model_dir)
    ypath = d / YAML_NAME
    doc = read_hyperpyyaml(ypath, overrides={"qwen_pretrain_path": str(d / QWEN_DIR)})
    qwen = read_qwen_config(d / QWEN_DIR / "config.json")
    try:
        return _build_config(d, doc, qwen, str(ypath))
    except KeyError as e:
        raise ModelDirError(f"{ypath}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelDirError(f"{ypath}: unexpected value: {e}") from e


def _build_config(d: Path, doc: dict, qwen: QwenConfig, w: str) -> ModelConfig:

    llm = _args(_get(doc, "llm", w), w)
    samp = _args(llm.get("sampling", {}), w)
    llm_cfg = LLMConfig(
        qwen=qwen,
        speech_token_size=int(llm.get("speech_token_size", 6561)),
        sampling=SamplingConfig(top_p=float(samp.get("top_p", 0.8)), top_k=int(samp.get("top_k", 25)),
                                win_size=int(samp.get("win_size", 10)), tau_r=float(samp.get("tau_r", 0.1))),
    )
    if int(llm.get("llm_input_size", qwen.hidden_size)) != qwen.hidden_size:
        raise ModelDirError(f"{w}: llm_input_size {llm.get('llm_input_size')} differs from the Qwen2 "
                            f"hidden_size {qwen.hidden_size} in {QWEN_DIR}/config.json")

    flow = _args(_get(doc, "flow", w), w)
    pre = _args(_get(flow, "pre_lookahead_layer", w), w)
    dec = _args(_get(flow, "decoder", w), w)
    cfm = _args(_get(dec, "cfm_params", w), w)
    cfm = _args(cfm.get("content", cfm), w)
    est = _args(_get(dec, "estimator", w), w)
    flow_cfg = FlowConfig(
        input_size=int(flow["input_size"]), output_size=int(flow["output_size"]),
        spk_embed_dim=int(flow["spk_embed_dim"]), vocab_size=int(flow["vocab_size"]),
        token_mel_ratio=int(flow["token_mel_ratio"]), pre_lookahead_len=int(flow["pre_lookahead_len"]),
        pre_lookahead_channels=int(pre["channels"]),
        dit_dim=int(est["dim"]), dit_depth=int(est["depth"]), dit_heads=int(est["heads"]),
        dit_dim_head=int(est["dim_head"]), dit_ff_mult=int(est.get("ff_mult", 4)),
        mel_dim=int(est["mel_dim"]), mu_dim=int(est.get("mu_dim", est["mel_dim"])),
        spk_dim=int(est.get("spk_dim", est["mel_dim"])), out_channels=int(est.get("out_channels", est["mel_dim"])),
        static_chunk_size=int(est.get("static_chunk_size", 0)),
        inference_cfg_rate=float(cfm.get("inference_cfg_rate", 0.7)),
        t_scheduler=str(cfm.get("t_scheduler", "cosine")),
    )

    _check_reference_constants(doc, flow_cfg, pre, w)

    hift = _args(_get(doc, "hift", w), w)
    f0 = _args(_get(hift, "f0_predictor", w), w)
    istft = _args(_get(hift, "istft_params", w), w)

    def tup(xs):
        return tuple(tuple(x) if isinstance(x, list) else x for x in xs)

    hift_cfg = HiftConfig(
        in_channels=int(hift["in_channels"]), base_channels=int(hift["base_channels"]),
        nb_harmonics=int(hift["nb_harmonics"]), sampling_rate=int(hift["sampling_rate"]),
        nsf_alpha=float(hift["nsf_alpha"]), nsf_sigma=float(hift["nsf_sigma"]),
        nsf_voiced_threshold=float(hift["nsf_voiced_threshold"]),
        upsample_rates=tup(hift["upsample_rates"]), upsample_kernel_sizes=tup(hift["upsample_kernel_sizes"]),
        istft_n_fft=int(istft["n_fft"]), istft_hop_len=int(istft["hop_len"]),
        resblock_kernel_sizes=tup(hift["resblock_kernel_sizes"]),
        resblock_dilation_sizes=tup(hift["resblock_dilation_sizes"]),
        source_resblock_kernel_sizes=tup(hift["source_resblock_kernel_sizes"]),
        source_resblock_dilation_sizes=tup(hift["source_resblock_dilation_sizes"]),
        lrelu_slope=float(hift["lrelu_slope"]), audio_limit=float(hift["audio_limit"]),
        conv_pre_look_right=int(hift.get("conv_pre_look_right", 0)),
        f0_num_class=int(f0.get("num_class", 1)), f0_in_channels=int(f0["in_channels"]),
        f0_cond_channels=int(f0["cond_channels"]),
    )

    feat = _args(_get(doc, "feat_extractor", w), w)
    feat_cfg = FeatConfig(
        n_fft=int(feat["n_fft"]), num_mels=int(feat["num_mels"]), sampling_rate=int(feat["sampling_rate"]),
        hop_size=int(feat["hop_size"]), win_size=int(feat["win_size"]), fmin=float(feat.get("fmin", 0)),
        fmax=None if feat.get("fmax") is None else float(feat["fmax"]), center=bool(feat.get("center", False)),
    )
    return ModelConfig(
        model_dir=d, sample_rate=int(doc["sample_rate"]), token_frame_rate=int(doc["token_frame_rate"]),
        token_mel_ratio=int(doc["token_mel_ratio"]), chunk_size=int(doc["chunk_size"]),
        llm=llm_cfg, flow=flow_cfg, hift=hift_cfg, feat=feat_cfg,
    )


def _check_reference_constants(doc: dict, flow: FlowConfig, pre: dict, w: str) -> None:
    """Refuse a yaml whose values the reference would combine in a way cosyllama does not reproduce.

    The reference reads some values from the yaml and fixes others in code
    (docs/reference.md#yaml-values-the-reference-ignores). Where a yaml value disagrees with such a constant, the
    reference runs with a mismatch
    (a prompt trimmed 2:1 fed to a flow of another ratio, a look-ahead layer of another length than the
    wrapper's) that cosyllama would not compute alike: it says so instead of producing other audio.
    """
    layer_look = int(pre.get("pre_lookahead_len", flow.pre_lookahead_len))
    if layer_look != flow.pre_lookahead_len:
        raise ModelDirError(f"{w}: flow.pre_lookahead_layer.pre_lookahead_len ({layer_look}) differs from "
                            f"flow.pre_lookahead_len ({flow.pre_lookahead_len}); the reference's flow and its "
                            "look-ahead layer would disagree, which cosyllama does not reproduce")
    if flow.token_mel_ratio != PROMPT_MEL_PER_TOKEN or int(doc["sample_rate"]) != PROMPT_ALIGN_RATE:
        raise ModelDirError(f"{w}: token_mel_ratio {flow.token_mel_ratio} at sample_rate {doc['sample_rate']}: "
                            f"the reference's frontend aligns prompts at {PROMPT_MEL_PER_TOKEN} mel frames per "
                            f"token at {PROMPT_ALIGN_RATE} Hz whatever the yaml says, so only token_mel_ratio "
                            f"{PROMPT_MEL_PER_TOKEN} and sample_rate {PROMPT_ALIGN_RATE} give the reference's audio")
