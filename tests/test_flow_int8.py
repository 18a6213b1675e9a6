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
from cosyllama.flow import Flow, auto, check, fast_dit
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
    from cosyllama.flow import native_attention

    seen = set()
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **kw: seen.add(q.dtype) or real(q, *a, **kw))
    kernel = native_attention.attention  # the bf16 kernel, where it runs (tests/test_native_attention.py)
    monkeypatch.setattr(native_attention, "attention", lambda q, *a, **kw: seen.add(q.dtype) or kernel(q, *a, **kw))
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
    assert "onednn+bf16" not in [c.int8_engine for c in auto.candidates(flow)]


# ----------------------------------------------------------------------------------------------
# Static activation scales (onednn+bf16+static): calibrated once on the loaded weights, cached

STATIC = fast_dit.STATIC_ENGINE


def _static_flow(model_dir=MODEL_DIR):
    if fast_dit.int8_engine_problem(STATIC, on_cpu=False):
        pytest.skip(fast_dit.int8_engine_problem(STATIC, on_cpu=False))
    flow = Flow.from_dir(model_dir)
    check.Candidate(INT8, STATIC).apply(flow)
    return flow


@pytest.fixture
def native_bf16(monkeypatch):
    """bf16 counted native (it may be emulated here: slow, but the arithmetic is the same)."""
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: True)


@pytest.fixture
def vnni(monkeypatch):
    """VNNI counted present. Unlike bf16's stand-in the arithmetic may differ here: without VNNI the int8 products
    saturate their int16 pair sums (cosyllama.cpu.has_vnni). So only tests whose assertions hold whatever the
    products compute use it (the static engine's calibration and its cache); its fidelity and its batching are
    tested where the CPU has VNNI, and skipped elsewhere with int8_engine_problem's reason."""
    monkeypatch.setattr(prec, "cpu_has_int8_vnni", lambda: True)


def test_static_int8_stays_within_bound_on_recorded_calls(native_bf16, isolated_cache):
    flow = _static_flow()
    solver = flow.decoder._fast_solver()
    blocks, steps = len(flow.decoder.estimator.transformer_blocks), flow.decoder.n_timesteps
    assert solver.static and solver.act_dtype is torch.bfloat16
    assert len(solver.scales) == blocks and all(len(b) == steps - fast_dit.INT8_FP32_LAST_STEPS
                                                for b in solver.scales)
    mean, mx = _worst(flow)
    print(f"flow int8/{STATIC} vs upstream fp32 mel: mean {mean:.2e} max {mx:.2e}")
    assert mean <= MEAN_BOUND and mx <= MAX_BOUND, (mean, mx)


def test_static_scales_are_calibrated_once_per_weight_file(native_bf16, vnni, isolated_cache, monkeypatch):
    from cosyllama.flow.cfm import CFM

    calls = []
    real = CFM.calibrate_static
    monkeypatch.setattr(CFM, "calibrate_static", lambda self, solve: calls.append(1) or real(self, solve))
    flow = _static_flow()
    first = flow.decoder.static_scales
    check.Candidate(INT8, STATIC).apply(flow)  # the same flow again: its own scales
    assert len(calls) == 1
    monkeypatch.setattr(check, "_memory", {})  # a new process: the cache file answers
    again = _static_flow()
    assert len(calls) == 1 and again.decoder.static_scales == first
    data = (isolated_cache / "precision-checks.json").read_text()
    assert '"calibration|' in data
    # the calibration saw other values than the fidelity check's input
    assert not torch.equal(check.calibration_input(flow)[0][:, :check.CHECK_TOKENS], check.synthetic_input(flow)[0])


def test_static_scales_cover_the_calibrated_range():
    for lo, hi in ((-3.0, 5.0), (0.5, 2.0), (-4.0, -1.0), (0.0, 0.0)):
        scale, zp = fast_dit.static_scale(lo, hi)
        lo0, hi0 = min(lo, 0.0), max(hi, 0.0)
        assert 0 <= zp <= 255
        x = torch.tensor([lo0, 0.0, hi0])
        q = fast_dit.quantize_u8(x, scale, zp)
        assert q[1] == zp  # zero is exact
        back = (q.float() - zp) * scale
        assert torch.allclose(back, x, atol=scale / 2 + 1e-6)
    x = torch.randn(3, 5, 7).transpose(0, 1)  # strided in, row-major out, as int_repr gives
    q = fast_dit.quantize_u8(x, 0.02, 128)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = torch.quantize_per_tensor(x.float(), 0.02, 128, torch.quint8).int_repr()
    assert q.dtype == torch.uint8 and q.is_contiguous() and torch.equal(q, want)


