"""Even loudness (``--loudness``, ``SynthesisOptions.loudness``, docs/loudness.md) on the tiny model, at each door:
the Python API, ``cosyllama synth``, ``POST /v1/audio/speech`` (field, server default, header), the serve and
wyoming flags. The tiny model speaks noise, which has a loudness too; its prompts here are one clip at levels
30 dB apart."""

from __future__ import annotations

import io
import math
import sys

import numpy as np
import pytest
import soundfile as sf

from helpers import MODEL_DIR

pytest.importorskip("pyloudnorm")

from cosyllama import loudness  # noqa: E402
from cosyllama.errors import InputError, MissingDependencyError  # noqa: E402
from cosyllama.request import RequestError, SynthesisOptions, check_options  # noqa: E402
from server_helpers import PROMPT_TEXT, PROMPT_WAV, tiny_tts  # noqa: E402

SR = 24_000
TEXT = "Hello there, how are you today?"
TARGET = -30.0  # reachable under the -1 dBFS ceiling: the tiny model's noise peaks ~22 dB above its loudness
LEVELS_DB = (0.0, -15.0, -30.0)  # the prompt clip scaled by these
CEILING = 10 ** (loudness.CEILING_DBFS / 20)
TIGHT_LU = 0.1  # non-streamed output is measured itself: off by less than this (a 0.5 dB gain error is not)


def check_even(audio: np.ndarray, target: float = TARGET, tolerance: float = TIGHT_LU) -> float:
    """``audio`` is within ``tolerance`` LU of ``target`` with its true peak at or under the ceiling; its LUFS."""
    lufs = loudness.integrated_loudness(audio, SR)
    assert lufs is not None and abs(lufs - target) <= tolerance, f"{lufs} LUFS, target {target}"
    assert loudness.true_peak(audio) <= CEILING * (1 + 1e-6)
    return lufs


@pytest.fixture(scope="module")
def tts():
    return tiny_tts()


@pytest.fixture(scope="module")
def voices(tts, tmp_path_factory):
    """One voice per level of :data:`LEVELS_DB`: the prompt clip scaled."""
    wav, sr = sf.read(PROMPT_WAV, dtype="float32")
    out = {}
    for level in LEVELS_DB:
        path = tmp_path_factory.mktemp("prompts") / f"p{level:+.0f}.wav"
        sf.write(path, wav * np.float32(10 ** (level / 20)), sr, subtype="FLOAT")
        out[level] = tts.make_voice(path, PROMPT_TEXT)
    return out


def _run(tts, voice, **options):
    syn = tts.synthesize(TEXT, voice=voice, greedy=True, seed=1, **options)
    chunks = [c.samples for c in syn]
    return syn, chunks, (np.concatenate(chunks) if chunks else np.zeros(0, np.float32))


# -- the rules ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, words", [(-80, "from -70 to -5 LUFS"), (0, "from -70 to -5 LUFS"),
                                          (math.nan, "finite"), (math.inf, "finite"), ("-16", "a number"),
                                          (True, "a number")])
def test_bad_targets_are_refused_naming_the_field(value, words):
    with pytest.raises(RequestError) as e:
        check_options(SynthesisOptions(loudness=value))
    assert e.value.field == "loudness" and words in str(e.value) and "\n" not in str(e.value)
    assert "--loudness" in str(e.value.as_flag())


def test_targets_in_range_are_taken():
    for value in (-70, -16.5, -5.0):
        check_options(SynthesisOptions(loudness=value))


