"""GGUF export of the speech-token LLM, quantization, and the checks a GGUF must pass before use.

Two layouts (design.md, "GGUF layouts"):

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

import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import LLMConfig, load_config
from ..errors import CheckpointError, InputError, MissingDependencyError, ModelDirError
from ..progress import StageProgress as Progress
from ..weights import load_llm_weights

LAYOUTS = ("speech", "merged")
ARCH = "qwen2"
KEY_PREFIX = "cosyllama."
FORMAT_VERSION = 1
SPEECH_TOKEN_FORMAT = "<|s_{}|>"  # merged-layout name of speech token k

# Output type -> name of the llama.cpp ftype constant (None: written directly, no quantizer pass).
TYPES: dict[str, str | None] = {
    "F32": None,
    "F16": "LLAMA_FTYPE_MOSTLY_F16",
    "BF16": "LLAMA_FTYPE_MOSTLY_BF16",
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "Q5_K_S": "LLAMA_FTYPE_MOSTLY_Q5_K_S",
    "Q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1",
    "Q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
    "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "Q3_K_L": "LLAMA_FTYPE_MOSTLY_Q3_K_L",
    "Q3_K_M": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
    "Q3_K_S": "LLAMA_FTYPE_MOSTLY_Q3_K_S",
    "Q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K",
}
_GGML_LOG_LEVEL_ERROR = 4
_GGML_TYPE_F32 = 0
_FTYPE_ALL_F32 = 0  # llama.cpp's LLAMA_FTYPE_ALL_F32, recorded in general.file_type

# Token types of the GGUF tokenizer (llama.cpp's llama_token_type values).
_TOK_NORMAL, _TOK_CONTROL, _TOK_USER_DEFINED, _TOK_UNUSED = 1, 3, 4, 5

# Progress callbacks here: progress(stage, done, total), stage "write" (tensors written) or "quantize".


# ----------------------------------------------------------------------------------------------
# Fingerprint of llm.pt

_FINGERPRINT_ROWS = 4


def llm_fingerprint(weights: Mapping[str, torch.Tensor], n_layers: int) -> str:
    """A short hash of a few rows of ``llm.pt`` (the dict from :func:`load_llm_weights`).

    Cheap on a memory-mapped checkpoint (reads a few KB), and different for any two independently
    trained or initialised models, which is all it is for: tying a GGUF to its model directory.
    """
    h = hashlib.sha256()
    names = ["embed_tokens.weight", "speech_embedding.weight", "llm_decoder.weight", "norm.weight",
             "layers.0.self_attn.q_proj.weight", f"layers.{n_layers - 1}.mlp.down_proj.weight"]
    for name in names:
        t = weights[name]
        h.update(name.encode() + repr(tuple(t.shape)).encode())
        h.update(t[:_FINGERPRINT_ROWS].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


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
    q = cfg.qwen
    plan: list[_TensorPlan] = []

    def add(name: str, key: str) -> None:
        plan.append(_TensorPlan(name, tuple(w[key].shape), lambda: _f32(w[key])))

    def add_table(name: str, speech_key: str) -> None:
        """Speech layout: the speech table alone. Merged: text rows (the tied text embedding, as in
        the published files) then the speech rows; built only when written, so peak memory holds
        one merged table at a time."""
        if layout == "speech":
            add(name, speech_key)
            return
        rows = q.vocab_size + cfg.vocab_size
        plan.append(_TensorPlan(name, (rows, q.hidden_size), lambda: np.concatenate(
            [_f32(w["embed_tokens.weight"]), _f32(w[speech_key])])))

    add_table("token_embd.weight", "speech_embedding.weight")
    for i in range(q.num_hidden_layers):
        src, dst = f"layers.{i}.", f"blk.{i}."
        add(dst + "attn_norm.weight", src + "input_layernorm.weight")
        for p in "qkv":
            add(dst + f"attn_{p}.weight", src + f"self_attn.{p}_proj.weight")
            add(dst + f"attn_{p}.bias", src + f"self_attn.{p}_proj.bias")
        add(dst + "attn_output.weight", src + "self_attn.o_proj.weight")
        add(dst + "ffn_norm.weight", src + "post_attention_layernorm.weight")
        add(dst + "ffn_gate.weight", src + "mlp.gate_proj.weight")
        add(dst + "ffn_up.weight", src + "mlp.up_proj.weight")
        add(dst + "ffn_down.weight", src + "mlp.down_proj.weight")
    add("output_norm.weight", "norm.weight")
    add_table("output.weight", "llm_decoder.weight")  # merged: the text rows are never read
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
    tokens = [f"[PAD{i}]" for i in range(n_text)]
    types = [_TOK_UNUSED] * n_text
    for tok, i in vocab.items():
        if not 0 <= i < n_text:
            raise ModelDirError(f"{qwen_dir / 'vocab.json'}: token {tok!r} has id {i}, outside the "
                                f"text vocabulary 0..{n_text - 1}")
        tokens[i], types[i] = tok, _TOK_NORMAL
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
            tokens[i], types[i] = info["content"], _TOK_CONTROL
            known[info["content"]] = i
    # CosyVoice3's tokenizer adds its specials at load time (spec §2): present ones keep their id,
    # the others get consecutive ids after the highest one. Same procedure, so ids agree.
    from ..text import SPECIAL_TOKENS

    next_id = max(known.values(), default=-1) + 1
    for tok in SPECIAL_TOKENS:
        if tok not in known and next_id < n_text:
            tokens[next_id], types[next_id] = tok, _TOK_CONTROL
            known[tok] = next_id
            next_id += 1
    eos = known.get("<|endoftext|>")
    merges = [ln for ln in merges_text.splitlines() if ln and not ln.startswith("#version")]
    return tokens, types, merges, eos


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise MissingDependencyError("GGUF files need the gguf package: pip install 'cosyllama[llama]'") from None
    return gguf


def _write_f32(path: Path, w: Mapping[str, torch.Tensor], cfg: LLMConfig, qwen_dir: Path, layout: str,
               fingerprint: str, progress: Progress | None, *, cosyllama_keys: bool = True) -> None:
    """Write the F32 GGUF. ``cosyllama_keys=False`` leaves out our metadata (tests use it to
    imitate a merged file converted by another tool)."""
    gguf = _import_gguf()

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
    writer.add_file_type(_FTYPE_ALL_F32)

    if layout == "speech":
        writer.add_tokenizer_model("none")
        writer.add_vocab_size(cfg.vocab_size)
    else:
        tokens, types, merges, eos = _text_vocabulary(qwen_dir, n_text)
        tokens += [SPEECH_TOKEN_FORMAT.format(k) for k in range(cfg.vocab_size)]
        types += [_TOK_USER_DEFINED] * cfg.vocab_size
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

    from .llamacpp_backend import import_llama_cpp, llama_log_handler

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
            type: str = "Q8_0", force: bool = False, progress: Progress | None = None) -> Path:
    """Export ``model_dir``'s ``llm.pt`` to a GGUF file ``out`` of the given layout and type.

    ``layout``: ``"speech"`` or ``"merged"`` (see the module docstring). ``type``: one of
    :data:`TYPES` (case-insensitive). An existing ``out`` is refused unless ``force``. The F32 file
    is written first (next to ``out``), then quantized by llama.cpp; ``out`` appears only when
    complete. ``progress(stage, done, total)`` is called per tensor written and quantized.
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
    cfg = load_config(model_dir)
    weights = load_llm_weights(cfg.model_dir / "llm.pt", cfg.llm)
    fingerprint = llm_fingerprint(weights, cfg.llm.qwen.num_hidden_layers)

    partial = out.with_name(f".{out.name}.partial")
    f32_tmp = out.with_name(f".{out.name}.f32.tmp")
    try:
        if TYPES[type_name] is None:
            _write_f32(partial, weights, cfg.llm, cfg.qwen_dir, layout, fingerprint, progress)
        else:
            _write_f32(f32_tmp, weights, cfg.llm, cfg.qwen_dir, layout, fingerprint, progress)
            _quantize(f32_tmp, partial, type_name, progress)
        os.replace(partial, out)
    finally:
        for p in (partial, f32_tmp):
            p.unlink(missing_ok=True)
    return out


