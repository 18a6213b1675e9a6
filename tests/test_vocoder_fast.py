"""The vocoder's fast conv stack (channels-last activations, polyphase upsampling convs) against the
module-by-module reference path it replaces by default."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cosyllama.config import load_config
from cosyllama.errors import InputError
from cosyllama.vocoder import HiFT, ResBlock, Snake, source_noise_state
from cosyllama.vocoder.fast import _FastConv, _FastResBlock, _FastSnake, _FastUpsample
from cosyllama.vocoder.modules import causal_conv
from helpers import MODEL_DIR, load_fixture

CL = torch.channels_last
# Fast vs reference waveform on the fixture model. The two paths differ only by float rounding
# (oneDNN's channels-last kernels sum in another order; the upsampling taps are pre-summed); the
# fixture model drives exp() magnitudes to the 100 clamp, which scales that rounding up to ~1.5e-4
# (the reference path alone moves by up to 6.4e-5 between 1 and 2 threads). A misplaced sample,
# tap or phase shows up as >1e-2.
FAST_WAV_ATOL = 4e-4


def t(x):
    return torch.from_numpy(np.asarray(x))


def cl(x: torch.Tensor) -> torch.Tensor:
    return x[:, :, None, :].contiguous(memory_format=CL)


def ncw(x: torch.Tensor) -> torch.Tensor:
    return x[:, :, 0, :]


@pytest.fixture(scope="module")
def hift():
    return HiFT.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def fx():
    return load_fixture("hift")[0]


def both(h: HiFT, mel: torch.Tensor, finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        h.fast = False
        ref = h.inference(mel, finalize=finalize)
        h.fast = True
        return h.inference(mel, finalize=finalize), ref
    finally:
        h.fast = True


# ----------------------------------------------------------------------------------------------
# Building blocks, in float64 so that "equal" means equal to ~1e-12


@pytest.mark.parametrize("rate, k", [(8, 16), (5, 11), (3, 7), (2, 2), (4, 3), (3, 1), (2, 9)])
def test_polyphase_upsample_equals_nearest_then_causal_conv(rate, k):
    torch.manual_seed(rate * 100 + k)
    conv = nn.Conv1d(6, 5, k).double()
    x = torch.randn(1, 6, 13, dtype=torch.float64)
    ref = causal_conv(conv, x.repeat_interleave(rate, dim=2))
    up = _FastUpsample(conv, rate, torch.float64)
    out = up(cl(x))
    assert out.is_contiguous(memory_format=CL)
    assert out.shape == (1, 5, 1, 13 * rate)
    assert torch.allclose(ncw(out), ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("k, dilation, stride", [(3, 1, 1), (7, 3, 1), (11, 5, 1), (1, 1, 1)])
def test_fast_causal_conv_equals_left_padded_conv(k, dilation, stride):
    torch.manual_seed(k + dilation)
    conv = nn.Conv1d(4, 7, k, dilation=dilation, stride=stride).double()
    x = torch.randn(1, 4, 50, dtype=torch.float64)
    out = _FastConv(conv, torch.float64)(cl(x))
    assert out.shape == (1, 7, 1, 50) and out.is_contiguous(memory_format=CL)
    assert torch.allclose(ncw(out), causal_conv(conv, x), rtol=0, atol=1e-12)


def test_fast_strided_conv_equals_reference_source_down():
    torch.manual_seed(3)
    conv = nn.Conv1d(18, 8, 30, stride=15).double()
    s = torch.randn(1, 18, 15 * 8 + 1, dtype=torch.float64)
    ref = conv(F.pad(s, (14, 0)))
    out = _FastConv(conv, torch.float64, causal=False)(cl(F.pad(s, (14, 0))))
    assert out.shape == ref[:, :, None, :].shape
    assert torch.allclose(ncw(out), ref, rtol=0, atol=1e-12)


def test_fast_snake_is_bit_identical_and_resblock_close():
    torch.manual_seed(0)
    rb = ResBlock(16, 7, (1, 3, 5))
    for m in rb.modules():
        if isinstance(m, Snake):
            m.alpha.data.uniform_(0.2, 3.0)
    x = torch.randn(1, 16, 301) * 2
    with torch.no_grad():
        snake = rb.activations1[1]
        assert torch.equal(ncw(_FastSnake(snake, torch.float32)(cl(x))), snake(x))
        ref = rb(x)
        out = _FastResBlock(rb, torch.float32)(cl(x))
    assert out.is_contiguous(memory_format=CL)
    assert (ncw(out) - ref).abs().max() <= 1e-5 * ref.abs().max()
    x_in = cl(x)
    before = x_in.clone()
    _FastResBlock(rb, torch.float32)(x_in)
    assert torch.equal(x_in, before), "a resblock must not modify its input (three blocks share it)"


# ----------------------------------------------------------------------------------------------
# Whole vocoder


@pytest.mark.parametrize("key", ["mel", "mel_full", "mel_b"])
@pytest.mark.parametrize("finalize", [True, False])
def test_fast_path_matches_reference_path_on_fixture_mels(key, finalize, hift, fx):
    assert hift.fast, "the fast path is the default"
    out, ref = both(hift, t(fx[key]), finalize)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert (out - ref).abs().max() <= FAST_WAV_ATOL


def test_fast_path_matches_reference_at_full_model_widths():
    """The real model's channel counts (512 -> 256/128/64) with random weights: signals stay far
    from the clamp here, so the two paths agree to float32 rounding of the output scale."""
    cfg = load_config(MODEL_DIR)
    hcfg = dataclasses.replace(cfg.hift, base_channels=512, f0_cond_channels=64)
    torch.manual_seed(0)
    h = HiFT(hcfg, source_noise_state(cfg.flow, hcfg)).eval()
    mel = torch.randn(1, 80, 24) - 5.0
    for finalize in (True, False):
        out, ref = both(h, mel, finalize)
        assert out.shape == ref.shape
        assert (out - ref).abs().max() <= 1e-5 * max(ref.abs().max().item(), 1e-3)


def test_fast_path_follows_weight_changes(hift, fx):
    mel = t(fx["mel_b"])
    h = HiFT.from_dir(MODEL_DIR)
    before = h.inference(mel)
    with torch.no_grad():
        h.resblocks[4].convs1[1].weight.mul_(1.5)  # in place: the prepared copies must notice
    out, ref = both(h, mel)
    assert (out - ref).abs().max() <= FAST_WAV_ATOL
    assert (out - before).abs().max() > 1e-2
    h.load_state_dict(hift.state_dict())
    assert torch.equal(h.inference(mel), hift.inference(mel))


def test_fast_bf16_stays_near_reference_bf16(hift, fx):
    """The opt-in bf16 vocoder runs the same fast stack with bf16 weights; it stays as close to the
    float32 output as the module-by-module bf16 path does."""
    mel = t(fx["mel_full"])
    h = HiFT.from_dir(MODEL_DIR, precision="bf16")
    ref32 = hift.inference(mel)
    out, ref = both(h, mel)
    err_fast, err_ref = (out - ref32).abs().mean(), (ref - ref32).abs().mean()
    assert err_fast <= 2 * err_ref + 1e-4


# ----------------------------------------------------------------------------------------------
# Incremental streaming: HiFT.stream_step against re-running the vocoder on all mel so far


# stream_step vs the re-run scheme on the fixture model. Observed: bit-identical except in the last
# (finalizing) window, where oneDNN rounds a shorter conv input differently (8.4e-6, the same size as
# the re-run scheme's own prefix-vs-final difference, 6.8e-6; test_streaming_prefix_call allows 1e-5).
# A window shorter than the receptive field is off by >1e-3 (see the history test below).
STREAM_ATOL = 3e-5
CHUNKINGS = [[50, 40, 30], [70], [30, 20, 10], [9, 1, 1, 20, 7, 3], [1] * 12 + [5] * 6]


def rerun_scheme(h: HiFT, mel: torch.Tensor, chunks: list[int]) -> list[torch.Tensor]:
    """What a streamer that re-vocodes all mel so far emits per call (engine before stream_step)."""
    pos, emitted, out = 0, 0, []
    for c in chunks + [None]:
        final = c is None
        pos = mel.shape[2] if final else min(pos + c, mel.shape[2])
        if not final and pos < 9:  # inference() refuses; nothing to emit yet
            out.append(torch.zeros(1, 0))
            continue
        wav = h.inference(mel[:, :, :pos], finalize=final)
        out.append(wav[:, emitted:])
        emitted = wav.shape[1]
    return out


def incremental(h: HiFT, mel: torch.Tensor, chunks: list[int]) -> list[torch.Tensor]:
    st, pos, out = h.new_stream(), 0, []
    for c in chunks + [None]:
        final = c is None
        c = mel.shape[2] - pos if final else min(c, mel.shape[2] - pos)
        out.append(h.stream_step(st, mel[:, :, pos:pos + c], final))
        pos += c
    assert st.finished and st.emitted == 480 * mel.shape[2]
    return out


@pytest.mark.parametrize("chunks", CHUNKINGS, ids=lambda c: "-".join(map(str, c[:6])))
def test_stream_step_equals_rerun_scheme_per_call(chunks, hift, fx):
    mel = t(fx["mel_full"])
    assert hift.history_frames == 30  # 28.7 frames of receptive field for the real layer sizes
    got, want = incremental(hift, mel, chunks), rerun_scheme(hift, mel, chunks)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        assert g.numel() == 0 or (g - w).abs().max() <= STREAM_ATOL
    assert torch.cat(got, dim=1).shape == (1, 480 * mel.shape[2])


def test_stream_step_needs_its_history(hift, fx):
    """The decoder window must reach back over the receptive field: 20 frames is too short."""
    mel = t(fx["mel_full"])
    want = torch.cat(rerun_scheme(hift, mel, [30, 20, 10]), dim=1)
    h = HiFT.from_dir(MODEL_DIR)
    h.history_frames = 20
    assert (torch.cat(incremental(h, mel, [30, 20, 10]), dim=1) - want).abs().max() > 1e-3


def test_stream_step_at_full_model_widths():
    cfg = load_config(MODEL_DIR)
    hcfg = dataclasses.replace(cfg.hift, base_channels=128, f0_cond_channels=64)
    torch.manual_seed(1)
    h = HiFT(hcfg, source_noise_state(cfg.flow, hcfg)).eval()
    mel = torch.randn(1, 80, 90) - 5.0
    chunks = [50, 13, 20]
    got, want = incremental(h, mel, chunks), rerun_scheme(h, mel, chunks)
    scale = max(w.abs().max().item() for w in want if w.numel())
    for g, w in zip(got, want):
        assert g.shape == w.shape and (g.numel() == 0 or (g - w).abs().max() <= 1e-5 * scale)


@pytest.mark.parametrize("split", [[70], [50, 20], [1] * 70, [3, 30, 37]])
def test_source_continuation_is_bit_identical(split, hift, fx):
    """The phase (a running sum over the utterance) and the noise rows continue exactly."""
    mel = t(fx["mel_full"])
    with torch.no_grad():
        f0 = hift.predict_f0(mel)
        want = hift.source(f0)
        st, pos, parts = hift.new_stream(), 0, []
        for c in split:
            src, st.phase = hift.m_source.continue_source(f0[:, pos:pos + c], st.phase, st.noise)
            parts.append(src)
            pos += c
    assert torch.equal(torch.cat(parts, dim=2), want)


def test_stream_state_stays_bounded_and_is_spent_after_finalize(hift, fx):
    mel = t(fx["mel_full"])
    st = hift.new_stream()
    for i in range(0, 60, 5):
        hift.stream_step(st, mel[:, :, i:i + 5], False)
        keep = hift.history_frames + 5 + 8
        assert st.mel.shape[2] <= keep and st.source.shape[2] <= 480 * keep
    assert st.emitted == 480 * (60 - 8)
    hift.stream_step(st, mel[:, :, 60:], True)
    assert st.mel is None and st.source is None
    with pytest.raises(InputError, match="already finalized"):
        hift.stream_step(st, mel[:, :, :0], True)
    with pytest.raises(InputError, match=r"\(1, 80, n\)"):
        hift.stream_step(hift.new_stream(), torch.zeros(1, 79, 5), False)
    # fewer than 9 frames and not finalizing: nothing yet, then everything at the end
    st = hift.new_stream()
    assert hift.stream_step(st, mel[:, :, :8], False).shape == (1, 0)
    assert hift.stream_step(st, mel[:, :, 8:10], True).shape == (1, 4800)


@pytest.mark.parametrize("case", ["zero_shot_stream", "instruct2_stream"])
def test_stream_step_reproduces_end_to_end_speech(case, hift):
    """The recorded streaming calls, vocoded incrementally from the recorded flow mels, give the
    reference's streamed waveform chunk by chunk."""
    arr, meta = load_fixture(f"e2e_{case}")
    calls = meta["meta"]["token2wav_calls"]
    st, pieces = hift.new_stream(), []
    for k, call in enumerate(calls):
        mel = t(arr[f"flow_call{k}_mel"])[:, :, 2 * call["token_offset"]:]
        pieces.append(hift.stream_step(st, mel, call["finalize"]))
        assert pieces[-1].shape[1] == call["n_samples_out"]
    got = torch.cat(pieces, dim=1)
    assert (got - t(arr["speech"])).abs().max() <= 1e-3


def test_fast_path_on_a_module_built_under_inference_mode(fx):
    """Parameters created under inference_mode have no version counter; the fast path still runs."""
    cfg = load_config(MODEL_DIR)
    with torch.inference_mode():
        h = HiFT(cfg.hift, source_noise_state(cfg.flow, cfg.hift)).eval()
        out, ref = both(h, t(fx["mel_b"]))
    assert out.shape == ref.shape and (out - ref).abs().max() <= FAST_WAV_ATOL


def test_set_precision_prepares_only_the_active_path():
    h = HiFT.from_dir(MODEL_DIR, precision="bf16")
    assert h._fast is not None and h._fast.dtype == torch.bfloat16 and h._lowp is None
    h.fast = False
    h.set_precision("bf16")
    assert h._fast is None and h._lowp is not None
