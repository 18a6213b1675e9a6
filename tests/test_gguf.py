"""GGUF export (both layouts, every type) and the checks that refuse files not made for the model."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from cosyllama.config import load_config
from cosyllama.errors import CheckpointError, InputError, ModelDirError
from cosyllama.llm import gguf as G
from cosyllama.llm import gguf_read as R
from cosyllama.llm.gguf_names import tensor_table

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="session")
def cfg(model_dir):
    return load_config(model_dir).llm


def _kv(path):
    """Scalar/string metadata of a small GGUF via the gguf package's reader."""
    r = gguf.GGUFReader(path)
    out = {}
    for k, f in r.fields.items():
        if not (f.types and f.types[0] == gguf.GGUFValueType.ARRAY):
            out[k] = f.contents()
    return r, out


def test_speech_layout_metadata_and_tensors(tiny_gguf, model_dir, cfg):
    path = tiny_gguf("speech", "F32")
    r, kv = _kv(path)
    q = cfg.qwen
    assert kv["general.architecture"] == "qwen2"
    assert kv["tokenizer.ggml.model"] == "none" and kv["qwen2.vocab_size"] == 6761
    assert kv["qwen2.embedding_length"] == q.hidden_size and kv["qwen2.block_count"] == q.num_hidden_layers
    assert kv["qwen2.attention.head_count_kv"] == q.num_key_value_heads
    assert kv["cosyllama.layout"] == "speech" and kv["cosyllama.speech_token_size"] == 6561
    assert (kv["cosyllama.sos"], kv["cosyllama.eos"], kv["cosyllama.task_id"]) == (6561, 6562, 6563)
    assert kv["cosyllama.text_vocab_size"] == q.vocab_size and kv["cosyllama.n_special"] == 200
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 3 + 12 * q.num_hidden_layers
    # The speech layout's token_embd / output are exactly speech_embedding / llm_decoder.
    from cosyllama.weights import load_llm_weights
    w = load_llm_weights(model_dir / "llm.pt", cfg)
    emb = np.asarray(tensors["token_embd.weight"].data).reshape(6761, q.hidden_size)
    out = np.asarray(tensors["output.weight"].data).reshape(6761, q.hidden_size)
    np.testing.assert_array_equal(emb, w["speech_embedding.weight"].float().numpy())
    np.testing.assert_array_equal(out, w["llm_decoder.weight"].float().numpy())
    assert kv["cosyllama.llm_fingerprint"] == R.llm_fingerprint(w, q.num_hidden_layers)


def test_merged_layout_vocabulary(tiny_gguf, model_dir, cfg):
    path = tiny_gguf("merged", "F32")
    n_text = cfg.qwen.vocab_size
    info = R.inspect_gguf(path, cfg)
    assert (info.layout, info.n_vocab, info.speech_offset, info.type) == ("merged", n_text + 6761, n_text, "F32")
    import mmap
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    kv, tensors = R.read_header(path, buf)
    toks = kv["tokenizer.ggml.tokens"]
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "qwen2"
    assert len(toks) == n_text + 6761
    assert toks[n_text] == "<|s_0|>" and toks[n_text + 6760] == "<|s_6760|>"
    assert toks[151643] == "<|endoftext|>" and toks[0] == "!"
    assert toks[151646] == "<|endofprompt|>" and toks[151923] == "[ǜ]" and toks[151924] == "[PAD151924]"
    from cosyllama.text.tokenizer import TextTokenizer
    tk = TextTokenizer(model_dir / "CosyVoice-BlankEN")
    ids = tk.encode("<|endofprompt|>[breath][AA1]")
    assert [toks[i] for i in ids] == ["<|endofprompt|>", "[breath]", "[AA1]"]
    assert len(kv["tokenizer.ggml.merges"]) > 0
    shapes = {t.name: t.shape for t in tensors}
    assert shapes["token_embd.weight"] == shapes["output.weight"] == (cfg.qwen.hidden_size, n_text + 6761)
    buf.close()


def test_convert_refuses_overwrite_and_bad_options(tiny_gguf, model_dir, tmp_path):
    path = tiny_gguf("speech", "F32")
    with pytest.raises(InputError, match="already exists.*force"):
        G.convert(model_dir, path, type="F32")
    with pytest.raises(InputError, match="allowed: F32, F16"):
        G.convert(model_dir, tmp_path / "x.gguf", type="Q9_9")
    with pytest.raises(InputError, match="allowed: speech, merged"):
        G.convert(model_dir, tmp_path / "x.gguf", layout="text")
    out = tmp_path / "forced.gguf"
    out.write_bytes(b"old")
    seen = []
    G.convert(model_dir, out, type="F32", force=True, progress=lambda *a: seen.append(a))
    assert R.inspect_gguf(out, load_config(model_dir).llm).layout == "speech"
    assert seen[-1] == ("write", 27, 27)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forced.gguf"]  # no temp files left


def test_quantize_reports_progress_and_ftype_constants(tmp_path, model_dir):
    llama_cpp = pytest.importorskip("llama_cpp")
    for name, const in G.TYPES.items():
        if const is not None:
            assert getattr(llama_cpp, const) == G.FTYPE_IDS[name], name
    seen = []
    out = G.convert(model_dir, tmp_path / "q.gguf", type="q8_0", progress=lambda *a: seen.append(a))
    assert ("quantize", 27, 27) in seen
    assert R.inspect_gguf(out, load_config(model_dir).llm).type == "Q8_0"


# ----------------------------------------------------------------------------------------------
# Refusals


