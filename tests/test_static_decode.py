"""The static-cache LLM backend (fixed-shape decode steps, CUDA graphs on a GPU) run eagerly on the
CPU, held to the dynamic-cache backend and the golden fixtures."""

import pytest
import torch

from cosyllama.config import load_config
from cosyllama.errors import BackendBusyError, InputError
from cosyllama.llm.backend import Prefill
from cosyllama.llm.decode import DecodeOptions, generate
from cosyllama.llm.static_decode import StaticTorchLLM, buckets_for
from cosyllama.llm.torch_backend import TorchLLM
from cosyllama.options import LoadOptions
from cosyllama.weights import load_llm_weights
from helpers import MODEL_DIR, fixture_prefill, generate_many, load_fixture, mixed_requests

LOGP_ATOL = 1e-5  # static vs dynamic cache: the same arithmetic, attention summed over a masked window


def _static(**kw) -> StaticTorchLLM:
    cfg = load_config(MODEL_DIR)
    return StaticTorchLLM(cfg.llm, load_llm_weights(cfg.model_dir / "llm.pt", cfg.llm), **kw)


@pytest.fixture(scope="module")
def dynamic():
    return TorchLLM.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def static():
    return _static(slots=4, ctx=512)


def _teacher_forced(backend, a):
    seq, lp = backend.start(fixture_prefill(a), len(a["continuation"]))
    rows = [lp] + [backend.step([(seq, t)])[0] for t in a["continuation"].tolist()]
    backend.release(seq)
    return torch.stack(rows)


def test_backends_say_what_they_are(static, dynamic):
    # the benchmark scripts print the backend: its settings, not an object address
    assert repr(static) == "StaticTorchLLM(device='cpu', precision='fp32', slots=4, ctx=512, graphs=False)"
    assert repr(dynamic).startswith("TorchLLM(device='cpu', precision='fp32', max_seq_tokens=")


def test_buckets():
    assert buckets_for(1) == (1,)
    assert buckets_for(16) == (1, 2, 4, 8, 16)
    assert buckets_for(6) == (1, 2, 4, 6)


def test_teacher_forced_logp_equals_dynamic_and_fixture(static, dynamic):
    a, _ = load_fixture("llm_teacher_forced")
    got, ref = _teacher_forced(static, a), _teacher_forced(dynamic, a)
    assert (got - ref).abs().max() <= LOGP_ATOL
    assert (got - torch.from_numpy(a["logp_cached"])).abs().max() <= 1e-4
    assert torch.equal(got.argmax(-1), torch.from_numpy(a["argmax_cached"]))


def test_a_small_error_in_the_cache_fails_the_bound(static, dynamic):
    """The tolerance can fail: one cached key nudged by 1e-3 moves the log-probs past it."""
    a, _ = load_fixture("llm_teacher_forced")
    seq, _ = static.start(fixture_prefill(a), len(a["continuation"]))
    static.k[0, seq.index, 0, 1] += 1e-3
    rows = torch.stack([static.step([(seq, t)])[0] for t in a["continuation"].tolist()])
    static.release(seq)
    ref = _teacher_forced(dynamic, a)[1:]
    assert (rows - ref).abs().max() > LOGP_ATOL


def test_greedy_tokens_equal_fixture(static):
    a, _ = load_fixture("llm_greedy")
    toks = list(generate(static, fixture_prefill(a), a["text"].shape[1], DecodeOptions(greedy=True)))
    assert toks == a["tokens"].tolist()
    assert static.active == 0


def test_batched_steps_with_padding_and_compaction_equal_each_alone(static, dynamic):
    """Requests of different lengths decoded together: rows are padded to a bucket, and a request
    that ends moves the highest slot's sequence into its slot. Tokens equal the dynamic backend's."""
    a, _ = load_fixture("llm_greedy")
    pf = fixture_prefill(a)
    reqs = mixed_requests(pf)
    assert generate_many(static, reqs) == generate_many(dynamic, reqs)
    assert static.active == 0


def test_batched_logp_equal_stepping_each_alone_on_the_dynamic_backend(static, dynamic):
    a, _ = load_fixture("llm_teacher_forced")
    base = fixture_prefill(a)
    prefills = [base, Prefill(base.text_ids[:-3], base.prompt_speech_tokens),
                Prefill(base.text_ids, base.prompt_speech_tokens[:-5])]
    toks = a["continuation"].tolist()

    def run(backend, together):
        seqs = [backend.start(p, 16)[0] for p in prefills]
        out = []
        for k in range(4):
            batch = [(s, toks[(k + i) % len(toks)]) for i, s in enumerate(seqs)]
            out.append(torch.stack(backend.step(batch) if together else [backend.step([b])[0] for b in batch]))
        if together:  # a middle sequence ends: the last one moves into its slot and goes on
            backend.release(seqs[1])
            out.append(torch.stack(backend.step([(seqs[0], toks[0]), (seqs[2], toks[1])])))
        else:
            out.append(torch.stack([backend.step([(seqs[0], toks[0])])[0], backend.step([(seqs[2], toks[1])])[0]]
                                   + [torch.zeros(6761)]))
        for s in seqs:
            backend.release(s)
        return out

    got, ref = run(static, True), run(dynamic, False)
    for g, r in zip(got[:4], ref[:4]):
        assert (g - r).abs().max() <= LOGP_ATOL
    assert (got[4] - ref[4][:2]).abs().max() <= LOGP_ATOL


