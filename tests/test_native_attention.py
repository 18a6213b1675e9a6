"""The flow's bf16 attention kernel (cosyllama.flow.native_attention, kernels/attention_bf16.cpp).

Where it cannot run (a CPU without AVX512-BF16 as PyTorch sees it, no C++ compiler) the kernel's own tests skip
and what is left checks that the flow then runs PyTorch's attention and says why. The error model the kernel is
held to is stated in :func:`_bound`; a perturbed attention (a 1 % scale error, one visible key dropped, scores
rounded to bf16 as an explicit bf16 matmul would) fails it, which is checked without the kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyllama.errors import InputError
from cosyllama.flow import Flow, native_attention
from cosyllama.flow.dit import chunk_attention_mask
from helpers import MODEL_DIR, load_fixture

MEAN_BOUND, MAX_BOUND = 0.01, 0.1  # the fast paths' mel bound against float32 (tests/test_precision.py)


def _kernel_or_skip():
    lib, why = native_attention.library()
    if lib is None:
        pytest.skip(f"the bf16 attention kernel cannot run here: {why}")


def _inputs(b, h, m, n, d, seed=0, spread=1.5):
    """bf16 q/k/v laid out as the solver's: head-split strided views of one projection."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, m, h, d, generator=g) * spread).to(torch.bfloat16).transpose(1, 2)
    k = (torch.randn(b, n, h, d, generator=g) * spread).to(torch.bfloat16).transpose(1, 2)
    v = torch.randn(b, n, h, d, generator=g).to(torch.bfloat16).transpose(1, 2)
    return q, k, v


def _visible(m, n, row_len):
    return torch.arange(n)[None, :] < (torch.full((m,), n) if row_len is None else row_len.long())[:, None]


def _bound(q, k, v, row_len):
    """Per output, what the kernel's arithmetic may cost against an exact attention of the same bf16 inputs.

    Per output o = sum_j p_j v_j, with w = sum_j p_j |v_j| (exact probabilities): each score is a float32 sum of
    d bf16 x bf16 products (exact in float32) in some order, off by up to d x 2^-24 of sum |q k| x scale, which
    moves a probability by twice that relative, so o by that times w; exp's polynomial is within 2.5e-6
    relative (one more term on w); the probabilities rounded to bf16 (2^-9 relative, 2^-9 x w); the float32
    sum over N keys (N x 2^-24 x w); the output rounded to bf16 (2^-9 x |o|). All doubled. Each term bounds any
    summation order and either rounding direction, so it holds for the kernel (our own code, the same instructions
    on every CPU that runs it: AVX512-BF16 AMD, Intel with AVX512-BF16 or AMX; never an AVX2 CPU) and for
    PyTorch's bf16 attention whichever kernels MKL/oneDNN pick on AMD or Intel."""
    qd, kd, vd = q.double(), k.double(), v.double()
    m, n, d = q.shape[2], k.shape[2], q.shape[3]
    vis = _visible(m, n, row_len)
    probs = torch.softmax((qd @ kd.transpose(-1, -2) * d ** -0.5).masked_fill(~vis, float("-inf")), -1)
    exact = probs @ vd
    w = probs @ vd.abs()
    ds = d * 2.0 ** -24 * (qd.abs() @ kd.abs().transpose(-1, -2)).amax() * d ** -0.5
    u = 2.0 ** -9
    return exact, 2 * ((2 * ds + 2.5e-6 + u + n * 2.0 ** -24) * w + u * exact.abs())


def _ratio(got, q, k, v, row_len=None):
    exact, bound = _bound(q, k, v, row_len)
    return float(((got.double() - exact).abs() / bound).amax())


SHAPES = [  # (batch, heads, queries, keys, channels, chunk): the full model's head, the fixture's, odd sizes
    (2, 16, 150, 150, 64, None), (2, 4, 37, 37, 16, None), (2, 4, 50, 75, 16, 25), (1, 3, 7, 200, 128, None),
    (2, 16, 106, 256, 64, 25), (2, 2, 5, 3, 32, None), (1, 1, 70, 70, 48, 50), (2, 1, 1, 1, 16, None)]


@pytest.mark.parametrize("b,h,m,n,d,chunk", SHAPES)
def test_the_kernel_is_attention_within_its_error_model(b, h, m, n, d, chunk):
    _kernel_or_skip()
    q, k, v = _inputs(b, h, m, n, d, seed=m + n)
    row_len = native_attention.chunk_row_lengths(n, n - m, chunk) if chunk else None
    got = native_attention.attention(q, k, v, row_len)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (b, h, m, d)
    assert got.transpose(1, 2).is_contiguous()  # M-major, as the solver flattens it
    assert _ratio(got, q, k, v, row_len) <= 1
    # and as close as PyTorch's own bf16 attention of the same inputs, within its rounding
    mask = None if row_len is None else _visible(m, n, row_len)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert _ratio(theirs, q, k, v, row_len) <= 1