def test_the_gain_is_always_finite():
    short = loudness.Level.of(np.full(SR // 10, 0.1, np.float32), SR)
    assert short.lufs is None
    g = loudness.gain_for(short, -16)
    assert (g.factor, g.why) == (1.0, "short")
    silent = loudness.Level.of(np.zeros(SR, np.float32), SR)
    assert silent.lufs == -math.inf and silent.peak == 0
    assert loudness.gain_for(silent, -16) == loudness.Gain(1.0, 0.0, "silent")
    loud_short = loudness.Level.of(np.full(SR // 10, 1.5, np.float32), SR)
    g = loudness.gain_for(loud_short, -16)
    assert g.why == "ceiling" and g.factor * loud_short.peak == pytest.approx(CEILING)
    for level, target in ((loudness.Level(-120.0, 1e-6), -5), (loudness.Level(-3.0, 1e-300), -70)):
        g = loudness.gain_for(level, target)
        assert math.isfinite(g.factor) and math.isfinite(g.db) and g.factor > 0


def test_true_peak_sees_between_samples():
    t = np.arange(SR) / SR
    x = np.sin(2 * np.pi * 6000 * t + np.pi / 4).astype(np.float32)  # samples at +-0.707 of a peak of 1
    assert np.max(np.abs(x)) < 0.75 and loudness.true_peak(x) > 0.95


def test_a_missing_pyloudnorm_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyloudnorm", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'cosyllama\[loudness\]'"):
        loudness.require()


# -- the Python API -------------------------------------------------------------------------------------------

def test_off_by_default_the_audio_is_untouched(tts, voices, monkeypatch):
    _, _, before = _run(tts, voices[0.0])

    def never(*a, **k):
        raise AssertionError("scaled without loudness")

    import cosyllama.tts

    monkeypatch.setattr(cosyllama.tts, "even_loudness", never)
    syn, _, after = _run(tts, voices[0.0])
    assert after.tobytes() == before.tobytes() and syn.timings.loudness_gain_db is None


@pytest.mark.parametrize("level", LEVELS_DB)
def test_non_streamed_voices_of_every_level_come_out_at_the_target(tts, voices, level):
    syn, _, base = _run(tts, voices[level])
    syn, _, audio = _run(tts, voices[level], loudness=TARGET)
    check_even(audio)
    t = syn.timings
    assert t.loudness_why == "target" and t.loudness_held == 0
    np.testing.assert_allclose(audio, base * np.float32(10 ** (t.loudness_gain_db / 20)), rtol=1e-5, atol=1e-7)


def test_the_check_fails_on_a_half_db_gain_error(tts, voices, monkeypatch):
    real = loudness.gain_for

    def off(level, target, *a):
        g = real(level, target, *a)
        return loudness.Gain(g.factor * 10 ** (0.5 / 20), g.db + 0.5, g.why)

    monkeypatch.setattr(loudness, "gain_for", off)
    _, _, audio = _run(tts, voices[-15.0], loudness=TARGET)
    with pytest.raises(AssertionError, match="LUFS"):
        check_even(audio)


def test_a_target_above_what_the_peaks_allow_stops_at_the_ceiling(tts, voices):
    syn, _, audio = _run(tts, voices[-30.0], loudness=-8.0)
    assert syn.timings.loudness_why == "ceiling"
    assert loudness.true_peak(audio) == pytest.approx(CEILING, rel=1e-3)
    assert loudness.integrated_loudness(audio, SR) < -8.0


def test_audio_too_short_to_measure_keeps_its_level_under_the_ceiling(tts, voices):
    syn, _, base = _run(tts, voices[0.0], max_tokens=4)
    syn, _, audio = _run(tts, voices[0.0], max_tokens=4, loudness=TARGET)
    assert 0 < audio.size < loudness.BLOCK_SECONDS * SR
    t = syn.timings
    assert t.loudness_measured is None and t.loudness_why in ("short", "ceiling") and math.isfinite(t.loudness_gain_db)
    assert np.max(np.abs(audio)) <= CEILING * (1 + 1e-6)
    if t.loudness_why == "short":
        assert audio.tobytes() == base.tobytes()


@pytest.mark.parametrize("level", LEVELS_DB)
def test_a_stream_has_one_gain_fixed_before_its_first_chunk(tts, voices, level):
    _, base_chunks, _ = _run(tts, voices[level], stream=True)
    syn = tts.synthesize(TEXT, voice=voices[level], greedy=True, seed=1, stream=True, loudness=TARGET)
    first = next(syn)
    gain_db = syn.timings.loudness_gain_db
    assert gain_db is not None and math.isfinite(gain_db)  # known when the first chunk is handed out
    chunks = [first.samples, *(c.samples for c in syn)]
    assert len(chunks) == len(base_chunks) >= 2
    factor = np.float32(10 ** (gain_db / 20))
    for got, raw in zip(chunks, base_chunks):
        want = np.clip(raw * factor, -np.float32(CEILING), np.float32(CEILING))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    audio = np.concatenate(chunks)
    assert np.max(np.abs(audio)) <= CEILING * (1 + 1e-6)
    assert syn.timings.loudness_gain_db == gain_db


def _fresh_voice(tts, tmp_path, level_db: float):
    """A voice no output has been made in yet (its prompt clip at a level no other test uses)."""
    wav, sr = sf.read(PROMPT_WAV, dtype="float32")
    path = tmp_path / f"fresh{level_db:+.1f}.wav"
    sf.write(path, wav * np.float32(10 ** (level_db / 20)), sr, subtype="FLOAT")
    return tts.make_voice(path, PROMPT_TEXT)


def test_a_voices_first_stream_takes_its_gain_from_its_first_sentence(tts, tmp_path, monkeypatch):
    """With no finished output in the voice, the stream holds its first sentence back until it is whole and
    takes the gain from it: a one-sentence stream comes out at the target as tightly as a non-streamed one (a
    gain fixed from anything else would miss it by LUs on this model), with one factor for every chunk and no
    vocoder pass over the prompt."""
    voice = _fresh_voice(tts, tmp_path, -7.0)
    _, base_chunks, _ = _run(tts, voice, stream=True)  # no target: leaves no level behind
    calls = []
    real = tts.token2wav.hift.inference
    monkeypatch.setattr(tts.token2wav.hift, "inference", lambda *a, **k: calls.append(1) or real(*a, **k))
    syn = tts.synthesize(TEXT, voice=voice, greedy=True, seed=1, stream=True, loudness=TARGET)
    chunks = [c.samples for c in syn]
    assert syn.timings.loudness_from == "sentence" and len(chunks) == len(base_chunks) >= 2
    check_even(np.concatenate(chunks))
    factor = np.float32(10 ** (syn.timings.loudness_gain_db / 20))
    for got, raw in zip(chunks, base_chunks):
        np.testing.assert_allclose(got, np.clip(raw * factor, -CEILING, CEILING), rtol=1e-5, atol=1e-7)
    assert calls == []  # the prompt was not vocoded (the stream's chunks take the vocoder's streaming path)


def test_a_first_sentence_too_short_to_measure_falls_back_to_the_prompt_once(tts, tmp_path, monkeypatch):
    voice = _fresh_voice(tts, tmp_path, -3.0)
    calls = []
    real = tts.token2wav.hift.inference
    monkeypatch.setattr(tts.token2wav.hift, "inference", lambda *a, **k: calls.append(1) or real(*a, **k))
    syn, _, audio = _run(tts, voice, stream=True, max_tokens=4, loudness=TARGET)
    assert 0 < audio.size < loudness.BLOCK_SECONDS * SR
    assert syn.timings.loudness_from == "prompt" and syn.timings.loudness_measured is not None
    assert calls == [1]  # the prompt, vocoded once
    again, _, _ = _run(tts, voice, stream=True, max_tokens=4, loudness=TARGET)
    assert again.timings.loudness_from == "prompt" and calls == [1]  # and its level kept


# -- cosyllama synth ------------------------------------------------------------------------------------------

def _synth(tmp_path, *extra):
    return ["synth", "--model-dir", str(MODEL_DIR), "--out", str(tmp_path / "o.wav"), "--precision", "fp32",
            "--threads", "1", "--prompt-wav", str(PROMPT_WAV), "--prompt-text", PROMPT_TEXT, "--text", TEXT,
            "--greedy", "--seed", "1", *extra]


def test_cli_synth_loudness(tmp_path, capsys, tts):
    from cosyllama.cli import main

    assert main(_synth(tmp_path, "--loudness", str(TARGET), "--out-format", "float")) == 0
    assert "loudness gain" in capsys.readouterr().err
    audio, _ = sf.read(tmp_path / "o.wav", dtype="float32")
    check_even(audio)
    # without the flag: the same bytes as the API's audio (nothing scaled, nothing rounded differently)
    assert main(_synth(tmp_path, "--out-format", "float")) == 0
    assert "loudness gain" not in capsys.readouterr().err
    plain, _ = sf.read(tmp_path / "o.wav", dtype="float32")
    api = tts.synthesize(TEXT, prompt_wav=PROMPT_WAV, prompt_text=PROMPT_TEXT, greedy=True, seed=1).audio()
    assert plain.tobytes() == api.tobytes()


@pytest.mark.parametrize("value, words", [("-80", "--loudness must be from -70 to -5"),
                                          ("nan", "--loudness must be a finite number")])
def test_cli_refuses_a_bad_target_before_any_work(tmp_path, capsys, value, words):
    from cosyllama.cli import main

    assert main(_synth(tmp_path, "--loudness", value)) == 2
    err = capsys.readouterr().err
    assert words in err and "loaded" not in err and "Traceback" not in err and not (tmp_path / "o.wav").exists()


def test_cli_refuses_a_string(tmp_path, capsys):
    from cosyllama.cli import main

    with pytest.raises(SystemExit) as e:
        main(_synth(tmp_path, "--loudness", "loud"))
    assert e.value.code == 2 and "--loudness: invalid float value: 'loud'" in capsys.readouterr().err


# -- serve and wyoming flags ----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["serve", "wyoming"])
def test_the_servers_take_a_default_target(command):
    from cosyllama.cli import build_parser
    from cosyllama.commands.options import serving_options

    parser = build_parser()
    assert serving_options(parser.parse_args([command, "--model-dir", "m"])).defaults.loudness is None
    opts = serving_options(parser.parse_args([command, "--model-dir", "m", "--loudness", "-18"]))
    assert opts.defaults.loudness == -18.0 and opts.defaults.seed is None
    with pytest.raises(InputError, match="--loudness must be from -70 to -5"):
        serving_options(parser.parse_args([command, "--model-dir", "m", "--loudness", "3"]))


def test_wyoming_requests_get_the_servers_target():
    from types import SimpleNamespace

    pytest.importorskip("wyoming")
    from cosyllama.cli import build_parser
    from cosyllama.commands.options import serving_options
    from cosyllama.limits import RequestLimits
    from cosyllama.server.wyoming import WyomingService

    opts = serving_options(build_parser().parse_args(["wyoming", "--model-dir", "m", "--loudness", "-18"]))
    service = WyomingService(SimpleNamespace(options=opts, tts=None, limits=RequestLimits()))
    assert service.options.loudness == -18.0 and service.options.stream


# -- HTTP -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http(tts, voices):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from cosyllama.server.app import create_app
    from cosyllama.server.options import ServingOptions
    from cosyllama.tts import TTS
    from cosyllama.voices import VoiceStore
    from helpers import LoopbackServer

    store = VoiceStore()
    for level, v in voices.items():
        store.add(f"v{int(-level)}", v)
    view = TTS.from_models(tts.models, voices=store)
    servers = [LoopbackServer(create_app(view)),
               LoopbackServer(create_app(view, ServingOptions(view.options,
                                                              defaults=SynthesisOptions(loudness=TARGET))))]
    clients = [httpx.Client(base_url=s.url, timeout=120) for s in servers]
    yield clients
    for c in clients:
        c.close()
    for s in servers:
        s.stop()


def _wav(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    audio, _ = sf.read(io.BytesIO(r.content), dtype="float32")
    return audio


@pytest.mark.parametrize("level", LEVELS_DB)
def test_http_loudness_field(http, tts, voices, level):
    body = {"input": TEXT, "voice": f"v{int(-level)}", "greedy": True, "seed": 1, "response_format": "wav"}
    plain = http[0].post("/v1/audio/speech", json=body)
    assert "x-loudness-gain-db" not in plain.headers
    r = http[0].post("/v1/audio/speech", json={**body, "loudness": TARGET})
    check_even(_wav(r), tolerance=0.2)  # 16-bit wav
    gain = float(r.headers["x-loudness-gain-db"])
    syn, _, api = _run(tts, voices[level], loudness=TARGET)  # the same synthesis through the API
    assert gain == round(syn.timings.loudness_gain_db, 2)
    np.testing.assert_allclose(_wav(r), api, atol=1 / 32768)
    # the server's default: the same for a request that gives none
    d = http[1].post("/v1/audio/speech", json=body)
    assert d.content == r.content and d.headers["x-loudness-gain-db"] == r.headers["x-loudness-gain-db"]


def test_http_stream_says_its_gain_and_stays_under_the_ceiling(http):
    body = {"input": TEXT, "voice": "v0", "greedy": True, "seed": 1, "response_format": "pcm",
            "stream_format": "audio", "loudness": TARGET}
    r = http[0].post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and math.isfinite(float(r.headers["x-loudness-gain-db"]))
    pcm = np.frombuffer(r.content, "<i2").astype(np.float32) / 32768
    assert pcm.size and np.max(np.abs(pcm)) <= CEILING + 1 / 32768


@pytest.mark.parametrize("value, words", [(0, "from -70 to -5"), (-71, "from -70 to -5"), ("-16", "number"),
                                          (None, None)])
def test_http_refuses_a_bad_target_naming_the_field(http, value, words):
    body = {"input": TEXT, "voice": "v0", "loudness": value}
    if value is None:  # null: off, as if not given
        assert http[0].post("/v1/audio/speech", json=body).status_code == 200
        return
    r = http[0].post("/v1/audio/speech", json=body)
    assert r.status_code == 422, r.text
    text = r.text.lower()
    assert "loudness" in text and words.lower() in text


def test_http_refuses_nan(http):
    r = http[0].post("/v1/audio/speech", content=b'{"input": "Hi there.", "voice": "v0", "loudness": NaN}',
                     headers={"content-type": "application/json"})
    assert r.status_code == 422 and "loudness" in r.text


def test_a_stream_takes_its_gain_from_the_voices_last_output():
    """A voice's first stream takes its gain from its own first sentence; once an output in that voice has
    finished, the next stream's gain comes from that output's loudness before its gain (docs/loudness.md)."""
    pytest.importorskip("pyloudnorm")
    from cosyllama import loudness
    from cosyllama.tts import TTS
    from helpers import FIXTURES, MODEL_DIR

    tts = TTS(MODEL_DIR, threads=1, precision="fp32")
    voice = tts.make_voice(FIXTURES / "wavs" / "prompt_en_16k.wav", "Hello, this is my voice.")
    text = "Hello there, how are you today? The weather is fine."
    first = tts.synthesize(text, voice=voice, seed=1, greedy=True, stream=True, loudness=-30.0)
    first.audio()
    assert first.timings.loudness_from == "sentence"
    raw = tts.synthesize(text, voice=voice, seed=2, greedy=True, loudness=None).audio()
    whole = tts.synthesize(text, voice=voice, seed=2, greedy=True, loudness=-30.0)
    whole.audio()
    assert whole.timings.loudness_from == "output"
    later = tts.synthesize(text, voice=voice, seed=1, greedy=True, stream=True, loudness=-30.0)
    later.audio()
    assert later.timings.loudness_from == "output"
    assert later.timings.loudness_measured == pytest.approx(loudness.integrated_loudness(raw, tts.sample_rate))
