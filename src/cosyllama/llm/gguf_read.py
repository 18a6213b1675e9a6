"""Reading a GGUF header and checking that a file is a GGUF of this model's speech LLM, without
llama.cpp: what :class:`~cosyllama.llm.llamacpp_backend.LlamaCppLLM` runs before loading one."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import LLMConfig
from ..errors import CheckpointError, ModelDirError
from .gguf_names import (
    ARCH,
    KEY_PREFIX,
    LAYOUTS,
    SPEECH_TOKEN_FORMAT,
    file_type_ids,
    import_gguf,
    output_norm_name,
    tensor_table,
    vocab_tensor_names,
)

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


def read_header(path: Path, buf) -> tuple[dict, list[_TensorInfo]]:
    """Parse a GGUF header (key/values and tensor infos) from ``buf`` (an mmap of the file).

    Our own small reader, because :class:`gguf.GGUFReader` materialises every element of the
    tokenizer arrays (about 5 s for the 158k-token merged vocabulary); here string arrays are
    only walked for their offsets and read on demand.
    """
    import struct

    gguf = import_gguf()
    VT = gguf.GGUFValueType
    # Little-endian numpy dtypes of the scalar value types, from gguf-py's own table.
    scalars = {int(t): np.dtype(np_type).newbyteorder("<") for t, np_type in gguf.GGUFReader.gguf_scalar_to_np.items()}
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
        if vtype == VT.STRING:
            return string()
        if vtype == VT.ARRAY:
            etype, count = take("I"), take("Q")
            if etype == VT.STRING:
                offs = np.empty(count, dtype=np.int64)
                for i in range(count):
                    offs[i] = pos
                    pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
                if pos > len(buf):
                    raise ValueError("string array runs past the end of the file")
                return _StringArray(buf, offs)
            if etype in scalars:
                dt = scalars[etype]
                arr = np.frombuffer(buf, dtype=dt, count=count, offset=pos).copy()
                pos += dt.itemsize * count
                return arr
            return [value(etype) for _ in range(count)]
        if vtype in scalars:
            dt = scalars[vtype]
            v = np.frombuffer(buf, dtype=dt, count=1, offset=pos)[0].item()
            pos += dt.itemsize
            return v
        raise ValueError(f"unknown GGUF value type {vtype}")

    _magic, version, n_tensors, n_kv = take("I"), take("I"), take("Q"), take("Q")  # magic: checked by the caller
    if version not in (2, gguf.GGUF_VERSION):
        raise ValueError(f"GGUF version {version} is not supported (2 or {gguf.GGUF_VERSION})")
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
    align = int(kv.get(gguf.Keys.General.ALIGNMENT, gguf.GGUF_DEFAULT_ALIGNMENT))
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
                 fingerprint: str | None = None, weights_name: str = "llm.pt") -> GGUFInfo:
    """Check that ``path`` is a GGUF of this model's speech LLM, without llama.cpp.

    Refuses (with :class:`CheckpointError` / :class:`ModelDirError`) a missing, truncated or
    non-GGUF file, a GGUF of another architecture or size, an unrelated text LLM (no speech
    vocabulary), a file whose recorded CosyVoice3 constants or ``llm.pt`` fingerprint differ from
    ``cfg`` / ``fingerprint`` (of the LLM checkpoint ``weights_name``, named in the message), and
    one whose layout differs from ``layout`` when that is given.
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
        return _check(path, size, buf, cfg, layout, fingerprint, weights_name)
    finally:
        buf.close()


def _check(path: Path, size: int, buf, cfg: LLMConfig, layout: str | None, fingerprint: str | None,
           weights_name: str = "llm.pt") -> GGUFInfo:
    import struct

    gguf = import_gguf()

    try:
        kv, tensors = read_header(path, buf)
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
            made_from = kv.get(KEY_PREFIX + "llm_weights") or "llm.pt"
            if made_from != weights_name:  # made from the other checkpoint of the directory, perhaps
                raise CheckpointError(f"{path} was made from {made_from} (fingerprint {file_fp}), not from "
                                      f"{weights_name} (fingerprint {fingerprint}): choose that file "
                                      f"(--llm-weights {made_from}) or convert again from {weights_name}")
            raise CheckpointError(f"{path} was converted from a different {made_from} (fingerprint {file_fp}, "
                                  f"this model directory's {weights_name}: {fingerprint}); convert it again from "
                                  "this model directory")
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
    wanted: dict[str, tuple[int, ...] | None] = dict.fromkeys(tensor_table(q.num_hidden_layers))
    for name in vocab_tensor_names():
        wanted[name] = (q.hidden_size, n_vocab)
    wanted[output_norm_name()] = (q.hidden_size,)
    missing = sorted(set(wanted) - set(shapes))
    if missing:
        raise CheckpointError(f"{path} lacks tensors {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    for n, shp in wanted.items():
        if shp is not None and shapes[n] != shp:
            raise CheckpointError(f"{path}: tensor {n} has ggml shape {shapes[n]}, expected {shp} "
                                  f"for the {found!r} layout of this model")

    ftype = kv.get("general.file_type")
    all_f32 = all(t.ggml_type == gguf.GGMLQuantizationType.F32 for t in tensors)
    type_names = {v: k for k, v in file_type_ids().items()}
    return GGUFInfo(path=path, layout=found, n_vocab=n_vocab, speech_offset=0 if found == "speech" else n_text,
                    type=type_names.get(ftype, f"ftype {ftype}") if ftype is not None else "unknown",
                    all_f32=all_f32, fingerprint=file_fp)
