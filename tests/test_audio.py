"""Audio reading, resampling and the three feature extractors against the reference (frontend.npz)."""

import io

import numpy as np
import pytest
import soundfile as sf
import torch

from helpers import FIXTURES, MODEL_DIR, load_fixture
from cosyllama import audio as A
from cosyllama.config import load_config
from cosyllama.errors import InputError

ARR, META = load_fixture("frontend")
WAVS = META["meta"]["wavs"]
ATOL = 1e-4  # fixture README, section 7


def _close(name, ours, ref, atol=ATOL):
    ours = np.asarray(ours)
    assert ours.shape == ref.shape, name
    diff = float(np.abs(ours - ref).max())
    assert diff <= atol, f"{name}: max |diff| {diff}"


@pytest.mark.parametrize("k", range(len(WAVS)), ids=[w["name"] for w in WAVS])
def test_load_and_resample(k):
    pa = A.load_prompt_audio(FIXTURES / WAVS[k]["file"], sample_rate=24_000)
    _close(f"w{k}_speech_16k", pa.wav16, ARR[f"w{k}_speech_16k"])
    _close(f"w{k}_speech_24k", pa.wav24, ARR[f"w{k}_speech_24k"])
    _close(f"w{k}_load_wav_16k", A.load_wav(FIXTURES / WAVS[k]["file"], 16_000), ARR[f"w{k}_speech_16k"])


@pytest.mark.parametrize("k", range(len(WAVS)), ids=[w["name"] for w in WAVS])
def test_features(k):
    feat = load_config(MODEL_DIR).feat
    w16 = torch.from_numpy(ARR[f"w{k}_speech_16k"])
    w24 = torch.from_numpy(ARR[f"w{k}_speech_24k"])
    _close(f"w{k}_whisper_log_mel", A.whisper_log_mel(w16), ARR[f"w{k}_whisper_log_mel"])
    _close(f"w{k}_kaldi_fbank", A.kaldi_fbank(w16), ARR[f"w{k}_kaldi_fbank"])
    fb = A.kaldi_fbank(w16)
    _close(f"w{k}_kaldi_fbank_cmn", fb - fb.mean(0, keepdim=True), ARR[f"w{k}_kaldi_fbank_cmn"])
    _close(f"w{k}_feat_extractor_mel", A.mel_spectrogram(w24, feat), ARR[f"w{k}_feat_extractor_mel"])


def test_filterbanks():
    _close("matcha_mel_basis", A.slaney_mel_filterbank(24_000, 1920, 80, 0.0, None), ARR["const_matcha_mel_basis"],
           atol=1e-7)
    _close("whisper_mel_128", A.slaney_mel_filterbank(16_000, 400, 128), ARR["const_whisper_mel_filters_128"],
           atol=1e-7)


