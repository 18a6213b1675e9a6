"""Random-weight model directories in the official Fun-CosyVoice3-0.5B layout (``make-model``).

``full`` has the real shapes (see docs/reference.md#model-sizes), so everything runs at the real speed; the
audio is noise. ``tiny`` has the fixture model's sizes, for tests. The checkpoints are built from the same key
tables that loading checks (:mod:`cosyllama.weights`), so a made model always loads strictly.
The tokenizer is a small byte-level BPE (shipped in ``cosyllama/data/blanken``) whose three Qwen2
specials sit at their real ids; the ONNX files are light stand-ins with the official inputs and
outputs (they need the ``onnx`` package: ``pip install 'cosyllama[bench]'``).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import QWEN_DIR, REQUIRED_FILES, ModelConfig, load_config
from ..errors import InputError, MissingDependencyError

DATA = Path(__file__).resolve().parents[1] / "data" / "blanken"  # package data of cosyllama
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "generation_config.json")


@dataclass(frozen=True)
class Sizes:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    lookahead_channels: int
    dit_dim: int
    dit_depth: int
    dit_heads: int
    dit_dim_head: int
    hift_channels: int
    f0_channels: int


SIZES = {
    # Fun-CosyVoice3-0.5B; see docs/reference.md#model-sizes
    "full": Sizes(896, 24, 14, 2, 4864, 1024, 1024, 22, 16, 64, 512, 512),
    # the golden fixtures' tiny model
    "tiny": Sizes(16, 2, 4, 2, 64, 64, 64, 2, 4, 16, 32, 32),
}
TEXT_VOCAB = 151936  # Qwen2 embedding rows of the official model


def _yaml(s: Sizes) -> str:
    return f"""# Random-weight model made by `cosyllama make-model` (not a usable TTS model; the audio is noise).