@pytest.mark.parametrize("n0", [0, 1, 17, 150, 256])
def test_keys_in_two_segments_are_the_joined_keys(n0):
    """``before``: a streaming call's cached K/V read where they lie (laid out as the cache holds them, the new
    frames' as views of the solver's projection) give the bits of the joined keys: the same keys in the same
    order. A split one key off (one key read twice, another dropped) changes them."""
    _kernel_or_skip()
    b, h, m, d, chunk = 2, 16, 40, 64, 50
    n = 256
    q, k, v = _inputs(b, h, m, n, d, seed=n0)
    row_len = native_attention.chunk_row_lengths(n, n - m, chunk)
    whole = native_attention.attention(q, k, v, row_len)
    heads = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731  (B, N, H*D) storage, as cached
    before = (heads(k[:, :, :n0]), heads(v[:, :, :n0]))
    got = native_attention.attention(q, k[:, :, n0:], v[:, :, n0:], row_len, before=before)
    assert torch.equal(got, whole)
    if 0 < n0 < n:
        off = native_attention.attention(q, k[:, :, n0 - 1:], v[:, :, n0 - 1:], row_len,
                                         before=(before[0][:, :, :-1], before[1][:, :, :-1]))
        assert torch.equal(off, whole)  # the same split, one key earlier: still the same keys
        wrong = native_attention.attention(q, k[:, :, n0:], v[:, :, n0:], row_len,
                                           before=(k[:, :, 1:n0 + 1], v[:, :, 1:n0 + 1]))
        assert not torch.equal(wrong, whole)
    # and PyTorch's route (where the kernel declines) joins them
    theirs = native_attention.attend(q, k[:, :, n0:], v[:, :, n0:], _visible(m, n, row_len), row_len, False,
                                     before)
    assert _ratio(theirs, q, k, v, row_len) <= 1


def test_the_error_model_rejects_small_mistakes():
    """What the kernel tests accept: PyTorch's attention in float32 of the bf16 inputs, rounded to bf16, passes;
    a 1 % scale error, the last visible key of each row dropped, or scores rounded to bf16 before the softmax
    fail. No kernel needed."""
    import torch.nn.functional as F

    b, h, m, n, d = 2, 4, 40, 90, 64
    q, k, v = _inputs(b, h, m, n, d, seed=5)
    row_len = native_attention.chunk_row_lengths(n, n - m, 25)
    vis = _visible(m, n, row_len)
    qf, kf, vf = q.float(), k.float(), v.float()
    good = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=vis).to(torch.bfloat16)
    assert _ratio(good, q, k, v, row_len) <= 1
    scaled = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=vis, scale=1.01 * d ** -0.5)
    dropped = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=_visible(m, n, row_len - 1))
    scores = ((qf @ kf.transpose(-1, -2)).to(torch.bfloat16).float() * d ** -0.5).masked_fill(~vis, float("-inf"))
    rounded = torch.softmax(scores, -1) @ vf
    for bad in (scaled, dropped, rounded):
        assert _ratio(bad, q, k, v, row_len) > 1


def test_row_lengths_are_the_chunk_mask():
    for n, start, chunk in ((75, 0, 25), (75, 25, 25), (203, 97, 50), (10, 3, 4)):
        mask = chunk_attention_mask(n, chunk)[start:]
        assert torch.equal(_visible(n - start, n, native_attention.chunk_row_lengths(n, start, chunk)), mask)


def test_the_kernel_declines_what_it_does_not_take():
    _kernel_or_skip()
    q, k, v = _inputs(1, 2, 8, 8, 16)
    assert native_attention.attention(q.float(), k.float(), v.float()) is None  # not bf16
    q2, k2, v2 = _inputs(1, 2, 8, 8, 24)
    assert native_attention.attention(q2, k2, v2) is None  # channels not a multiple of 16
    assert native_attention.attention(q, k, v, torch.ones(3, dtype=torch.int32)) is None  # one length per row
    assert native_attention.attention(q, k[:, :1], v) is None  # heads differ


