"""Frontend outputs per mode against the reference's model_input dicts (frontend.npz, e2e_*.npz)."""

import threading

import numpy as np
import pytest
import soundfile as sf
import torch

from cosyllama.audio import slaney_mel_filterbank
from cosyllama.config import load_config
from cosyllama.errors import InputError
from cosyllama.frontend import Frontend, ModelInput, PromptFeatures
from helpers import FIXTURES, MODEL_DIR, assert_log_spectrum_close, load_fixture

E2E = ["e2e_zero_shot_nonstream", "e2e_zero_shot_stream", "e2e_zero_shot_nonstream_speed1.5",
       "e2e_cross_lingual_nonstream", "e2e_cross_lingual_stream", "e2e_instruct2_nonstream", "e2e_instruct2_stream"]
EMB_ATOL = 1e-5
PROMPT_MEL_BANKS = slaney_mel_filterbank(24_000, 1920, 80, 0.0, None)


def _close_prompt_mel(name, got, want):
    """The prompt mel, within the log-spectrum error model of tests/helpers.py (bands on the last axis)."""
    assert_log_spectrum_close(name, got, want, PROMPT_MEL_BANKS, 1920, power=False)


@pytest.fixture(scope="module")
def fe():
    return Frontend(load_config(MODEL_DIR))


def _inputs(fe, call) -> list[ModelInput]:
    wav = FIXTURES / call["prompt_wav"]
    if call["mode"] == "zero_shot":
        return fe.zero_shot(call["tts_text"], wav, call["prompt_text"])
    if call["mode"] == "cross_lingual":
        return fe.cross_lingual(call["tts_text"], wav)
    return fe.instruct2(call["tts_text"], call["instruct_text"], wav)


def _compare(ours: dict, ref: dict, prefix: str):
    assert sorted(ours) == sorted(k[len(prefix):] for k in ref if k.startswith(prefix))
    for key, value in ours.items():
        want = ref[prefix + key]
        got = value.numpy()
        assert got.shape == want.shape and got.dtype == want.dtype, key
        if key == "prompt_speech_feat":
            _close_prompt_mel(key, got, want)
        elif want.dtype == np.float32:
            assert "embedding" in key, key
            assert np.abs(got - want).max() <= EMB_ATOL, key
        else:
            assert np.array_equal(got, want), key


def test_zero_shot_matches_frontend_fixture(fe):
    arrays, meta = load_fixture("frontend")
    call = meta["meta"]["zero_shot_call"]
    (inp,) = fe.zero_shot(call["tts_text"], FIXTURES / call["prompt_wav"], call["prompt_text"])
    _compare(inp.to_reference_dict(), arrays, "zs_")


@pytest.mark.parametrize("name", E2E)
def test_mode_inputs_match_e2e(fe, name):
    arrays, meta = load_fixture(name)
    inputs = _inputs(fe, meta["meta"]["call"])
    assert [i.text for i in inputs] == meta["meta"]["normalized_tts_text"]
    _compare(inputs[0].to_reference_dict(), arrays, "in_")


def test_voice_is_reusable(fe):
    arrays, meta = load_fixture("e2e_zero_shot_nonstream")
    call = meta["meta"]["call"]
    voice = fe.make_voice(FIXTURES / call["prompt_wav"], "Hello, this is a short prompt.")  # default prefix
    assert voice.prompt_text == call["prompt_text"]
    assert voice.prompt_feat.shape == (2 * len(voice.speech_tokens), 80)
    (inp,) = fe.zero_shot(call["tts_text"], voice)
    _compare(inp.to_reference_dict(), arrays, "in_")
    assert inp.llm_text_ids == tuple(arrays["in_prompt_text"][0]) + tuple(arrays["in_text"][0])
    # the same voice serves other modes
    assert fe.cross_lingual("Hi.", voice)[0].flow_prompt_speech_tokens is voice.speech_tokens


