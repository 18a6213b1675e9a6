"""HiFT vocoder against the upstream fixtures (hift.npz, noise_buffers.npz, e2e_*.npz)."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cosyllama.config import load_config
from cosyllama.errors import CheckpointError, DeviceError, InputError
from cosyllama.flow import Flow
from cosyllama.vocoder import HiFT, replay_source_rng, source_noise, source_noise_state
from helpers import MODEL_DIR, load_fixture, maxdiff
from stage_checks import check_whole_waveform

F0_RTOL = 1e-5
SOURCE_ATOL = 1e-4
WAV_ATOL = 1e-3  # fixture README §7: HiFT convolutions are not bit-stable across thread counts
CASES = {"": ("mel", "f0", "source", "speech"), "full": ("mel_full", "f0_full", "source_full", "speech_full"),
         "b": ("mel_b", "f0_b", "source_b", "speech_b")}


@pytest.fixture(scope="module")
def fx():
    return load_fixture("hift")[0]


@pytest.fixture(scope="module")
def hift():
    return HiFT.from_dir(MODEL_DIR)


def t(x):
    return torch.from_numpy(np.asarray(x))


# ----------------------------------------------------------------------------------------------
# Replayed noise buffers


def test_source_noise_replay_matches_upstream_buffers():
    cfg = load_config(MODEL_DIR)
    nb = load_fixture("noise_buffers")[0]
    before = torch.get_rng_state()
    gen, rand_ini = replay_source_rng(cfg.flow, cfg.hift)
    noise = source_noise(source_noise_state(cfg.flow, cfg.hift), nb["hift_sine_noise_prefix_u24"].shape[1], 9)
    assert torch.equal(torch.get_rng_state(), before), "the global RNG must not be touched"
    assert np.array_equal(rand_ini.numpy(), nb["hift_rand_ini"])
    codes = nb["hift_sine_noise_prefix_u24"]
    assert np.array_equal(noise.numpy(), codes.astype(np.float32) * np.float32(2.0 ** -24))


def test_source_noise_replay_full_size_config():
    """The real model's sizes give rand_ini = [0, 0.1710, ...] and sine_waves[0, 0, :3]
    (docs/reference.md#source-noise)."""
    cfg = load_config(MODEL_DIR)
    flow = dataclasses.replace(cfg.flow, vocab_size=6561, input_size=80, output_size=80, spk_embed_dim=192)
    hcfg = dataclasses.replace(cfg.hift, f0_in_channels=80, f0_cond_channels=512)
    _, rand_ini = replay_source_rng(flow, hcfg)
    assert torch.allclose(rand_ini[0, :4], torch.tensor([0, 0.1710, 0.1653, 0.1438]), atol=1e-4)
    first = source_noise(source_noise_state(flow, hcfg), 1, 9)
    assert torch.allclose(first[0, 0, :3], torch.tensor([0.9228, 0.4774, 0.8271]), atol=1e-4)


# ----------------------------------------------------------------------------------------------
# Non-streaming, stage by stage


@pytest.mark.parametrize("case", list(CASES))
def test_f0_source_and_waveform(case, fx, hift):
    mel_k, f0_k, src_k, wav_k = CASES[case]
    mel = t(fx[mel_k])
    with torch.no_grad():
        f0 = hift.predict_f0(mel)
        np.testing.assert_allclose(f0.numpy(), fx[f0_k], rtol=F0_RTOL, atol=0)
        # Later stages are fed the fixture's own inputs so a failure points at one stage.
        src = hift.source(t(fx[f0_k]))
        assert maxdiff(src, fx[src_k]) <= SOURCE_ATOL
    wav = hift.inference(mel)
    assert wav.dtype == torch.float32 and wav.shape == (1, 480 * mel.shape[2])
    assert maxdiff(wav, fx[wav_k]) <= WAV_ATOL


def test_f0_float64_and_sine_waves(fx, hift):
    with torch.no_grad():
        f0 = hift.f0_predictor(t(fx["mel"]))
        assert f0.dtype == torch.float64
        np.testing.assert_allclose(f0.numpy(), fx["f0_f64"], rtol=1e-9)
        assert maxdiff(hift.m_source.sine_waves(t(fx["f0"])), fx["sine_waves"]) <= SOURCE_ATOL


def test_decode_internals(fx, hift):
    """Module by module on the reference path (the fast path reads prepared copies of the weights
    and calls no module; tests/test_vocoder_fast.py holds it to this path)."""
    seen = {}

    def rec(name):
        return lambda m, i, o: seen.__setitem__(name, o)

    mods = {"conv_pre_out": hift.conv_pre, "conv_post_out": hift.conv_post}
    for i in range(3):
        mods[f"ups{i}_out"] = hift.ups[i]
        mods[f"source_down{i}_out"] = hift.source_downs[i]
        mods[f"source_resblock{i}_out"] = hift.source_resblocks[i]
    hooks = [m.register_forward_hook(rec(name)) for name, m in mods.items()]
    try:
        with torch.no_grad():
            wav = hift.decode_reference(t(fx["mel"]), t(fx["source"]))
    finally:
        for h in hooks:
            h.remove()
    for name in mods:
        assert maxdiff(seen[name], fx[name]) <= WAV_ATOL, name
    assert maxdiff(wav, np.clip(fx["istft_out"], -0.99, 0.99)) <= WAV_ATOL


# ----------------------------------------------------------------------------------------------
# Streaming


def test_streaming_prefix_call(fx, hift):
    n = int(fx["stream_mel_prefix_len"][0])
    mel = t(fx["mel_full"])
    decoded = {}
    real_decode = hift.decode

    def spy(m, s, finalize=True):
        decoded["mel"] = m
        return real_decode(m, s, finalize)

    hift.decode = spy
    try:
        call1 = hift.inference(mel[:, :, :n], finalize=False)
    finally:
        del hift.decode
    assert maxdiff(decoded["mel"], fx["stream_decode_x_call1"]) == 0
    assert call1.shape == (1, 480 * (n - 8))
    assert maxdiff(call1, fx["stream_speech_call1"]) <= WAV_ATOL
    # The streamed prefix equals the start of the finalizing call on the longer mel.
    full = hift.inference(mel, finalize=True)
    assert maxdiff(call1, full[:, :call1.shape[1]]) <= 1e-5
    assert maxdiff(full, fx["speech_full"]) <= WAV_ATOL


@pytest.fixture(scope="module")
def flow():
    return Flow.from_dir(MODEL_DIR)


@pytest.mark.parametrize("case", ["zero_shot_stream", "instruct2_stream", "zero_shot_nonstream_speed1.5"])
def test_token2wav_chain_matches_end_to_end_speech(case, flow, hift):
    """Flow + vocoder driven the way upstream's token2wav does, compared with the e2e waveform."""
    arr, meta = load_fixture(f"e2e_{case}")
    meta = meta["meta"]
    speed = meta["call"]["speed"]
    prompt = (t(arr["in_flow_prompt_speech_token"]), t(arr["in_prompt_speech_feat"]))
    tokens, emb = t(arr["flow_tokens"]), t(arr["in_flow_embedding"])
    mel_so_far, pieces, emitted = None, [], 0
    for k, call in enumerate(meta["token2wav_calls"]):
        mel = flow.inference(tokens[:, :call["n_tokens"]], *prompt, emb, streaming=call["stream"],
                             finalize=call["finalize"])
        assert maxdiff(mel, arr[f"flow_call{k}_mel"]) <= WAV_ATOL
        mel = mel[:, :, 2 * call["token_offset"]:]
        mel_so_far = mel if mel_so_far is None else torch.cat([mel_so_far, mel], dim=2)
        voc_in = mel_so_far
        if speed != 1.0:
            voc_in = F.interpolate(mel_so_far, size=int(mel_so_far.shape[2] / speed), mode="linear")
        wav = hift.inference(voc_in, finalize=call["finalize"])
        pieces.append(wav[:, emitted:])
        emitted = wav.shape[1]
        assert pieces[-1].shape[1] == call["n_samples_out"]
    check_whole_waveform(torch.cat(pieces, dim=1)[0].numpy(), case)  # drift bound: see stage_checks


# ----------------------------------------------------------------------------------------------
# Loading


def _model_with_hift(tmp_path, sd):
    d = tmp_path / "model"
    shutil.copytree(MODEL_DIR, d, ignore=shutil.ignore_patterns("hift.pt", "llm.pt", "flow.pt"))
    (d / "llm.pt").touch()  # the config reader only checks that these exist
    (d / "flow.pt").touch()
    torch.save(sd, d / "hift.pt")
    return d


def _old_style(sd):
    out = {}
    for k, v in sd.items():
        k = k.replace(".parametrizations.weight.original0", ".weight_g")
        out[k.replace(".parametrizations.weight.original1", ".weight_v")] = v
    return out


@pytest.mark.parametrize("variant", ["old_style", "generator_prefix", "old_style_generator_prefix"])
def test_weight_norm_key_styles_and_prefix_give_same_output(tmp_path, variant, fx, hift):
    sd = torch.load(MODEL_DIR / "hift.pt", weights_only=True)
    if "old_style" in variant:
        sd = _old_style(sd)
        assert any(k.endswith(".weight_g") for k in sd)
    if "prefix" in variant:
        sd = {f"generator.{k}": v for k, v in sd.items()}
    other = HiFT.from_dir(_model_with_hift(tmp_path, sd))
    mel = t(fx["mel_b"])
    assert torch.equal(other.inference(mel), hift.inference(mel))


@pytest.mark.parametrize("style", ["new", "old"])
@pytest.mark.parametrize("change, match", [
    ("drop", "missing keys: conv_post.bias"),
    ("rename", "unexpected keys: conv_post.bias_renamed"),
    ("gain", "missing keys: ups.1.{g}"),
])
def test_broken_hift_checkpoint_is_refused_by_name(tmp_path, style, change, match):
    sd = torch.load(MODEL_DIR / "hift.pt", weights_only=True)
    g = "parametrizations.weight.original0"
    if style == "old":
        sd, g = _old_style(sd), "weight_g"
    if change == "drop":
        del sd["conv_post.bias"]
    elif change == "rename":
        sd["conv_post.bias_renamed"] = sd.pop("conv_post.bias")
    else:
        del sd[f"ups.1.{g}"]
    with pytest.raises(CheckpointError, match=match.format(g=g).replace(".", r"\.")):
        HiFT.from_dir(_model_with_hift(tmp_path, sd))


def test_mixed_weight_norm_styles_are_refused(tmp_path):
    sd = torch.load(MODEL_DIR / "hift.pt", weights_only=True)
    sd["conv_pre.weight_g"] = sd.pop("conv_pre.parametrizations.weight.original0")
    with pytest.raises(CheckpointError, match=r"unexpected keys: .*parametrizations"):
        HiFT.from_dir(_model_with_hift(tmp_path, sd))


def test_bad_mel_is_refused(hift):
    with pytest.raises(InputError, match=r"\(1, 80, T\)"):
        hift.inference(torch.zeros(1, 79, 20))
    with pytest.raises(InputError, match="T >= 9"):
        hift.inference(torch.zeros(1, 80, 8), finalize=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(DeviceError, match="cuda"):
        HiFT.from_dir(MODEL_DIR, device="cuda")
