"""The llama.cpp backend against the golden LLM fixtures, batching, cancellation and refusals."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from cosyllama.errors import CheckpointError, DeviceError, InputError, MissingDependencyError
from cosyllama.llm import gguf as G
from cosyllama.llm.backend import LLMBackend, Prefill
from cosyllama.llm.decode import DecodeOptions, generate
from helpers import generate_many, load_fixture

llama_cpp = pytest.importorskip("llama_cpp")
from cosyllama.config import load_config  # noqa: E402
from cosyllama.llm import llamacpp_backend as LB  # noqa: E402
from cosyllama.llm import llamacpp_lib  # noqa: E402
from cosyllama.llm.llamacpp_backend import BackendBusyError, LlamaCppLLM  # noqa: E402

N_THREADS = 1  # tiny model: one thread is fastest, and robust on a busy 2-core machine


@pytest.fixture(scope="module")
def tf():
    arrays, meta = load_fixture("llm_teacher_forced")
    prefill = Prefill(tuple(int(x) for x in np.concatenate([arrays["prompt_text"][0], arrays["text"][0]])),
                      tuple(int(x) for x in arrays["prompt_speech_token"][0]))
    return arrays, prefill, int(arrays["text"].shape[1])


@pytest.fixture(scope="module")
def greedy_tokens():
    return [int(x) for x in load_fixture("llm_greedy")[0]["tokens"]]


_backends: dict = {}


def backend(tiny_gguf, model_dir, layout, type, **kw) -> LlamaCppLLM:
    key = (layout, type, tuple(sorted(kw.items())))
    if key not in _backends:
        _backends[key] = LlamaCppLLM(tiny_gguf(layout, type), load_config(model_dir),
                                     n_threads=N_THREADS, **kw)
    return _backends[key]


def teacher_forced(b: LlamaCppLLM, arrays, prefill) -> np.ndarray:
    cont = [int(t) for t in arrays["continuation"]]
    h, logp = b.start(prefill, len(cont) + 1)
    rows = [logp]
    try:
        for tok in cont:
            rows.append(b.step([(h, tok)])[0])
    finally:
        b.release(h)
    return torch.stack(rows).numpy()


# ----------------------------------------------------------------------------------------------
# Parity with the reference


@pytest.mark.parametrize("layout", ["speech", "merged"])
def test_f32_teacher_forced_logp_matches_reference(tiny_gguf, model_dir, tf, layout):
    arrays, prefill, _ = tf
    b = backend(tiny_gguf, model_dir, layout, "F32")
    assert isinstance(b, LLMBackend) and b.kv_type == "f32" and b.flash_attn is False
    logp = teacher_forced(b, arrays, prefill)
    assert logp.dtype == np.float32 and logp.shape == arrays["logp_cached"].shape
    diff = float(np.abs(logp - arrays["logp_cached"]).max())
    print(f"{layout} F32 max |logp - fixture| = {diff:.2e}")
    assert diff < 1e-4  # measured 1.9e-6 (design.md: ~4e-6)
    np.testing.assert_array_equal(logp.argmax(1), arrays["argmax_cached"])


@pytest.mark.parametrize("layout", ["speech", "merged"])
def test_f16_teacher_forced_logp_close_to_reference(tiny_gguf, model_dir, tf, layout):
    arrays, prefill, _ = tf
    logp = teacher_forced(backend(tiny_gguf, model_dir, layout, "F16"), arrays, prefill)
    diff = float(np.abs(logp - arrays["logp_cached"]).max())
    print(f"{layout} F16 max |logp - fixture| = {diff:.2e}")
    assert diff < 1e-2


@pytest.mark.parametrize("layout", ["speech", "merged"])
def test_greedy_tokens_match_reference(tiny_gguf, model_dir, tf, greedy_tokens, layout):
    _, prefill, n_text = tf
    b = backend(tiny_gguf, model_dir, layout, "F32")
    assert list(generate(b, prefill, n_text, DecodeOptions(greedy=True))) == greedy_tokens
    assert b.stats()["active_sequences"] == 0


@pytest.mark.parametrize("layout", ["speech", "merged"])
def test_f16_greedy_follows_reference_until_a_near_tie(tiny_gguf, model_dir, tf, greedy_tokens, layout):
    """F16 weights move log-probs by ~5e-3 on this random tiny model; the reference's top-2 margin at
    greedy step 9 is only 2.2e-3, so F16 may pick the runner-up there. Before it, tokens must agree."""
    arrays, _ = load_fixture("llm_greedy")
    margins = arrays["step_top5_scores"][:, 0] - arrays["step_top5_scores"][:, 1]
    _, prefill, n_text = tf
    toks = list(generate(backend(tiny_gguf, model_dir, layout, "F16"), prefill, n_text, DecodeOptions(greedy=True)))
    first_diff = next((i for i, (a, b) in enumerate(zip(toks, greedy_tokens)) if a != b), None)
    if first_diff is not None:
        assert margins[first_diff] < 1e-2, (first_diff, margins[first_diff])
        assert first_diff >= 9


@pytest.mark.parametrize("type", list(G.TYPES))
def test_every_type_decodes_valid_tokens(tiny_gguf, model_dir, tf, type):
    """Each quantization converts (tiny rows fall back to F16 where blocks do not fit) and decodes."""
    _, prefill, n_text = tf
    for layout in ("speech", "merged"):
        path = tiny_gguf(layout, type)
        with LlamaCppLLM(path, load_config(model_dir), n_threads=N_THREADS, n_ctx=512) as b:
            assert b.info.type == type and b.layout == layout
            toks = list(generate(b, prefill, n_text, DecodeOptions(greedy=True)))
        assert 0 < len(toks) <= 20 * n_text and all(0 <= t < 6561 for t in toks), (layout, type, toks)


# ----------------------------------------------------------------------------------------------
# Many sequences in one context


def _prefills(tf):
    _, prefill, n_text = tf
    return [
        (prefill, n_text),
        (Prefill(prefill.text_ids, prefill.prompt_speech_tokens[:20]), n_text),  # shorter prompt
        (Prefill(prefill.text_ids[:-3], ()), n_text - 3),  # no prompt speech
    ]


@pytest.mark.parametrize("layout", ["speech", "merged"])
def test_three_sequences_batched_equal_alone(tiny_gguf, model_dir, tf, layout):
    b = backend(tiny_gguf, model_dir, layout, "F32")
    opts = DecodeOptions(greedy=True)
    alone = [list(generate(b, p, n, opts)) for p, n in _prefills(tf)]
    stepped_sizes = []
    real_step = b.step

    def spy(batch):
        stepped_sizes.append(len(batch))
        return real_step(batch)

    b.step = spy
    try:
        together = generate_many(b, [(p, n, opts) for p, n in _prefills(tf)])
    finally:
        del b.step
    assert together == alone
    assert max(stepped_sizes) == 3  # really advanced together
    assert b.stats()["active_sequences"] == 0 and b.stats()["free_sequences"] == b.n_seq_max


def test_batched_logp_equal_single_logp(tiny_gguf, model_dir, tf):
    b = backend(tiny_gguf, model_dir, "speech", "F32")
    (p1, _), (p2, _), (p3, _) = _prefills(tf)
    hs = [b.start(p, 10) for p in (p1, p2, p3)]
    together = b.step([(h, 7) for h, _ in hs])
    for h, _ in hs:
        b.release(h)
    for p, lp in zip((p1, p2, p3), together):
        h, _ = b.start(p, 10)
        (single,) = b.step([(h, 7)])
        b.release(h)
        assert float((single - lp).abs().max()) < 1e-5


def test_cancelled_sequence_frees_its_cells(tiny_gguf, model_dir, tf):
    _, prefill, n_text = tf
    b = backend(tiny_gguf, model_dir, "speech", "F32")
    other, _ = b.start(prefill, 50)
    gen = generate(b, prefill, n_text, DecodeOptions(greedy=True))
    for _ in range(5):
        next(gen)
    s = b.stats()
    assert s["active_sequences"] == 2 and s["free_sequences"] == b.n_seq_max - 2
    cancelled = [h for h in b._active if h is not other][0]
    assert b.cells_used(cancelled.seq_id) == len(prefill) + 4
    gen.close()  # the client went away
    assert b.cells_used(cancelled.seq_id) == 0
    assert b.stats()["active_sequences"] == 1
    assert b.cells_used(other.seq_id) == len(prefill)  # the other request is untouched
    b.release(other)
    b.release(other)  # idempotent
    assert b.stats()["active_sequences"] == 0 and b.stats()["reserved_cells"] == 0
    with pytest.raises(InputError, match="released"):
        b.step([(other, 1)])


def test_slots_exhausted_and_capacity(tiny_gguf, model_dir, tf):
    _, prefill, _ = tf
    with LlamaCppLLM(tiny_gguf("speech", "F32"), load_config(model_dir), n_threads=N_THREADS,
                     n_seq_max=2, n_ctx=512) as b:
        h1, _ = b.start(prefill, 100)
        h2, _ = b.start(prefill, 100)
        with pytest.raises(BackendBusyError, match="all 2 llama.cpp sequences are in use"):
            b.start(prefill, 10)
        b.release(h1)
        with pytest.raises(BackendBusyError, match="free KV cells"):
            b.start(prefill, 300)
        b.release(h2)
        with pytest.raises(InputError, match="more than the context's n_ctx=512"):
            b.start(prefill, 1000)


def test_lazy_context_grows_when_idle(tiny_gguf, model_dir, tf):
    _, prefill, _ = tf
    with LlamaCppLLM(tiny_gguf("speech", "F32"), load_config(model_dir), n_threads=N_THREADS,
                     n_seq_max=2) as b:
        assert b.n_ctx == 0  # nothing allocated before the first request
        h, _ = b.start(prefill, 10)
        assert b.n_ctx == 2 * LB.MIN_CELLS_PER_SEQ
        b.release(h)
        h, _ = b.start(prefill, 3000)
        assert b.n_ctx >= 2 * (len(prefill) + 3000)
        b.release(h)


def test_threads_decoding_concurrently_match_alone(tiny_gguf, model_dir, tf):
    b = backend(tiny_gguf, model_dir, "speech", "F32")
    opts = DecodeOptions(greedy=True)
    reqs = _prefills(tf)
    alone = [list(generate(b, p, n, opts)) for p, n in reqs]
    results: list = [None] * len(reqs)

    def run(i):
        results[i] = list(generate(b, reqs[i][0], reqs[i][1], opts))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone


def test_prefill_longer_than_n_batch_is_split(tiny_gguf, model_dir, tf):
    arrays, prefill, _ = tf
    with LlamaCppLLM(tiny_gguf("speech", "F32"), load_config(model_dir), n_threads=N_THREADS,
                     n_batch=16) as b:
        logp = teacher_forced(b, arrays, prefill)
    assert float(np.abs(logp - arrays["logp_cached"]).max()) < 1e-4


# ----------------------------------------------------------------------------------------------
# Refusals


def test_refuses_bad_inputs(tiny_gguf, model_dir, tf):
    _, prefill, _ = tf
    b = backend(tiny_gguf, model_dir, "speech", "F32")
    with pytest.raises(InputError, match="outside the text vocabulary"):
        b.start(Prefill((10**6,), ()), 5)
    with pytest.raises(InputError, match="prompt speech tokens .* outside 0..6560"):
        b.start(Prefill((1, 2), (6561,)), 5)
    h, _ = b.start(prefill, 2)
    try:
        with pytest.raises(InputError, match="outside 0..6760"):
            b.step([(h, 6761)])
        with pytest.raises(InputError, match="only once per step"):
            b.step([(h, 1), (h, 2)])
        b.step([(h, 1)])
        b.step([(h, 1)])  # positions reserved: prompt + max_new_tokens
        with pytest.raises(InputError, match="used all"):
            b.step([(h, 1)])
    finally:
        b.release(h)
    assert b.stats()["active_sequences"] == 0


def test_backend_refuses_wrong_layout_truncated_and_foreign(tiny_gguf, model_dir, tmp_path):
    speech = tiny_gguf("speech", "F32")
    with pytest.raises(CheckpointError, match="'speech'-layout GGUF, but a 'merged'"):
        LlamaCppLLM(speech, load_config(model_dir), layout="merged")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(speech.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        LlamaCppLLM(cut, load_config(model_dir))
    from test_gguf import write_text_llm
    q = load_config(model_dir).llm.qwen
    chat = write_text_llm(tmp_path / "chat.gguf", q.hidden_size, q.num_hidden_layers, q.num_attention_heads,
                          q.num_key_value_heads, q.intermediate_size, [f"t{i}" for i in range(300)])
    with pytest.raises(CheckpointError, match="not a CosyVoice3 speech-LLM GGUF"):
        LlamaCppLLM(chat, load_config(model_dir))


def test_backend_refuses_gguf_of_another_llm_pt(tiny_gguf, model_dir, tmp_path):
    """Same configuration, different weights: the fingerprint check catches it."""
    import shutil
    d = tmp_path / "other"
    shutil.copytree(model_dir, d)
    sd = torch.load(d / "llm.pt", weights_only=True)
    sd["llm_decoder.weight"] = sd["llm_decoder.weight"] + 0.01
    torch.save(sd, d / "llm.pt")
    with pytest.raises(CheckpointError, match="different llm.pt"):
        LlamaCppLLM(tiny_gguf("speech", "F32"), load_config(d))


def test_gpu_layers_refused_without_gpu_build(tiny_gguf, model_dir):
    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this llama-cpp-python build has GPU support")
    with pytest.raises(DeviceError, match="no GPU support"):
        LlamaCppLLM(tiny_gguf("speech", "F32"), load_config(model_dir), n_gpu_layers=10)


def test_unknown_kv_type(tiny_gguf, model_dir):
    with pytest.raises(InputError, match="allowed: f32, f16"):
        LlamaCppLLM(tiny_gguf("speech", "F32"), load_config(model_dir), kv_type="f8")


def test_missing_llama_cpp_gives_install_hint(monkeypatch):
    import sys
    monkeypatch.setattr(llamacpp_lib, "_llama_cpp", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'cosyllama\[llama\]'"):
        llamacpp_lib.import_llama_cpp()


def test_llama_log_is_silent_by_default(tiny_gguf, model_dir, capfd):
    capfd.readouterr()
    LlamaCppLLM(tiny_gguf("speech", "Q8_0"), load_config(model_dir), n_ctx=256).close()
    assert capfd.readouterr().err == ""