# ----------------------------------------------------------------------------------------------
# Reading and validation

# llama.cpp's llama_ftype enum values (stable across versions), for naming a file's type.
FTYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
             "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16,
             "Q5_K_M": 17, "Q6_K": 18, "BF16": 32}
_FTYPE_NAMES = {v: k for k, v in FTYPE_IDS.items()}


@dataclass(frozen=True)
class GGUFInfo:
    """What :func:`inspect_gguf` learnt about a file that passed every check."""

    path: Path
    layout: str  # "speech" | "merged"
    n_vocab: int  # rows of token_embd / output
    speech_offset: int  # GGUF token id of speech id 0 (0 or n_text)
    type: str  # file type name ("F32", "Q8_0", ...; "ftype <n>" if unknown)
    all_f32: bool  # every tensor stored as F32 (then the backend keeps an F32 KV cache)
    fingerprint: str | None  # llm.pt fingerprint recorded at conversion (None for foreign files)


# GGUF value type ids -> struct format of scalars (strings = 8, arrays = 9 are handled apart).
_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass(frozen=True)
class _StringArray:
    """A string array of the header, read lazily: only its length and element offsets are kept."""

    buf: object  # the file's mmap
    offsets: np.ndarray  # byte offset of each element's length prefix

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> str:
        import struct

        off = int(self.offsets[i])
        (n,) = struct.unpack_from("<Q", self.buf, off)
        return bytes(self.buf[off + 8:off + 8 + n]).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order (ne0 first)
    ggml_type: int
    offset: int  # absolute byte offset of the data
    n_bytes: int