def test_refuses_wrong_layout(tiny_gguf, model_dir, cfg):
    speech = tiny_gguf("speech", "F32")
    with pytest.raises(CheckpointError, match="is a 'speech'-layout GGUF, but a 'merged'-layout file was asked"):
        R.inspect_gguf(speech, cfg, layout="merged")


def test_refuses_other_llm_pt(tiny_gguf, model_dir, cfg):
    speech = tiny_gguf("speech", "F32")
    with pytest.raises(CheckpointError, match="converted from a different llm.pt"):
        R.inspect_gguf(speech, cfg, fingerprint="0" * 32)


def test_refuses_other_constants(tiny_gguf, model_dir, cfg):
    import dataclasses
    speech = tiny_gguf("speech", "F32")
    other = dataclasses.replace(cfg, speech_token_size=4096)
    with pytest.raises(CheckpointError, match="another CosyVoice3 configuration.*speech_token_size = 6561"):
        R.inspect_gguf(speech, other)


def test_refuses_truncated_and_non_gguf(tiny_gguf, model_dir, cfg, tmp_path):
    speech = tiny_gguf("speech", "F32")
    data = speech.read_bytes()
    for cut in (len(data) // 2, 200, len(data) - 1):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            R.inspect_gguf(bad, cfg)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        R.inspect_gguf(junk, cfg)
    with pytest.raises(ModelDirError, match="does not exist"):
        R.inspect_gguf(tmp_path / "missing.gguf", cfg)


def write_text_llm(path, hidden: int, n_layers: int, heads: int, kv_heads: int, ff: int, vocab: list[str]):
    """A plain Qwen2 text LLM GGUF (random weights, ordinary BPE vocabulary), like any chat model."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(vocab)
    w.add_token_types([1] * len(vocab))
    w.add_token_merges(["a b"])

    def t(name, *shape):
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    kvd = hidden // heads * kv_heads
    # Shapes per llm.pt key (rows, columns as torch holds them); names from the one GGUF name table.
    shape = {"input_layernorm.weight": (hidden,), "self_attn.q_proj.weight": (hidden, hidden),
             "self_attn.q_proj.bias": (hidden,), "self_attn.k_proj.weight": (kvd, hidden),
             "self_attn.k_proj.bias": (kvd,), "self_attn.v_proj.weight": (kvd, hidden),
             "self_attn.v_proj.bias": (kvd,), "self_attn.o_proj.weight": (hidden, hidden),
             "post_attention_layernorm.weight": (hidden,), "mlp.gate_proj.weight": (ff, hidden),
             "mlp.up_proj.weight": (ff, hidden), "mlp.down_proj.weight": (hidden, ff), "norm.weight": (hidden,),
             "speech_embedding.weight": (len(vocab), hidden), "llm_decoder.weight": (len(vocab), hidden)}
    for name, key in tensor_table(n_layers).items():
        t(name, *shape[key.split(".", 2)[2] if key.startswith("layers.") else key])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_refuses_unrelated_text_llm(model_dir, cfg, tmp_path):
    q = cfg.qwen
    vocab = [f"t{i}" for i in range(300)]
    same_dims = write_text_llm(tmp_path / "chat.gguf", q.hidden_size, q.num_hidden_layers, q.num_attention_heads,
                               q.num_key_value_heads, q.intermediate_size, vocab)
    with pytest.raises(CheckpointError, match=r"not a CosyVoice3 speech-LLM GGUF.*\(300 tokens\).*<\|s_0\|>"):
        R.inspect_gguf(same_dims, cfg)
    wider = write_text_llm(tmp_path / "wide.gguf", 32, 2, 4, 2, 64, vocab)
    with pytest.raises(CheckpointError, match="does not belong to this model directory: qwen2.embedding_length = 32"):
        R.inspect_gguf(wider, cfg)


def test_foreign_merged_file_is_detected_from_its_vocabulary(model_dir, cfg, tmp_path):
    """A merged GGUF converted by another tool carries no cosyllama.* keys; its <|s_k|> tokens identify it."""
    from cosyllama.weights import load_llm_weights
    c = load_config(model_dir)
    w = load_llm_weights(model_dir / "llm.pt", cfg)
    path = tmp_path / "foreign-merged.gguf"
    G._write_f32(path, w, cfg, c.qwen_dir, "merged", "unused", None, cosyllama_keys=False)
    info = R.inspect_gguf(path, cfg, fingerprint=R.llm_fingerprint(w, cfg.qwen.num_hidden_layers))
    assert (info.layout, info.fingerprint) == ("merged", None)
    with pytest.raises(CheckpointError, match="'merged'-layout GGUF, but a 'speech'"):
        R.inspect_gguf(path, cfg, layout="speech")


def test_fingerprint_tracks_weights(model_dir, cfg):
    from cosyllama.weights import load_llm_weights
    w = dict(load_llm_weights(model_dir / "llm.pt", cfg))
    a = R.llm_fingerprint(w, cfg.qwen.num_hidden_layers)
    w["llm_decoder.weight"] = w["llm_decoder.weight"].clone()
    w["llm_decoder.weight"][0, 0] += 1e-3
    assert R.llm_fingerprint(w, cfg.qwen.num_hidden_layers) != a


def test_model_dir_without_tokenizer_cannot_make_merged(model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(model_dir, d, ignore=shutil.ignore_patterns("flow.pt", "hift.pt"))
    (d / "flow.pt").touch()
    (d / "hift.pt").touch()
    (d / "CosyVoice-BlankEN" / "vocab.json").write_text("{not json")
    with pytest.raises(ModelDirError, match="Qwen tokenizer files"):
        G.convert(d, tmp_path / "m.gguf", layout="merged", type="F32")
    assert not (tmp_path / "m.gguf").exists()