def test_alignment_trims_tokens(fe):
    voice = fe.make_voice(FIXTURES / "wavs/prompt_zh_22k_stereo.wav")
    ref = load_fixture("frontend")[0]
    assert len(ref["w2_speech_token"][0]) == 68 and ref["w2_speech_feat"].shape[1] == 135
    assert len(voice.speech_tokens) == 67 and voice.prompt_feat.shape == (134, 80)  # min(135 // 2, 68)
    assert voice.prompt_text is None and voice.prompt_text_ids == ()


def test_cross_lingual_plain_text_gets_prefix(fe):
    voice = fe.make_voice(FIXTURES / "wavs/prompt_ru_24k.wav")
    (inp,) = fe.cross_lingual("У меня 5 яблок.", voice)
    assert inp.text == "You are a helpful assistant.<|endofprompt|>У меня пять яблок."
    assert inp.text_ids.count(151646) == 1 and inp.prompt_text_ids == ()
    assert len(inp.llm_prompt_speech_tokens) == 0
    assert "prompt_text" not in inp.to_reference_dict()


def test_instruct2_builds_instruction(fe):
    arrays, meta = load_fixture("e2e_instruct2_nonstream")
    (inp,) = fe.instruct2("今天天气很好。", "Please speak fast.", FIXTURES / meta["meta"]["call"]["prompt_wav"])
    assert list(inp.prompt_text_ids) == arrays["in_prompt_text"][0].tolist()


def test_vc(fe):
    ref = load_fixture("frontend")[0]
    inp = fe.vc(FIXTURES / "wavs/prompt_en_16k.wav", FIXTURES / "wavs/prompt_zh_22k_stereo.wav")
    assert np.array_equal(inp.source_speech_tokens.numpy(), ref["w0_speech_token"][0])
    assert np.array_equal(inp.flow_prompt_speech_tokens.numpy(), ref["w2_speech_token"][0])  # unaligned (Q10)
    _close_prompt_mel("prompt_feat", inp.prompt_feat.numpy(), ref["w2_speech_feat"][0])
    assert np.abs(inp.speaker_embedding.numpy() - ref["w2_spk_embedding"][0]).max() <= EMB_ATOL
    d = inp.to_reference_dict()
    assert set(d) == {"source_speech_token", "source_speech_token_len", "flow_prompt_speech_token",
                      "flow_prompt_speech_token_len", "prompt_speech_feat", "prompt_speech_feat_len", "flow_embedding"}


def test_long_text_is_split(fe):
    _, meta = load_fixture("frontend")
    case = meta["meta"]["split_cases"][0]
    voice = fe.make_voice(FIXTURES / "wavs/prompt_en_16k.wav", "Hello, this is a short prompt.")
    inputs = fe.zero_shot(case["text"], voice)
    assert [i.text for i in inputs] == case["split_true"]
    assert all(i.prompt_text_ids == voice.prompt_text_ids for i in inputs)


def test_user_errors(fe, tmp_path):
    wav = FIXTURES / "wavs/prompt_en_16k.wav"
    # a transcript for zero-shot and a non-empty text are SynthesisRequest's rules (tests/test_request.py)
    with pytest.raises(InputError, match="nothing to speak"):
        fe.normalize_and_split("?!")
    silent = tmp_path / "silent.wav"
    sf.write(silent, np.zeros(16_000, np.float32), 16_000)
    with pytest.raises(InputError, match="source audio .* is silent"):
        fe.vc(silent, wav)
    with pytest.raises(InputError, match="prompt audio .* is silent"):
        fe.make_voice(silent)


def test_concurrent_use(fe):
    """One Frontend serves threads at once with identical results."""
    wavs = [FIXTURES / "wavs/prompt_en_16k.wav", FIXTURES / "wavs/prompt_ru_24k.wav"]
    expected = [fe.make_voice(w) for w in wavs]
    results: dict[int, PromptFeatures] = {}

    def work(i):
        results[i] = fe.make_voice(wavs[i % 2])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, v in results.items():
        assert torch.equal(v.speech_tokens, expected[i % 2].speech_tokens)
        assert torch.equal(v.speaker_embedding, expected[i % 2].speaker_embedding)
