"""Names of our GGUF files, in one place: the layouts, the ``cosyllama.*`` metadata keys, and the one
table of tensors: which ``llm.pt`` tensor each GGUF tensor of the speech LLM holds. The writer
(:mod:`cosyllama.llm.gguf`), the checker (:mod:`cosyllama.llm.gguf_read`) and the tests read it.

Tensor and file-type names come from gguf-py's own tables (``gguf.TENSOR_NAMES``,
``gguf.LlamaFileType``), which is why the functions here import ``gguf`` (the ``llama`` extra)
when called; importing this module needs nothing.
"""

from __future__ import annotations

from ..errors import MissingDependencyError

LAYOUTS = ("speech", "merged")
ARCH = "qwen2"  # gguf.MODEL_ARCH.QWEN2's name: llama.cpp sees a plain Qwen2
KEY_PREFIX = "cosyllama."
FORMAT_VERSION = 1
SPEECH_TOKEN_FORMAT = "<|s_{}|>"  # merged-layout name of speech token k

# Per transformer block: (gguf.MODEL_TENSOR member, suffix, llm.pt key after "layers.{i}."), in file order.
BLOCK_TENSORS = (
    ("ATTN_NORM", "weight", "input_layernorm.weight"),
    ("ATTN_Q", "weight", "self_attn.q_proj.weight"),
    ("ATTN_Q", "bias", "self_attn.q_proj.bias"),
    ("ATTN_K", "weight", "self_attn.k_proj.weight"),
    ("ATTN_K", "bias", "self_attn.k_proj.bias"),
    ("ATTN_V", "weight", "self_attn.v_proj.weight"),
    ("ATTN_V", "bias", "self_attn.v_proj.bias"),
    ("ATTN_OUT", "weight", "self_attn.o_proj.weight"),
    ("FFN_NORM", "weight", "post_attention_layernorm.weight"),
    ("FFN_GATE", "weight", "mlp.gate_proj.weight"),
    ("FFN_UP", "weight", "mlp.up_proj.weight"),
    ("FFN_DOWN", "weight", "mlp.down_proj.weight"),
)
# The two vocabulary tables: the speech rows alone (speech layout) or text + speech rows (merged).
VOCAB_TENSORS = (("TOKEN_EMBD", "weight", "speech_embedding.weight"), ("OUTPUT", "weight", "llm_decoder.weight"))
OUTPUT_NORM = ("OUTPUT_NORM", "weight", "norm.weight")
TEXT_TABLE = "embed_tokens.weight"  # llm.pt's Qwen text embedding: the merged layout's first rows

# Output type names, in the order `cosyllama convert --type` lists them; each (except F32, written
# directly) is llama.cpp's LLAMA_FTYPE_MOSTLY_<name>, gguf-py's LlamaFileType.MOSTLY_<name>.
TYPE_NAMES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S",
              "Q4_1", "Q4_0", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K")


def import_gguf():
    """The ``gguf`` package, or an install hint."""
    try:
        import gguf
    except ImportError:
        raise MissingDependencyError("GGUF files need the gguf package: pip install 'cosyllama[llama]'") from None
    return gguf


def _name(gguf, member: str, suffix: str, block: int | None = None) -> str:
    name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[member]]
    return (name.format(bid=block) if block is not None else name) + "." + suffix


def tensor_table(n_layers: int) -> dict[str, str]:
    """GGUF tensor name -> ``llm.pt`` key (body prefix stripped, as :func:`load_llm_weights` returns
    them), in the order the file holds them. The vocabulary tables map to their speech rows."""
    gguf = import_gguf()
    member, suffix, key = VOCAB_TENSORS[0]
    table = {_name(gguf, member, suffix): key}
    for i in range(n_layers):
        for member, suffix, key in BLOCK_TENSORS:
            table[_name(gguf, member, suffix, i)] = f"layers.{i}.{key}"
    for member, suffix, key in (OUTPUT_NORM, VOCAB_TENSORS[1]):
        table[_name(gguf, member, suffix)] = key
    return table


def vocab_tensor_names() -> tuple[str, ...]:
    """GGUF names of the two vocabulary tables (token_embd, output)."""
    gguf = import_gguf()
    return tuple(_name(gguf, m, s) for m, s, _ in VOCAB_TENSORS)


def output_norm_name() -> str:
    gguf = import_gguf()
    return _name(gguf, *OUTPUT_NORM[:2])


def file_type_ids() -> dict[str, int]:
    """Output type name -> llama.cpp file type id (``general.file_type``), from gguf-py's table."""
    gguf = import_gguf()
    return {n: int(gguf.LlamaFileType.ALL_F32 if n == "F32" else gguf.LlamaFileType[f"MOSTLY_{n}"])
            for n in TYPE_NAMES}