def test_a_row_that_sees_no_key_is_zero_not_nan():
    _kernel_or_skip()
    q, k, v = _inputs(1, 2, 4, 20, 16)
    out = native_attention.attention(q, k, v, torch.tensor([0, 1, 20, 99], dtype=torch.int32))
    assert torch.isfinite(out.float()).all() and not out[:, :, 0].any()
    assert _ratio(out[:, :, 1:], q[:, :, 1:], k, v, torch.tensor([1, 20, 20])) <= 1  # 99 clamps to the keys


def test_threads_split_heads_without_changing_a_bit(monkeypatch):
    """On PyTorch's OpenMP team (where PyTorch runs on libgomp) or on threads of the kernel's own, any count."""
    _kernel_or_skip()
    q, k, v = _inputs(2, 5, 33, 61, 64, seed=3)
    outs = []
    for team in (native_attention._team(), None):
        monkeypatch.setattr(native_attention, "_team", lambda t=team: t)
        for threads in (1, 2, 3):
            monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
            outs.append(native_attention.attention(q, k, v))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


# ----------------------------------------------------------------------------------------------
# the choice, and where the kernel cannot run


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A clean slate: no loaded kernel, no remembered choice, an empty cache directory."""
    monkeypatch.setenv("COSYLLAMA_CACHE", str(tmp_path))
    monkeypatch.setattr(native_attention, "PREBUILT", tmp_path / "prebuilt")  # none built beside the source
    monkeypatch.delenv(native_attention.ENV, raising=False)
    library = native_attention.library  # a test may stand in for it
    library.cache_clear()
    native_attention._choices.clear()
    yield tmp_path
    library.cache_clear()
    native_attention._choices.clear()


def test_the_setting_is_checked(fresh, monkeypatch):
    monkeypatch.setenv(native_attention.ENV, "fastest")
    with pytest.raises(InputError, match="COSYLLAMA_ATTENTION='fastest': expected one of auto, kernel, pytorch"):
        native_attention.choice(4, 16)
    monkeypatch.setenv(native_attention.ENV, "pytorch")
    monkeypatch.setattr(native_attention, "library", lambda: pytest.fail("built where it would never run"))
    c = native_attention.choice(4, 16)
    assert not c.kernel and c.words() == "attention PyTorch's (COSYLLAMA_ATTENTION=pytorch)"


def test_a_cpu_without_avx512_bf16_never_builds_it(fresh, monkeypatch):
    """As under an emulated AVX2 CPU (QEMU's Haswell): the kernel would die of SIGILL, so it is not even built."""
    from cosyllama import cpu

    monkeypatch.setattr(cpu, "kernel_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    monkeypatch.setattr(native_attention, "build", lambda *a: pytest.fail("built on a CPU that cannot run it"))
    monkeypatch.setenv(native_attention.ENV, "kernel")
    c = native_attention.choice(4, 16)
    assert not c.kernel and "the CPU has no AVX512-BW, AVX512-VL, AVX512-BF16" in c.why
    assert native_attention.attention(*_inputs(1, 1, 4, 4, 16)) is None


def test_no_compiler_means_pytorchs_attention_and_says_so(fresh, monkeypatch):
    from cosyllama import cpu

    monkeypatch.setattr(cpu, "kernel_flags", lambda: frozenset(native_attention.NEEDS))
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    c = native_attention.choice(4, 16)
    assert not c.kernel and c.why == "no bf16 kernel: no C++ compiler to build it (install g++)"


def test_a_failing_compiler_means_pytorchs_attention(fresh, monkeypatch, tmp_path):
    from cosyllama import cpu

    fake = tmp_path / "fake-c++"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'x.cpp:1: error: no bf16 here' >&2; exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(cpu, "kernel_flags", lambda: frozenset(native_attention.NEEDS))
    monkeypatch.setenv("CXX", str(fake))
    c = native_attention.choice(4, 16)
    assert not c.kernel and c.why == "no bf16 kernel: the C++ compiler failed: x.cpp:1: error: no bf16 here"
    assert not list((fresh / "kernels").glob("*.so"))  # no half-built library left to load next time


def test_a_kernel_built_at_install_time_runs_without_a_compiler(fresh, monkeypatch, capsys):
    """What the container image does: ``python -m cosyllama.flow.native_attention`` at build time, a run with
    no compiler then loads that build. The command itself needs a compiler, and says so."""
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert native_attention.main([str(fresh / "prebuilt")]) == 1
    assert "no C++ compiler: set CXX or install g++" in capsys.readouterr().err
    monkeypatch.delenv("CXX")
    if native_attention._compiler() is None:
        pytest.skip("no C++ compiler here")
    assert native_attention.main([]) == 0  # the default place is the one the loader looks in first
    built = capsys.readouterr().out.strip()
    assert built == str(fresh / "prebuilt" / native_attention.library_name())
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    lib, why = native_attention.library()
    if native_attention.cpu_problem() is None:
        assert lib is not None, why
        assert not list(fresh.glob("kernels/*.so"))  # nothing built in the cache
    else:
        assert why == native_attention.cpu_problem()


def test_auto_times_both_once_and_remembers(fresh, monkeypatch):
    _kernel_or_skip()
    calls = []
    real = native_attention.timed_calls

    def spy(*a, **kw):
        calls.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(native_attention, "timed_calls", spy)
    monkeypatch.setattr(native_attention, "CPU_SHARE_MIN", 0.0)  # kept however busy this machine is (below)
    first = native_attention.choice(4, 16)
    assert len(calls) == 1 and calls[0][0] == native_attention.TIMED_FRAMES
    assert {name for name, _ in first.seconds} == {"pytorch", "kernel"}
    assert "x PyTorch's here at 650 frames" in first.why
    native_attention._choices.clear()  # a new process: the record on disk answers
    assert native_attention.choice(4, 16) == first and len(calls) == 1
    assert list((fresh / "kernels").glob("attention_bf16-*.so"))


def test_a_timing_on_a_busy_machine_is_used_but_not_kept(fresh, monkeypatch):
    """The process got 30 % of the CPU its threads asked for while timing: its verdict serves this process and
    the next one times again; a timing with the CPU it asked for is kept. The share is the test's own, so the
    test does not depend on how busy this machine is (the next test measures a real one)."""
    from cosyllama import cpu

    monkeypatch.setattr(cpu, "kernel_flags", lambda: frozenset(native_attention.NEEDS))
    monkeypatch.setattr(native_attention, "library", lambda: (object(), None))
    share = [0.3]
    calls = []

    def timed(*a, shares=None, **kw):
        calls.append(a)
        shares.append(share[0])
        return {"pytorch": 0.030, "kernel": 0.012}

    monkeypatch.setattr(native_attention, "timed_calls", timed)
    records = fresh / "precision-checks.json"
    c = native_attention.choice(16, 64, threads=2)
    assert c.kernel and c.why.startswith("2.50x PyTorch's here")
    assert "the machine was busy, CPU 30% of 2 threads, not kept" in c.why
    assert not records.exists() or "attention|" not in records.read_text()
    native_attention._choices.clear()  # a new process times again
    native_attention.choice(16, 64, threads=2)
    assert len(calls) == 2
    share[0] = 0.95  # quiet: kept, and the next process reads it
    native_attention._choices.clear()
    kept = native_attention.choice(16, 64, threads=2)
    assert "busy" not in kept.why and "attention|" in records.read_text()
    native_attention._choices.clear()
    assert native_attention.choice(16, 64, threads=2) == kept and len(calls) == 3


def test_the_timing_reports_the_cpu_share_of_its_rounds(monkeypatch):
    """Over the timed rounds only (the inputs are drawn on one thread before them): a process that sleeps through
    half of each call got about half of the CPU."""
    import time

    monkeypatch.setattr(native_attention, "attention", lambda *a, **kw: None)  # PyTorch's call alone
    shares = []
    native_attention.timed_calls(64, 2, 16, rounds=3, shares=shares)
    assert len(shares) == 1 and 0.0 < shares[0] < 1.5
    real = native_attention.pytorch_call

    def half_asleep(*a):
        call = real(*a)

        def run():
            end = time.process_time() + 0.02
            while time.process_time() < end:
                pass
            time.sleep(0.02 * torch.get_num_threads())
            return call()
        return run

    monkeypatch.setattr(native_attention, "pytorch_call", half_asleep)
    native_attention.timed_calls(64, 2, 16, rounds=3, shares=shares)
    assert shares[1] < 0.6  # 0.02 s of CPU in each (0.02 + 0.02 x threads) s of wall over the threads


def test_the_kernel_runs_only_where_it_was_faster(fresh, monkeypatch):
    from cosyllama import cpu

    monkeypatch.setattr(cpu, "kernel_flags", lambda: frozenset(native_attention.NEEDS))
    monkeypatch.setattr(native_attention, "library", lambda: (object(), None))
    for pytorch, kernel, use in ((0.030, 0.012, True), (0.030, 0.029, False), (0.010, 0.020, False)):
        native_attention._choices.clear()
        (fresh / "precision-checks.json").unlink(missing_ok=True)
        monkeypatch.setattr(native_attention, "timed_calls",
                            lambda *a, p=pytorch, k=kernel, **kw: {"pytorch": p, "kernel": k})
        c = native_attention.choice(16, 64)
        assert c.kernel is use, c
        assert c.why.startswith(f"{pytorch / kernel:.2f}x PyTorch's here")


# ----------------------------------------------------------------------------------------------
# in the flow


def _flow_args():
    fx = load_fixture("flow")[0]
    t = lambda x: torch.from_numpy(np.asarray(x))  # noqa: E731
    a = (t(fx["token"]), t(fx["prompt_token"]), t(fx["prompt_feat"]), t(fx["embedding"]))
    chunk = (a[0][:, :int(fx["stream_chunk1_n_tokens"][0])], *a[1:])
    return fx, a, chunk


def _mel_diff(a, b):
    d = (torch.as_tensor(a).double() - torch.as_tensor(np.asarray(b)).double()).abs()
    return float(d.mean()), float(d.max())


@pytest.mark.parametrize("precision", ["bf16", "int8-mixed"])
def test_the_flow_on_the_kernel_is_within_the_bound(precision, monkeypatch):
    """The fixture model's whole, streamed-final and first-chunk calls, at bf16 and on the mixed int8 path, with
    every attention on the kernel (PyTorch's attention fails the test if called), are within the fast paths'
    bound of the recorded reference, and close to the same flow on PyTorch's attention."""
    import torch.nn.functional as F

    from cosyllama.flow.fast_dit import int8_engine_problem
    from cosyllama.precision import INT8

    _kernel_or_skip()
    fx, a, chunk = _flow_args()
    flow = Flow.from_dir(MODEL_DIR, precision="fp32")
    if precision == "bf16":
        flow.set_precision("bf16")
    else:
        if int8_engine_problem("onednn+bf16"):
            pytest.skip(int8_engine_problem("onednn+bf16"))
        flow.decoder.set_compute_dtype(INT8, "onednn+bf16")
    runs = (lambda: flow.inference(*a), lambda: flow.inference(*a, streaming=True, finalize=True),
            lambda: flow.inference(*chunk, streaming=True, finalize=False))
    refs = (fx["mel"], fx["mel_streaming_attention_finalize"], fx["stream_chunk1_mel"])
    monkeypatch.setenv(native_attention.ENV, "pytorch")
    theirs = [run() for run in runs]
    monkeypatch.setenv(native_attention.ENV, "kernel")
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *x, **kw: pytest.fail("PyTorch's attention ran"))
    ours = [run() for run in runs]
    monkeypatch.setattr(F, "scaled_dot_product_attention", real)
    for mel, other, ref in zip(ours, theirs, refs):
        mean, mx = _mel_diff(mel, ref)
        assert mean <= MEAN_BOUND and mx <= MAX_BOUND, (mean, mx)
        assert _mel_diff(mel, other)[0] <= MEAN_BOUND / 4


def test_each_path_runs_attention_in_its_activations_dtype():
    """One rule for auto's attention timing and the CPU line, the solver's own (FastDiT.act_dtype)."""
    from cosyllama.flow.check import Candidate
    from cosyllama.flow.fast_dit import INT8_ENGINES, int8_is_mixed
    from cosyllama.precision import INT8

    assert Candidate(torch.float32).attention_dtype == torch.float32
    assert Candidate(torch.bfloat16).attention_dtype == torch.bfloat16
    for engine in INT8_ENGINES:
        want = torch.bfloat16 if int8_is_mixed(engine) else torch.float32
        assert Candidate(INT8, engine).attention_dtype == want, engine
    assert {e for e in INT8_ENGINES if int8_is_mixed(e)} == {"onednn+bf16", "onednn+bf16+static"}


def test_the_cpu_line_names_the_attention(monkeypatch):
    from cosyllama.cpu import CpuPath

    flow = Flow.from_dir(MODEL_DIR, precision="fp32")
    assert flow.attention_words() is None  # float32: PyTorch's float32 attention, nothing to say
    flow.set_precision("bf16")
    monkeypatch.setenv(native_attention.ENV, "pytorch")
    assert flow.attention_words() == "attention PyTorch's (COSYLLAMA_ATTENTION=pytorch)"
    line = CpuPath(threads=2, flow="bf16", llm="torch", attention=flow.attention_words()).lines()[1]
    assert line.endswith("; flow attention PyTorch's (COSYLLAMA_ATTENTION=pytorch)")
    monkeypatch.setenv(native_attention.ENV, "kernel")
    words = flow.attention_words()
    lib, why = native_attention.library()
    assert words == ("attention bf16 kernel (COSYLLAMA_ATTENTION=kernel)" if lib is not None
                     else f"attention PyTorch's (no bf16 kernel: {why})")