def _read_header(path: Path, buf) -> tuple[dict, list[_TensorInfo]]:
    """Parse a GGUF header (key/values and tensor infos) from ``buf`` (an mmap of the file).

    Our own small reader, because :class:`gguf.GGUFReader` materialises every element of the
    tokenizer arrays (about 5 s for the 158k-token merged vocabulary); here string arrays are
    only walked for their offsets and read on demand.
    """
    import struct

    gguf = _import_gguf()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        vals = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return vals[0] if len(vals) == 1 else vals

    def string() -> str:
        nonlocal pos
        n = take("Q")
        if pos + n > len(buf):
            raise ValueError("string runs past the end of the file")
        out = bytes(buf[pos:pos + n]).decode("utf-8", errors="replace")
        pos += n
        return out

    def value(vtype: int):
        nonlocal pos
        if vtype in _SCALAR_FMT:
            return take(_SCALAR_FMT[vtype])
        if vtype == _GGUF_STRING:
            return string()
        if vtype == _GGUF_ARRAY:
            etype, count = take("I"), take("Q")
            if etype == _GGUF_STRING:
                offs = np.empty(count, dtype=np.int64)
                for i in range(count):
                    offs[i] = pos
                    pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
                if pos > len(buf):
                    raise ValueError("string array runs past the end of the file")
                return _StringArray(buf, offs)
            if etype in _SCALAR_FMT:
                size = struct.calcsize("<" + _SCALAR_FMT[etype])
                arr = np.frombuffer(buf, dtype=np.dtype("<" + _SCALAR_FMT[etype]), count=count, offset=pos).copy()
                pos += size * count
                return arr
            return [value(etype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")

    _magic, version, n_tensors, n_kv = take("I"), take("I"), take("Q"), take("Q")  # magic: checked by the caller
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    kv = {}
    for _ in range(n_kv):
        key = string()
        kv[key] = value(take("I"))
    raw = []
    for _ in range(n_tensors):
        name = string()
        n_dims = take("I")
        shape = tuple(take("Q") for _ in range(n_dims))
        raw.append((name, shape, take("I"), take("Q")))
    align = int(kv.get("general.alignment", 32))
    data_start = -(-pos // align) * align
    tensors = []
    for name, shape, gtype, off in raw:
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(gtype)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown ggml type {gtype}") from None
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        tensors.append(_TensorInfo(name, shape, gtype, data_start + off, n // block * type_size))
    return kv, tensors


def inspect_gguf(path: str | os.PathLike, cfg: LLMConfig, *, layout: str | None = None,
                 fingerprint: str | None = None) -> GGUFInfo:
    """Check that ``path`` is a GGUF of this model's speech LLM, without llama.cpp.

    Refuses (with :class:`CheckpointError` / :class:`ModelDirError`) a missing, truncated or
    non-GGUF file, a GGUF of another architecture or size, an unrelated text LLM (no speech
    vocabulary), a file whose recorded CosyVoice3 constants or ``llm.pt`` fingerprint differ from
    ``cfg`` / ``fingerprint``, and one whose layout differs from ``layout`` when that is given.
    Files without ``cosyllama.*`` keys are accepted as ``merged`` when their vocabulary has
    ``n_text + 6761`` tokens with ``<|s_0|>`` at ``n_text``.
    """
    import mmap

    path = Path(path)
    if not path.is_file():
        raise ModelDirError(f"GGUF file {str(path)!r} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _check(path, size, buf, cfg, layout, fingerprint)
    finally:
        buf.close()


def _check(path: Path, size: int, buf, cfg: LLMConfig, layout: str | None, fingerprint: str | None) -> GGUFInfo:
    import struct

    try:
        kv, tensors = _read_header(path, buf)
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError) as e:
        raise CheckpointError(f"{path}: unreadable GGUF header (truncated or damaged?): {e}") from e
    for t in tensors:
        if t.offset + t.n_bytes > size:
            raise CheckpointError(f"{path} is truncated: it has {size} bytes but tensor {t.name!r} "
                                  f"ends at byte {t.offset + t.n_bytes}")

    arch = kv.get("general.architecture")
    if arch != ARCH:
        raise CheckpointError(f"{path}: architecture {arch!r} is not {ARCH!r}; "
                              "this is not a CosyVoice3 speech-LLM GGUF")
    q = cfg.qwen
    expect = {"embedding_length": q.hidden_size, "block_count": q.num_hidden_layers,
              "attention.head_count": q.num_attention_heads, "attention.head_count_kv": q.num_key_value_heads,
              "feed_forward_length": q.intermediate_size}
    bad = [f"{ARCH}.{k} = {kv.get(f'{ARCH}.{k}')} (model dir: {v})" for k, v in expect.items()
           if kv.get(f"{ARCH}.{k}") != v]
    if bad:
        raise CheckpointError(f"{path} does not belong to this model directory: " + "; ".join(bad))

    n_text, n_speech = q.vocab_size, cfg.vocab_size
    meta_layout = kv.get(KEY_PREFIX + "layout")
    file_fp = kv.get(KEY_PREFIX + "llm_fingerprint")
    if meta_layout is not None:
        if meta_layout not in LAYOUTS:
            raise CheckpointError(f"{path}: unknown {KEY_PREFIX}layout {meta_layout!r}; allowed: {', '.join(LAYOUTS)}")
        expect_meta = {"hidden_size": q.hidden_size, "speech_token_size": cfg.speech_token_size,
                       "speech_vocab_size": n_speech, "text_vocab_size": n_text,
                       "speech_offset": 0 if meta_layout == "speech" else n_text,
                       "sos": cfg.sos, "eos": cfg.eos, "task_id": cfg.task_id}
        bad = [f"{KEY_PREFIX}{k} = {kv.get(KEY_PREFIX + k)} (model dir: {v})"
               for k, v in expect_meta.items() if kv.get(KEY_PREFIX + k) != v]
        if bad:
            raise CheckpointError(f"{path} was made for another CosyVoice3 configuration: " + "; ".join(bad))
        if fingerprint is not None and file_fp != fingerprint:
            raise CheckpointError(f"{path} was converted from a different llm.pt (fingerprint {file_fp}, "
                                  f"this model directory's llm.pt: {fingerprint}); convert it again from this "
                                  "model directory")
        found = meta_layout
    else:
        tokens = kv.get("tokenizer.ggml.tokens")
        n_tok = len(tokens) if isinstance(tokens, _StringArray) else 0
        want = SPEECH_TOKEN_FORMAT.format(0)
        if n_tok != n_text + n_speech or tokens[n_text] != want \
                or tokens[n_text + n_speech - 1] != SPEECH_TOKEN_FORMAT.format(n_speech - 1):
            raise CheckpointError(
                f"{path} is not a CosyVoice3 speech-LLM GGUF: it has no {KEY_PREFIX}layout key and its "
                f"vocabulary ({n_tok} tokens) is not the merged layout ({n_text} text + {n_speech} speech "
                f"tokens, {want} at id {n_text}); convert the model with `cosyllama convert`")
        found = "merged"
    if layout is not None and layout != found:
        raise CheckpointError(f"{path} is a {found!r}-layout GGUF, but a {layout!r}-layout file was asked for")

    n_vocab = n_speech if found == "speech" else n_text + n_speech
    shapes = {t.name: t.shape for t in tensors}  # ggml order (ne0, ne1)
    wanted = {"token_embd.weight": (q.hidden_size, n_vocab), "output.weight": (q.hidden_size, n_vocab),
              "output_norm.weight": (q.hidden_size,)}
    for i in range(q.num_hidden_layers):
        for n in ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q.bias",
                  "attn_k.bias", "attn_v.bias", "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight",
                  "ffn_up.weight", "ffn_down.weight"):
            wanted[f"blk.{i}.{n}"] = None
    missing = sorted(set(wanted) - set(shapes))
    if missing:
        raise CheckpointError(f"{path} lacks tensors {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    for n, shp in wanted.items():
        if shp is not None and shapes[n] != shp:
            raise CheckpointError(f"{path}: tensor {n} has ggml shape {shapes[n]}, expected {shp} "
                                  f"for the {found!r} layout of this model")

    ftype = kv.get("general.file_type")
    all_f32 = all(t.ggml_type == _GGML_TYPE_F32 for t in tensors)
    return GGUFInfo(path=path, layout=found, n_vocab=n_vocab, speech_offset=0 if found == "speech" else n_text,
                    type=_FTYPE_NAMES.get(ftype, f"ftype {ftype}") if ftype is not None else "unknown",
                    all_f32=all_f32, fingerprint=file_fp)
