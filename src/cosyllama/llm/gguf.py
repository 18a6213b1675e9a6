"""GGUF export of the speech-token LLM and its quantization (reading and checking a GGUF: :mod:`.gguf_read`).

Two layouts (see docs/design.md#gguf-layouts):

``speech`` (default)
    A Qwen2 whose vocabulary *is* the speech vocabulary: ``token_embd`` = ``speech_embedding``
    (6761 rows), ``output`` = ``llm_decoder``, tokenizer model ``none`` with ``qwen2.vocab_size`` =
    6761 (llama.cpp then creates 6761 dummy tokens). The prompt's Qwen text rows are not in the file:
    the backend reads them from the model directory's ``llm.pt`` (memory-mapped, so only the rows a
    prompt touches are paged in). This keeps the GGUF small and the output head 23x smaller than
    the merged one, and ``llm.pt`` is in the model directory anyway.
``merged``
    The layout of the GGUFs published elsewhere: text rows ``0..n_text-1``, speech row ``k`` at
    ``n_text + k`` in both ``token_embd`` and ``output``, the real Qwen BPE tokenizer extended with
    ``<|s_k|>`` tokens. llama.cpp sees a plain Qwen2; the prompt is submitted as token ids.

The file is written once in F32 with :class:`gguf.GGUFWriter`, then handed to llama.cpp's own
quantizer (``llama_model_quantize``) for every other type. Both layouts record the CosyVoice3
constants under ``cosyllama.*`` keys plus a fingerprint of ``llm.pt``, so that
:func:`inspect_gguf` can refuse a file that belongs to another model before llama.cpp sees it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import LLMConfig, load_config
from ..defaults import LLM_WEIGHTS
from ..errors import CheckpointError, InputError, ModelDirError
from ..progress import StageProgress as Progress
from ..weights import load_llm_weights
from .gguf_names import (
    ARCH,
    FORMAT_VERSION,
    KEY_PREFIX,
    LAYOUTS,
    SPEECH_TOKEN_FORMAT,
    TEXT_TABLE,
    TYPE_NAMES,
    VOCAB_TENSORS,
    file_type_ids,
    import_gguf,
    tensor_table,
)
from .gguf_read import llm_fingerprint
from .llamacpp_lib import import_llama_cpp, llama_log_handler

# Output type -> name of the llama.cpp ftype constant (None: written directly, no quantizer pass).
TYPES: dict[str, str | None] = {n: None if n == "F32" else f"LLAMA_FTYPE_MOSTLY_{n}" for n in TYPE_NAMES}
_GGML_LOG_LEVEL_ERROR = 4  # ggml's GGML_LOG_LEVEL_ERROR, the level of the quantizer's failure lines


def __getattr__(name: str):
    if name == "FTYPE_IDS":  # type name -> general.file_type id, from gguf-py (imported on use)
        return file_type_ids()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Progress callbacks here: progress(stage, done, total), stage "write" (tensors written) or "quantize".


# ----------------------------------------------------------------------------------------------
# Writing


@dataclass(frozen=True)
class _TensorPlan:
    name: str
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]  # produces the float32 data when it is written


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()


def _tensor_plan(w: Mapping[str, torch.Tensor], cfg: LLMConfig, layout: str) -> list[_TensorPlan]:
    """The tensors of the file in order, from the one name table (:func:`tensor_table`). Speech
    layout: the vocabulary tables are the speech rows alone. Merged: text rows (the tied text
    embedding, as in the published files) then the speech rows; built only when written, so peak
    memory holds one merged table at a time."""
    q = cfg.qwen
    vocab_keys = {key for _, _, key in VOCAB_TENSORS}
    plan: list[_TensorPlan] = []
    for name, key in tensor_table(q.num_hidden_layers).items():
        if layout == "merged" and key in vocab_keys:  # output: the text rows are never read
            rows = q.vocab_size + cfg.vocab_size
            plan.append(_TensorPlan(name, (rows, q.hidden_size), lambda key=key: np.concatenate(
                [_f32(w[TEXT_TABLE]), _f32(w[key])])))
        else:
            plan.append(_TensorPlan(name, tuple(w[key].shape), lambda key=key: _f32(w[key])))
    return plan


def _text_vocabulary(qwen_dir: Path, n_text: int) -> tuple[list[str], list[int], list[str], int | None]:
    """Tokens/types for ids ``0..n_text-1`` from BlankEN's tokenizer files, plus merges and eos id.

    CosyVoice3's special tokens follow the Qwen ones; ids that none of these name become
    ``[PAD<id>]`` (type unused), the usual filler for Qwen's padded embedding table.
    """
    try:
        vocab: dict[str, int] = json.loads((qwen_dir / "vocab.json").read_text(encoding="utf-8"))
        merges_text = (qwen_dir / "merges.txt").read_text(encoding="utf-8")
    except (OSError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{qwen_dir}: cannot read the Qwen tokenizer files: {e}") from e
    tt = import_gguf().TokenType
    tokens = [f"[PAD{i}]" for i in range(n_text)]
    types = [tt.UNUSED] * n_text
    for tok, i in vocab.items():
        if not 0 <= i < n_text:
            raise ModelDirError(f"{qwen_dir / 'vocab.json'}: token {tok!r} has id {i}, outside the "
                                f"text vocabulary 0..{n_text - 1}")
        tokens[i], types[i] = tok, tt.NORMAL
    added: dict = {}
    tc = qwen_dir / "tokenizer_config.json"
    if tc.is_file():
        try:
            added = json.loads(tc.read_text(encoding="utf-8")).get("added_tokens_decoder", {}) or {}
        except json.JSONDecodeError as e:
            raise ModelDirError(f"{tc}: not valid JSON: {e}") from e
    known = {tok: i for tok, i in vocab.items()}
    for sid, info in added.items():
        i = int(sid)
        if 0 <= i < n_text:
            tokens[i], types[i] = info["content"], tt.CONTROL
            known[info["content"]] = i
    # CosyVoice3's tokenizer adds its specials at load time (see docs/reference.md#tokenizer): present ones
    # keep their id, the others get consecutive ids after the highest one. Same procedure, so ids agree.
    from ..text.tokenizer import SPECIAL_TOKENS

    next_id = max(known.values(), default=-1) + 1
    for tok in SPECIAL_TOKENS:
        if tok not in known and next_id < n_text:
            tokens[next_id], types[next_id] = tok, tt.CONTROL
            known[tok] = next_id
            next_id += 1
    eos = known.get("<|endoftext|>")
    merges = [ln for ln in merges_text.splitlines() if ln and not ln.startswith("#version")]
    return tokens, types, merges, eos


def _write_f32(path: Path, w: Mapping[str, torch.Tensor], cfg: LLMConfig, qwen_dir: Path, layout: str,
               fingerprint: str, progress: Progress | None, *, cosyllama_keys: bool = True,
               weights_name: str = LLM_WEIGHTS) -> None:
    """Write the F32 GGUF. ``cosyllama_keys=False`` leaves out our metadata (tests use it to
    imitate a merged file converted by another tool). ``weights_name``: the checkpoint ``w`` came
    from, recorded beside its fingerprint."""
    gguf = import_gguf()

    q = cfg.qwen
    n_text = q.vocab_size
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_name(f"CosyVoice3 speech LLM ({layout} layout)")
    writer.add_context_length(q.max_position_embeddings)
    writer.add_embedding_length(q.hidden_size)
    writer.add_block_count(q.num_hidden_layers)
    writer.add_feed_forward_length(q.intermediate_size)
    writer.add_head_count(q.num_attention_heads)
    writer.add_head_count_kv(q.num_key_value_heads)
    writer.add_rope_freq_base(q.rope_theta)
    writer.add_layer_norm_rms_eps(q.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    if layout == "speech":
        writer.add_tokenizer_model("none")
        writer.add_vocab_size(cfg.vocab_size)
    else:
        tokens, types, merges, eos = _text_vocabulary(qwen_dir, n_text)
        tokens += [SPEECH_TOKEN_FORMAT.format(k) for k in range(cfg.vocab_size)]
        types += [gguf.TokenType.USER_DEFINED] * cfg.vocab_size
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        if eos is not None:
            writer.add_eos_token_id(eos)
            writer.add_pad_token_id(eos)
        writer.add_add_bos_token(False)

    meta = {
        "format_version": FORMAT_VERSION, "layout": layout, "hidden_size": q.hidden_size,
        "speech_token_size": cfg.speech_token_size, "n_special": cfg.vocab_size - cfg.speech_token_size,
        "speech_vocab_size": cfg.vocab_size, "text_vocab_size": n_text,
        "speech_offset": 0 if layout == "speech" else n_text,
        "sos": cfg.sos, "eos": cfg.eos, "task_id": cfg.task_id, "fill": cfg.fill,
    }
    if cosyllama_keys:
        for k, v in meta.items():
            if isinstance(v, str):
                writer.add_string(KEY_PREFIX + k, v)
            else:
                writer.add_uint32(KEY_PREFIX + k, v)
        writer.add_string(KEY_PREFIX + "llm_fingerprint", fingerprint)
        writer.add_string(KEY_PREFIX + "llm_weights", weights_name)

    plan = _tensor_plan(w, cfg, layout)
    for t in plan:
        n = int(np.prod(t.shape))
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), n * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, t in enumerate(plan):
        data = t.make()
        assert data.shape == t.shape, (t.name, data.shape, t.shape)
        writer.write_tensor_data(data)
        if progress:
            progress("write", i + 1, len(plan))
    writer.close()


# ----------------------------------------------------------------------------------------------
# Quantizing and the public converter


def _quantize(src: Path, dst: Path, type_name: str, progress: Progress | None) -> None:
    """Run llama.cpp's quantizer (``llama_model_quantize``) from the F32 file ``src`` to ``dst``."""
    import ctypes

    llama_cpp = import_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, TYPES[type_name])
    params.nthread = os.cpu_count() or 1
    errors: list[str] = []
    # The quantizer logs one "[  i/ n] tensor ..." line per tensor; that is our progress signal.
    counter = re.compile(r"\[\s*(\d+)\s*/\s*(\d+)\s*\]")

    def on_log(level: int, text: str) -> None:
        m = counter.search(text)
        if m and progress:
            progress("quantize", int(m.group(1)), int(m.group(2)))
        if level == _GGML_LOG_LEVEL_ERROR:
            errors.append(text.strip())

    with llama_log_handler(on_log):
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        detail = "; ".join(e for e in errors if e)[-500:] or "no message from llama.cpp"
        raise CheckpointError(f"llama.cpp could not quantize {src} to {type_name}: {detail}")