def test_the_static_chain_matches_float_within_its_quantization_step():
    """The feed-forward pair with GELU and the requantization in ff-in's epilogue (uint8 between the two
    products) against float32; a wrong output scale would not pass. Without VNNI the engine is refused
    (int8_engine_problem) and the test skips with that reason, after asserting that the refusal is real: the
    products saturate there, past the bound."""
    problem = fast_dit.int8_engine_problem(STATIC, on_cpu=False)
    if problem and not fast_dit._static_ops_available():
        pytest.skip(problem)
    g = torch.Generator().manual_seed(0)
    d, f = 64, 128
    w1, b1 = torch.randn(f, d, generator=g) / d ** 0.5, torch.randn(f, generator=g) * 0.1
    w2, b2 = torch.randn(d, f, generator=g) / f ** 0.5, torch.randn(d, generator=g) * 0.1
    x = torch.randn(2, 30, d, generator=g)
    hid = torch.nn.functional.gelu(x @ w1.T + b1, approximate="tanh")
    want = hid @ w2.T + b2
    xq, hq = fast_dit.static_scale(float(x.min()), float(x.max())), fast_dit.static_scale(float(hid.min()),
                                                                                           float(hid.max()))
    ff1, ff2 = fast_dit._StaticInt8Linear(w1, b1, gelu=True), fast_dit._StaticInt8Linear(w2, b2)
    h8 = ff1(fast_dit.quantize_u8(x, *xq), xq, torch.uint8, hq)
    assert h8.dtype == torch.uint8
    got = ff2(h8, hq, torch.float32)
    err = float((got - want).abs().mean() / want.abs().mean())
    if not prec.cpu_has_int8_vnni():  # int16 pair sums saturate (2 x 255 x 127 > 32767): measured 0.060 on AVX2
        assert err > 0.03, err
        pytest.skip(problem)
    assert err < 0.03, err
    wrong = ff2(ff1(fast_dit.quantize_u8(x, *xq), xq, torch.uint8, (hq[0] * 2, hq[1])), hq, torch.float32)
    assert float((wrong - want).abs().mean() / want.abs().mean()) > 0.2


def test_miscalibrated_static_scales_fail_the_check(native_bf16, isolated_cache, monkeypatch):
    """Scales that cover a quarter of the observed range (the rest saturates) miss the bound, and ``auto``
    leaves the engine out; the calibration as built passes (test above)."""
    real = fast_dit.static_scale
    monkeypatch.setattr(fast_dit, "static_scale", lambda lo, hi: real(lo / 4, hi / 4))
    flow = _static_flow()
    res = check.check_candidate(flow, check.Candidate(INT8, STATIC))
    assert not res.passed, res


def test_static_engine_needs_its_scales_and_follows_the_step_count(native_bf16, vnni, isolated_cache):
    from cosyllama.errors import InputError

    flow = Flow.from_dir(MODEL_DIR)
    if fast_dit.int8_engine_problem(STATIC, on_cpu=False):
        pytest.skip(fast_dit.int8_engine_problem(STATIC, on_cpu=False))
    with pytest.raises(InputError, match="needs static scales"):
        flow.decoder.set_compute_dtype(INT8, STATIC)
    check.Candidate(INT8, STATIC).apply(flow)
    flow.set_n_timesteps(6)  # recalibrated for the new grid
    assert all(len(b) == 6 - fast_dit.INT8_FP32_LAST_STEPS for b in flow.decoder.static_scales)
    flow.inference(*_args())
    with torch.no_grad():
        flow.decoder.estimator.proj_out.bias.add_(0.0)  # the weights moved on: the scales no longer belong
    with pytest.raises(InputError, match="calibrated on other weights"):
        flow.inference(*_args())


def test_static_rows_are_solved_together_as_each_alone(native_bf16, isolated_cache):
    """Static scales depend on no row, so a batch of requests is one solve whose rows equal their own. Not with
    VNNI stood in: without it the rows' int16 pair sums saturate, and how much depends on the kernel oneDNN picks
    for the row count (an emulated Haswell's batch differed from its rows alone; this AMD AVX2 CPU's did not)."""
    flow = _static_flow()
    a, b = _args(), tuple(t.clone() for t in _args())
    b = (b[0].flip(1),) + b[1:]
    one = [flow.inference(*a), flow.inference(*b)]
    both = flow.inference_batch([a, b])
    for x, y in zip(both, one):  # (a scale shared by the rows, the dynamic path's, differs by ~6e-3 here)
        assert torch.allclose(x, y, atol=1e-4), float((x - y).abs().max())


def test_a_cached_calibration_of_another_shape_is_taken_again(native_bf16, vnni, isolated_cache, monkeypatch):
    import json

    flow = _static_flow()
    good = flow.decoder.static_scales
    path = isolated_cache / "precision-checks.json"
    data = json.loads(path.read_text())
    key = next(k for k in data if k.startswith("calibration|"))
    data[key]["scales"] = data[key]["scales"][:1]  # one block short
    path.write_text(json.dumps(data))
    monkeypatch.setattr(check, "_memory", {})
    again = _static_flow()
    assert again.decoder.static_scales == good
