"""The static-cache torch LLM on CUDA with its decode steps replayed as CUDA graphs, held to the
golden fixtures and to the dynamic-cache backend on the same device.

Run with ``pytest -m gpu`` (skipped without CUDA). ``COSYLLAMA_TEST_DEVICE=cpu`` runs the same
checks eagerly on the CPU (graphs off) to check the tests themselves.
"""

from __future__ import annotations

import os

import pytest
import torch

from cosyllama.config import load_config
from cosyllama.llm.decode import DecodeOptions, generate
from cosyllama.llm.static_decode import StaticTorchLLM
from cosyllama.llm.torch_backend import TorchLLM
from cosyllama.weights import load_llm_weights
from helpers import MODEL_DIR, fixture_prefill, generate_many, load_fixture, mixed_requests

DEVICE = os.environ.get("COSYLLAMA_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="no CUDA device")]

LOGP_ATOL = 1e-4  # against the fixtures, as in test_llm.py
SAME_DEVICE_ATOL = 1e-5  # graphs vs the dynamic cache on one device, as in test_static_decode.py
# bf16 weights: the log-probs of the tiny random model move by up to ~0.1 (measured on the CPU:
# 0.06); a wrong cache or position moves them by whole units.
BF16_ATOL = 0.25


def _static(precision="fp32", slots=4) -> StaticTorchLLM:
    cfg = load_config(MODEL_DIR)
    return StaticTorchLLM(cfg.llm, load_llm_weights(cfg.model_dir / "llm.pt", cfg.llm), DEVICE, slots=slots,
                          ctx=512, precision=precision)


@pytest.fixture(scope="module")
def graphs():
    llm = _static()
    assert llm.graphs == ON_CUDA
    return llm


@pytest.fixture(scope="module")
def dynamic():
    return TorchLLM.from_dir(MODEL_DIR, device=DEVICE)


def _teacher_forced(backend, a) -> torch.Tensor:
    seq, lp = backend.start(fixture_prefill(a), len(a["continuation"]))
    rows = [lp] + [backend.step([(seq, t)])[0] for t in a["continuation"].tolist()]
    backend.release(seq)
    return torch.stack(rows)


def test_graph_logp_equal_fixture_and_dynamic(graphs, dynamic):
    a, _ = load_fixture("llm_teacher_forced")
    got = _teacher_forced(graphs, a)
    assert (got - torch.from_numpy(a["logp_cached"])).abs().max() <= LOGP_ATOL
    assert (got - _teacher_forced(dynamic, a)).abs().max() <= SAME_DEVICE_ATOL


def test_graph_greedy_tokens_equal_fixture(graphs):
    a, _ = load_fixture("llm_greedy")
    got = generate(graphs, fixture_prefill(a), a["text"].shape[1], DecodeOptions(greedy=True))
    assert list(got) == a["tokens"].tolist()


def test_graph_batches_with_padding_and_compaction(graphs, dynamic):
    a, _ = load_fixture("llm_greedy")
    pf = fixture_prefill(a)
    reqs = mixed_requests(pf)
    assert generate_many(graphs, reqs) == generate_many(dynamic, reqs)
    assert graphs.active == 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_graphs_stay_close(precision):
    if precision == "fp16" and not ON_CUDA:
        pytest.skip("fp16 matrix products are a GPU precision")
    a, _ = load_fixture("llm_teacher_forced")
    got = _teacher_forced(_static(precision, slots=2), a)
    assert (got - torch.from_numpy(a["logp_cached"])).abs().max() <= BF16_ATOL


# ----------------------------------------------------------------------------------------------
# llama.cpp with its layers on the GPU (a CUDA build of llama-cpp-python; see docs/gpu.md)

LLAMA_TOL = {"F32": 1e-4, "F16": 1e-2}  # the CPU tests' own (tests/test_llamacpp.py)


@pytest.mark.parametrize("type", list(LLAMA_TOL))
def test_llamacpp_on_the_gpu_matches_the_fixture(tiny_gguf, type):
    llama_cpp = pytest.importorskip("llama_cpp")
    if ON_CUDA and not llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this llama-cpp-python build has no GPU support")
    from cosyllama.llm.factory import make_llm

    cfg = load_config(MODEL_DIR)
    llm = make_llm(cfg, "llamacpp", gguf=tiny_gguf("speech", type), device=DEVICE, n_seq_max=2,
                   n_gpu_layers=None if ON_CUDA else 0)
    try:
        a, _ = load_fixture("llm_teacher_forced")
        got = _teacher_forced(llm, a)
        assert (got - torch.from_numpy(a["logp_cached"])).abs().max() <= LLAMA_TOL[type]
        if type == "F32":
            g, _ = load_fixture("llm_greedy")
            toks = list(generate(llm, fixture_prefill(g), g["text"].shape[1], DecodeOptions(greedy=True)))
            assert toks == g["tokens"].tolist()
    finally:
        llm.close()