def test_frame_counts():
    feat = load_config(MODEL_DIR).feat
    wav = torch.randn(1, 16_001) * 0.1
    assert A.whisper_log_mel(wav).shape == (1, 128, 16_001 // 160)
    assert A.kaldi_fbank(wav).shape == (1 + (16_001 - 400) // 160, 80)
    assert A.mel_spectrogram(torch.randn(1, 24_001) * 0.1, feat).shape == (1, 80, 24_001 // 480)
    assert A.resample(torch.randn(1, 22_051), 22_050, 24_000).shape == (1, 24_002)  # ceil(N * new / orig)


@pytest.mark.parametrize("fmt, ext", [("FLAC", "flac"), ("OGG", "ogg"), ("MP3", "mp3")])
def test_other_containers(tmp_path, fmt, ext):
    t = np.arange(24_000) / 24_000
    sig = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    path = tmp_path / f"a.{ext}"
    sf.write(path, np.stack([sig, sig], 1), 24_000, format=fmt)
    wav, sr = A.read_audio(path)
    assert sr == 24_000 and wav.shape[0] == 1 and abs(wav.shape[1] - 24_000) < 2_000
    assert float(wav.abs().max()) > 0.2
    # bytes and file objects work too
    assert A.read_audio(path.read_bytes())[0].shape == wav.shape


def _write(path, samples, sr):
    sf.write(path, samples, sr, subtype="PCM_16")
    return path


@pytest.mark.parametrize("make, match", [
    (lambda p: _write(p / "empty.wav", np.zeros(0, np.float32), 16_000), r"is empty \(0 samples\)"),
    (lambda p: _write(p / "silent.wav", np.zeros(16_000, np.float32), 16_000), r"is silent"),
    (lambda p: _write(p / "long.wav", 0.1 * np.random.default_rng(0).standard_normal(31 * 16_000), 16_000),
     r"31\.0 s long; at most 30 s"),
    (lambda p: _write(p / "short.wav", 0.1 * np.ones(800), 16_000), r"too short"),
    (lambda p: _write(p / "8k.wav", 0.1 * np.random.default_rng(0).standard_normal(8_000), 8_000),
     r"sample rate of 8000 Hz; at least 16000 Hz"),
    (lambda p: (p / "text.wav").write_text("not audio at all") and p / "text.wav",
     r"text.wav. is not a readable audio file \(Format not recognised\); give a wav"),
    (lambda p: p / "missing.wav", r"does not exist"),
])
def test_bad_prompt_audio_refused(tmp_path, make, match):
    with pytest.raises(InputError, match=match):
        A.load_prompt_audio(make(tmp_path))


def _float_wav(samples, sr=16_000, channels=1) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.repeat(np.asarray(samples, np.float32)[:, None], channels, 1), sr, format="WAV", subtype="FLOAT")
    return buf.getvalue()


_SPEECHY = 0.1 * np.sin(np.arange(16_000) / 5.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_samples_refused(bad):
    """A float WAV can hold NaN or infinity; such a prompt used to register and speak silence."""
    samples = _SPEECHY.copy()
    samples[100:103] = bad
    with pytest.raises(InputError, match=r"^prompt audio holds samples that are not finite numbers "
                                         r"\(NaN or infinity: 3 of 16000\)"):
        A.load_prompt_audio(_float_wav(samples))
    A.load_prompt_audio(_float_wav(_SPEECHY))  # the same clip without them is fine


def test_unreadable_bytes_named_without_object_reprs():
    with pytest.raises(InputError) as e:
        A.load_prompt_audio(b"this is a text file renamed to .wav")
    msg = str(e.value)
    assert msg == ("prompt audio is not a readable audio file (Format not recognised); "
                   "give a wav, flac, ogg or mp3 file")
    with pytest.raises(InputError, match="^prompt audio is not a readable"):
        A.load_prompt_audio(io.BytesIO(b"RIFF\0\0\0\0WAVEjunk"))


def test_decoding_stops_at_the_length_limit():
    """A long (well-compressible) upload is refused from its header, before it is decoded, and
    read_audio never decodes more than max_seconds of it."""
    buf = io.BytesIO()
    sf.write(buf, np.full(16_000 * 40, 0.1, np.float32), 16_000, format="FLAC")
    with pytest.raises(InputError, match=r"40\.0 s long; at most 30 s"):
        A.load_prompt_audio(buf.getvalue())
    wav, _ = A.read_audio(buf.getvalue())  # without a limit it is all read
    assert wav.shape[1] == 16_000 * 40


def test_too_many_channels_refused():
    with pytest.raises(InputError, match="has 9 channels; at most 8"):
        A.load_prompt_audio(_float_wav(_SPEECHY, channels=9))
    assert A.read_audio(_float_wav(_SPEECHY, channels=8))[0].shape == (1, 16_000)


def test_load_wav_refuses_low_rate(tmp_path):
    path = _write(tmp_path / "8k.wav", 0.1 * np.ones(8_000), 8_000)
    with pytest.raises(InputError, match="8000 Hz"):
        A.load_wav(path, 24_000)
