"""The int8 flow path and ``auto``'s fidelity check on the loaded weights (tiny fixture model).

int8 is held to the same bound as bf16 (mel mean abs <= 0.01, max <= 0.1 against the float32
reference) on the fixtures' recorded flow calls; ``auto`` keeps a lossy candidate only after
:mod:`cosyllama.flow.check` found it within that bound on the weights loaded, and falls back to
the float32 reference path otherwise (shown with a deliberately broken candidate).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyllama import precision as prec
from cosyllama.cpu import CpuPath
from cosyllama.flow import Flow, check, fast_dit
from cosyllama.precision import INT8
from helpers import MODEL_DIR, load_fixture, recorded_flow_calls

MEAN_BOUND, MAX_BOUND = check.MEAN_BOUND, check.MAX_BOUND
CASES = ["zero_shot_nonstream", "zero_shot_stream", "instruct2_stream", "cross_lingual_nonstream"]

pytestmark = pytest.mark.skipif(not prec.int8_available(), reason="this PyTorch build has no fbgemm int8 kernels")


def _args():
    fx = load_fixture("flow")[0]
    return tuple(torch.from_numpy(np.asarray(fx[k])) for k in ("token", "prompt_token", "prompt_feat", "embedding"))


def _worst(flow, cases=CASES) -> tuple[float, float]:
    worst = (0.0, 0.0)
    for case in cases:
        for _, _, mel, want in recorded_flow_calls(flow, case):
            d = (mel.double() - torch.from_numpy(want).double()).abs()
            worst = (max(worst[0], float(d.mean())), max(worst[1], float(d.max())))
    return worst


@pytest.fixture(scope="module")
def flow_int8():
    return Flow.from_dir(MODEL_DIR, precision="int8")


@pytest.fixture
def isolated_cache(monkeypatch, tmp_path):
    """The check's outcomes in a fresh cache directory and an empty memory."""
    monkeypatch.setenv("COSYLLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(check, "_memory", {})
    return tmp_path / "cache"


def test_int8_stays_within_bound_on_recorded_calls(flow_int8):
    assert flow_int8.precision is INT8 and flow_int8.precision_choice.reason == "fixed by --precision"
    mean, mx = _worst(flow_int8)
    print(f"flow int8 vs upstream fp32 mel, worst over {len(CASES)} e2e cases: mean {mean:.2e} max {mx:.2e}")
    assert mean <= MEAN_BOUND and mx <= MAX_BOUND, (mean, mx)


def test_the_bound_fails_a_coarser_int8(monkeypatch):
    """The same check on 4-bit weights (a deliberate, small-looking error) fails: the bound bites."""
    monkeypatch.setattr(fast_dit, "INT8_WEIGHT_MAX", 7)
    mean, mx = _worst(Flow.from_dir(MODEL_DIR, precision="int8"), CASES[:1])
    assert not (mean <= MEAN_BOUND and mx <= MAX_BOUND), (mean, mx)


@pytest.mark.parametrize("which", ["flow_int8", "flow_mixed"])
def test_int8_streaming_cache_equals_recomputing(which, request):
    from cosyllama.flow import FlowStreamCache

    flow_int8 = request.getfixturevalue(which)

    tok, pt, pf, emb = _args()
    cache = FlowStreamCache()
    n = flow_int8.block_frames // 2 + 3  # tokens for one whole block plus look-ahead
    flow_int8.inference(tok[:, :n], pt, pf, emb, streaming=True, finalize=False, cache=cache)
    m = min(tok.shape[1], 2 * n)
    got = flow_int8.inference(tok[:, :m], pt, pf, emb, streaming=True, finalize=False, cache=cache)
    ref = flow_int8.inference(tok[:, :m], pt, pf, emb, streaming=True, finalize=False)
    assert cache.last_start > 0
    # K/V are computed in float32 and kept in bfloat16: half the memory, and the bound counts that
    assert {t.dtype for kv in cache.kv.values() for t in kv} == {torch.bfloat16}
    stored = sum(t.nbytes for kv in cache.kv.values() for t in kv)
    assert stored == cache.frames * flow_int8.decoder.kv_bytes_per_frame()
    assert flow_int8.decoder.kv_bytes_per_frame() * 2 == Flow.from_dir(MODEL_DIR).decoder.kv_bytes_per_frame()
    # activation scales are per call, so cached frames equal recomputed ones within int8's own error
    # (observed max 0.012 here), not bit for bit: held to the fidelity bound
    d = (got - ref).abs()
    assert float(d.mean()) <= MEAN_BOUND and float(d.max()) <= MAX_BOUND


def test_int8_tail_steps_are_float32(monkeypatch):
    """The int8 solver's float32 tail: with every step in the tail it is the float32 solve."""
    a = _args()
    ref = Flow.from_dir(MODEL_DIR).inference(*a)
    monkeypatch.setattr(fast_dit, "INT8_FP32_LAST_STEPS", 10)
    assert float((Flow.from_dir(MODEL_DIR, precision="int8").inference(*a) - ref).abs().max()) <= 1e-4


def test_fp32_is_the_reference_bit_for_bit_after_int8():
    a = _args()
    flow = Flow.from_dir(MODEL_DIR)
    ref = flow.inference(*a)
    assert flow.set_precision("int8") is INT8
    assert not torch.equal(flow.inference(*a), ref)  # the int8 path really ran
    flow.set_precision("fp32")
    assert torch.equal(flow.inference(*a), ref)


def test_auto_picks_int8_without_native_bf16_and_caches_the_check(monkeypatch, isolated_cache):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    c = flow.precision_choice
    assert flow.precision is INT8 and c.chosen == "int8" and c.check.passed and not c.check.cached
    assert "int8" in c.reason and f"mean {c.check.mean_abs:.4f}" in c.reason
    assert (isolated_cache / "precision-checks.json").exists()
    monkeypatch.setattr(check, "_memory", {})  # a new process: the file answers
    again = Flow.from_dir(MODEL_DIR, precision="auto").precision_choice
    assert again.check.cached and again.check.mean_abs == c.check.mean_abs and again.chosen == "int8"
    line = CpuPath(threads=1, flow=c.chosen, vocoder="fp32", flow_why=c.reason).lines()[1]
    assert line.startswith("precision on cpu: flow int8 (auto (rule of thumb: COSYLLAMA_AUTO=rule): int8 matrix "
                           "products")


def test_auto_falls_back_to_fp32_when_the_candidate_fails_the_check(monkeypatch, isolated_cache):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    real = fast_dit._Int8Linear.__call__
    monkeypatch.setattr(fast_dit._Int8Linear, "__call__", lambda self, x: real(self, x) * 1.05)  # 5 % off
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    c = flow.precision_choice
    assert flow.precision is torch.float32 and c.chosen == "fp32" and not c.check.passed
    assert "fell back to fp32" in c.reason
    ref = Flow.from_dir(MODEL_DIR).inference(*_args())
    assert torch.equal(flow.inference(*_args()), ref)  # the reference path, bit for bit


def test_the_check_reruns_for_changed_weights(monkeypatch, isolated_cache):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    sd = {k: v.clone() for k, v in flow.state_dict().items()}
    flow.load_state_dict(sd)  # same values, but no longer what the file's cached outcome was taken on
    flow.set_precision("auto")
    assert not flow.precision_choice.check.cached


@pytest.fixture(scope="module")
def flow_mixed():
    if "onednn" not in torch.backends.quantized.supported_engines:
        pytest.skip("this PyTorch build has no oneDNN int8 engine")
    flow = Flow.from_dir(MODEL_DIR)
    with pytest.MonkeyPatch.context() as mp:  # bf16 may be emulated here: slow, but the arithmetic is the same
        mp.setattr(prec, "cpu_has_native_bf16", lambda: True)
        flow.set_precision("int8")
        flow.decoder.set_compute_dtype(INT8, "onednn+bf16")
    return flow


def test_mixed_int8_bf16_path_stays_within_bound_and_runs_in_bf16(flow_mixed, monkeypatch):
    """``onednn+bf16``: int8 products, everything between them (attention, the K/V cache, the tail
    steps' products) in bfloat16; the same fidelity bound as every lossy path."""
    solver = flow_mixed.decoder._fast_solver()
    assert solver.act_dtype is torch.bfloat16 and solver.tail_steps == fast_dit.INT8_FP32_LAST_STEPS
    assert all(b["qkv"].bias.dtype is torch.bfloat16 for b in solver.tail_blocks)
    seen = set()
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **kw: seen.add(q.dtype) or real(q, *a, **kw))
    mean, mx = _worst(flow_mixed)
    print(f"flow int8/onednn+bf16 vs upstream fp32 mel: mean {mean:.2e} max {mx:.2e}")
    assert seen == {torch.bfloat16}
    assert mean <= MEAN_BOUND and mx <= MAX_BOUND, (mean, mx)


def test_mixed_path_is_refused_where_bf16_is_emulated(monkeypatch):
    from cosyllama.errors import InputError

    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    flow = Flow.from_dir(MODEL_DIR)
    with pytest.raises(InputError, match="only emulates"):
        flow.decoder.set_compute_dtype(INT8, "onednn+bf16")
    assert "onednn+bf16" not in [c.int8_engine for c in check.candidates(flow)]