def normalize_type(type: str) -> str:
    name = str(type).upper()
    if name not in TYPES:
        raise InputError(f"unknown GGUF type {type!r}; allowed: {', '.join(TYPES)}")
    return name


def convert(model_dir: str | os.PathLike, out: str | os.PathLike, layout: str = "speech",
            type: str = "Q8_0", force: bool = False, progress: Progress | None = None,
            llm_weights: str | os.PathLike = LLM_WEIGHTS) -> Path:
    """Export ``model_dir``'s ``llm.pt`` to a GGUF file ``out`` of the given layout and type.

    ``layout``: ``"speech"`` or ``"merged"`` (see the module docstring). ``type``: one of
    :data:`TYPES` (case-insensitive). An existing ``out`` is refused unless ``force``. The F32 file
    is written first (next to ``out``), then quantized by llama.cpp; ``out`` appears only when
    complete. ``progress(stage, done, total)`` is called per tensor written and quantized.
    ``llm_weights``: the LLM checkpoint of the model directory to convert (``llm.pt``, or
    ``llm.rl.pt``); the file records its name and fingerprint, so it loads only with that choice.
    Returns the path written.
    """
    if layout not in LAYOUTS:
        raise InputError(f"unknown GGUF layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
    type_name = normalize_type(type)
    out = Path(out)
    if out.exists() and not force:
        raise InputError(f"{out} already exists; pass force=True (CLI: --force) to overwrite it")
    if not out.parent.is_dir():
        raise InputError(f"output directory {str(out.parent)!r} does not exist")
    config = load_config(model_dir)
    weights_path = config.llm_weights_path(llm_weights)
    weights = load_llm_weights(weights_path, config.llm)
    fingerprint = llm_fingerprint(weights, config.llm.qwen.num_hidden_layers)

    partial = out.with_name(f".{out.name}.partial")
    f32_tmp = out.with_name(f".{out.name}.f32.tmp")
    try:
        if TYPES[type_name] is None:
            _write_f32(partial, weights, config.llm, config.qwen_dir, layout, fingerprint, progress,
                       weights_name=weights_path.name)
        else:
            _write_f32(f32_tmp, weights, config.llm, config.qwen_dir, layout, fingerprint, progress,
                       weights_name=weights_path.name)
            _quantize(f32_tmp, partial, type_name, progress)
        os.replace(partial, out)
    finally:
        for p in (partial, f32_tmp):
            p.unlink(missing_ok=True)
    return out