__set_seed1: !apply:random.seed [1986]
sample_rate: 24000
llm_input_size: {s.hidden}
llm_output_size: {s.hidden}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {s.lookahead_channels}
        pre_lookahead_len: 3
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {s.dit_dim}
            depth: {s.dit_depth}
            heads: {s.dit_heads}
            dim_head: {s.dit_dim_head}
            ff_mult: 2
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: 80
    base_channels: {s.hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {s.f0_channels}

feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: null
    center: False
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
    version: cosyvoice3
allowed_special: 'all'
"""


def _qwen_config(s: Sizes) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": s.hidden, "initializer_range": 0.02,
        "intermediate_size": s.intermediate, "max_position_embeddings": 32768, "max_window_layers": s.layers,
        "model_type": "qwen2", "num_attention_heads": s.heads, "num_hidden_layers": s.layers,
        "num_key_value_heads": s.kv_heads, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": TEXT_VOCAB,
    }


def _random_state(table: dict[str, tuple[int, ...]], gen: torch.Generator, *, std_2d: float | None = None,
                  fixed: Callable[[str, tuple[int, ...]], torch.Tensor | None] = lambda k, s: None
                  ) -> dict[str, torch.Tensor]:
    """Random tensors for a key table: norms/Snake alphas 1, biases small, weights ~ N(0, 1/fan_in)."""
    sd: dict[str, torch.Tensor] = {}
    for key, shape in table.items():
        t = fixed(key, shape)
        if t is None:
            if len(shape) == 1:
                if key.endswith(("norm.weight", ".alpha")):
                    t = torch.ones(shape)
                else:
                    t = torch.randn(shape, generator=gen) * 0.02
            else:
                fan_in = math.prod(shape[1:])
                std = std_2d if std_2d is not None else 1.0 / math.sqrt(fan_in)
                t = torch.randn(shape, generator=gen) * std
        sd[key] = t.contiguous()
    return sd


def _weight_norm_gains(sd: dict[str, torch.Tensor]) -> None:
    """Set every weight-norm gain g to ||v|| so the folded weight equals the random direction v."""
    for key in list(sd):
        if key.endswith("original0"):
            v = sd[key[:-1] + "1"]
            sd[key] = v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1))).clone()


def _write_onnx_standins(d: Path, gen: torch.Generator) -> None:
    try:
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        raise MissingDependencyError("make-model writes ONNX stand-ins and needs the onnx package: "
                                     "pip install 'cosyllama[bench]'") from None

    def init(name, arr):
        return numpy_helper.from_array(np.ascontiguousarray(arr, dtype=np.float32), name)

    def rnd(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).numpy()

    # Speech tokenizer stand-in: feats (B,128,T) -> two stride-2 convs -> ternary digits -> base-3 index.
    nodes = [
        helper.make_node("Conv", ["feats", "w1", "b1"], ["h1"], kernel_shape=[3], strides=[2], pads=[1, 1]),
        helper.make_node("Tanh", ["h1"], ["a1"]),
        helper.make_node("Conv", ["a1", "w2", "b2"], ["h2"], kernel_shape=[3], strides=[2], pads=[1, 1]),
        helper.make_node("Tanh", ["h2"], ["a2"]),
        helper.make_node("Round", ["a2"], ["r"]),
        helper.make_node("Add", ["r", "one"], ["digits"]),  # {0,1,2}
        helper.make_node("Transpose", ["digits"], ["dt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["dt", "pow3"], ["idx"]),
        helper.make_node("Squeeze", ["idx", "axis2"], ["idxs"]),
        helper.make_node("Cast", ["idxs"], ["indices"], to=TensorProto.INT32),
    ]
    inits = [init("w1", rnd(32, 128, 3, scale=1 / math.sqrt(128 * 3))), init("b1", np.zeros(32)),
             init("w2", rnd(8, 32, 3, scale=2 / math.sqrt(32 * 3))), init("b2", np.zeros(8)),
             init("one", np.ones(1)), init("pow3", (3.0 ** np.arange(8)).reshape(8, 1)),
             numpy_helper.from_array(np.array([2], dtype=np.int64), "axis2")]
    graph = helper.make_graph(
        nodes, "speech_tokenizer_standin",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["B", 128, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, ["B"])],
        [helper.make_tensor_value_info("indices", TensorProto.INT32, ["B", "T2"])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              d / "speech_tokenizer_v3.onnx")

    # Speaker encoder stand-in: input (B,T,80) -> mean_t(tanh(x W1 + b1)) W2 + b2 -> (B,192).
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Tanh", ["hb"], ["a"]),
        helper.make_node("ReduceMean", ["a", "axis1"], ["m"], keepdims=0),
        helper.make_node("MatMul", ["m", "w2"], ["o"]), helper.make_node("Add", ["o", "b2"], ["output"]),
    ]
    inits = [init("w1", rnd(80, 64, scale=1 / math.sqrt(80))), init("b1", np.zeros(64)),
             init("w2", rnd(64, 192, scale=1 / math.sqrt(64))), init("b2", np.zeros(192)),
             numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1")]
    graph = helper.make_graph(nodes, "campplus_standin",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", 80])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", 192])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8),
              d / "campplus.onnx")


def size_config(size: str) -> ModelConfig:
    """The :class:`ModelConfig` that ``make_model(size=...)`` writes, without writing a model (for
    building modules straight from configs, e.g. in benchmarks). Its ``model_dir`` does not exist."""
    import tempfile

    if size not in SIZES:
        raise InputError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    s = SIZES[size]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / QWEN_DIR).mkdir()
        (d / "cosyvoice3.yaml").write_text(_yaml(s), encoding="utf-8")
        (d / QWEN_DIR / "config.json").write_text(json.dumps(_qwen_config(s), indent=2), encoding="utf-8")
        return load_config(d, check_files=False)


def make_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, force: bool = False,
               progress: Callable[[str], None] = lambda msg: None) -> Path:
    """Write a random-weight CosyVoice3 model directory. Deterministic for a given ``seed``."""
    from ..weights import LLM_BODY_PREFIX, LLM_LM_HEAD, flow_key_table, hift_key_table, llm_key_table

    if size not in SIZES:
        raise InputError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    s = SIZES[size]
    d = Path(out_dir).expanduser()
    existing = [name for name in REQUIRED_FILES if (d / name).exists()]
    if existing and not force:
        raise InputError(f"{d} already holds a model ({', '.join(existing[:3])}...); pass --force to overwrite")
    (d / QWEN_DIR).mkdir(parents=True, exist_ok=True)

    progress(f"[1/5] config and tokenizer ({size})")
    (d / "cosyvoice3.yaml").write_text(_yaml(s), encoding="utf-8")
    (d / QWEN_DIR / "config.json").write_text(json.dumps(_qwen_config(s), indent=2), encoding="utf-8")
    for name in TOKENIZER_FILES:
        shutil.copyfile(DATA / name, d / QWEN_DIR / name)
    cfg = load_config(d, check_files=False)
    gen = torch.Generator().manual_seed(seed)

    progress("[2/5] llm.pt")
    llm_table = llm_key_table(cfg.llm)
    sd = _random_state(llm_table, gen, std_2d=0.02 if size == "full" else None,
                       fixed=lambda k, shp: torch.empty(0) if k == LLM_LM_HEAD else None)
    sd[LLM_LM_HEAD] = sd[LLM_BODY_PREFIX + "embed_tokens.weight"]  # tied, stored once (as published)
    # Make stop ids a little less likely so random models speak for a while.
    sd["llm_decoder.weight"][cfg.llm.speech_token_size:] *= 0.9
    torch.save(sd, d / "llm.pt")
    del sd

    progress("[3/5] flow.pt")
    dh = cfg.flow.dit_dim_head

    def flow_fixed(key, shape):
        if key.endswith("rotary_embed.inv_freq"):
            return 1.0 / (10000 ** (torch.arange(0, dh, 2).float() / dh))
        if key == "input_embedding.weight":
            return torch.randn(shape, generator=gen)
        return None

    torch.save(_random_state(flow_key_table(cfg.flow), gen, fixed=flow_fixed), d / "flow.pt")

    progress("[4/5] hift.pt")
    sd = _random_state(hift_key_table(cfg.hift), gen)
    _weight_norm_gains(sd)
    torch.save(sd, d / "hift.pt")

    progress("[5/5] ONNX stand-ins")
    _write_onnx_standins(d, gen)
    load_config(d)  # everything required is there and readable
    return d