def test_full_pool_is_busy_and_a_long_request_is_refused():
    llm = _static(slots=2, ctx=96)
    a, _ = load_fixture("llm_greedy")
    pf = fixture_prefill(a)
    with pytest.raises(InputError, match="positions"):
        llm.start(pf, 64)  # 76 prompt + 63 fed tokens > 95
    s1, _ = llm.start(pf, 4)
    s2, _ = llm.start(pf, 4)
    with pytest.raises(BackendBusyError):
        llm.start(pf, 4)
    llm.release(s1)
    s3, _ = llm.start(pf, 4)  # the freed slot is taken again
    assert llm.active == 2
    llm.release(s2), llm.release(s3), llm.release(s3)  # releasing twice is harmless
    assert llm.active == 0


def test_prefill_in_pieces_equals_one_pass_even_when_compaction_moves_it(static, dynamic):
    """begin + prefill_step (the scheduler's pieces) give the logp of one pass; a sequence still in
    its prefill may be moved to a lower slot by compaction and goes on from there; stepping it
    before its prompt is in is refused."""
    from cosyllama.llm.backend import LLMBackend

    assert isinstance(static, LLMBackend)  # begin and prefill_step are the protocol's
    a, _ = load_fixture("llm_teacher_forced")
    pf = fixture_prefill(a)
    ref = _teacher_forced(dynamic, a)
    first = static.begin(pf, 8)
    moving = static.begin(pf, len(a["continuation"]))  # slot 1
    assert static.prefill_step(moving, 10) is None
    with pytest.raises(RuntimeError, match="prefill"):
        static.step([(moving, 0)])
    static.release(first)  # compaction: `moving` goes to slot 0 with its 10 positions
    assert moving.index == 0 and moving.length == 10
    pieces = 1
    while (lp := static.prefill_step(moving, 7)) is None:
        pieces += 1
    assert pieces == -(-(moving.length - 10) // 7)  # the prompt's positions (sos, text, task, speech) in 7s
    rows = [lp] + [static.step([(moving, t)])[0] for t in a["continuation"].tolist()]
    assert (torch.stack(rows) - ref).abs().max() <= LOGP_ATOL
    with pytest.raises(RuntimeError, match="complete"):
        static.prefill_step(moving, 7)
    static.release(moving)
    assert static.active == 0


def test_factory_sizes_the_static_slots_from_max_seq_tokens():
    from cosyllama.llm.factory import make_llm

    cfg = load_config(MODEL_DIR)
    llm = make_llm(cfg, "torch", llm_precision="bf16", n_seq_max=1, max_seq_tokens=200)
    assert llm.ctx == 201  # the budget plus the padding rows' scratch column
    with pytest.raises(InputError, match="max_seq_tokens"):
        make_llm(cfg, "torch", llm_precision="bf16", n_seq_max=1, max_seq_tokens=0)


def test_precision_choices():
    with pytest.raises(InputError, match="precision"):
        _static(precision="int4")
    with pytest.raises(InputError, match="CUDA graphs"):
        _static(graphs=True)
    llm = _static(slots=1, ctx=128, precision="bf16")  # runs on the CPU too (slowly): close, not equal
    a, _ = load_fixture("llm_teacher_forced")
    got = _teacher_forced(llm, a)
    assert (got - torch.from_numpy(a["logp_cached"])).abs().max() < 0.5


# ----------------------------------------------------------------------------------------------
# Which backend the factory builds


def test_factory_chooses_the_static_backend_for_half_precision():
    from cosyllama.llm.factory import make_llm

    cfg = load_config(MODEL_DIR)
    assert isinstance(make_llm(cfg, "torch"), TorchLLM)
    llm = make_llm(cfg, "torch", llm_precision="bf16", n_seq_max=2)
    assert isinstance(llm, StaticTorchLLM) and llm.slots == 2 and llm.dtype == torch.bfloat16
    with pytest.raises(InputError, match="LLM precision"):  # checked once, by LoadOptions (the factory asserts)
        LoadOptions(MODEL_DIR, llm_precision="int8")


def test_factory_llamacpp_on_cuda_without_gpu_support_says_how_to_fix_it(tiny_gguf):
    pytest.importorskip("llama_cpp")
    from cosyllama.errors import DeviceError
    from cosyllama.llm.factory import make_llm
    from cosyllama.llm.llamacpp_backend import import_llama_cpp

    if import_llama_cpp().llama_supports_gpu_offload():
        pytest.skip("this llama-cpp-python build has GPU support")
    cfg = load_config(MODEL_DIR)
    gguf = tiny_gguf("speech", "F32")
    with pytest.raises(DeviceError, match="--n-gpu-layers 0"):
        make_llm(cfg, "llamacpp", gguf=gguf, device="cuda")
    with pytest.raises(InputError, match="GGUF's type"):  # checked once, by LoadOptions (the factory asserts)
        LoadOptions(MODEL_DIR, gguf=gguf, llm=None, llm_precision="bf16")
    llm = make_llm(cfg, "llamacpp", gguf=gguf, device="cuda", n_gpu_layers=0, n_seq_max=1)  # explicit: CPU
    llm.close()
