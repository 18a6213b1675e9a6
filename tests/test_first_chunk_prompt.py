"""The low-latency first chunk starts after all the prompt's frames (``Token2Wav._prompt_entry`` with ``whole``):
a voice keeps them as one call solved them, the prompt followed by stand-in tokens, and the first chunk solves
only its own frames; the second chunk goes on from the shared frames as the reference's first call does, so
every frame after the first chunk's is the reference schedule's, and requests on the reference's schedule get
the very same shared frames whichever kind of entry the voice holds. Compared at bf16 (the caches' default
precision), on the mel the engine hands the vocoder (see tests/test_flow_cache.py for the tolerances)."""

from __future__ import annotations

import pytest
import torch

from cosyllama.engine import FlowPrompt, Token2Wav
from test_flow_cache import TOL, _diff, _FlowSpy, _prompt, _prompt_call, _tokens, _VocoderSpy

FIRST = 8  # tokens of the low-latency first chunk


def _prompt_of(n: int) -> FlowPrompt:
    fp = _prompt()  # 50 tokens, 100 frames: two whole 50-frame blocks
    return FlowPrompt(fp.tokens[:, :n], fp.feat[:, :2 * n], fp.embedding)


def _stream(t2w, tokens, fp, first=None):
    """The stream's chunks and the mel its vocoder got (all chunks)."""
    voc = _VocoderSpy(t2w.hift)
    t2w.hift = voc
    try:
        chunks = list(t2w.stream(iter(tokens), fp, 0, first_chunk=first))
    finally:
        t2w.hift = voc.hift
    return chunks, voc.mel


def _request_calls(spy):
    """(cache, frames the cache held at the call) of each cached call that was not a prompt's own."""
    return [(c, f) for head, c, f, _ in spy.calls if c is not None and not _prompt_call(head)]


@pytest.fixture(scope="module")
def flow():
    from cosyllama.flow import Flow
    from helpers import MODEL_DIR

    return Flow.from_dir(MODEL_DIR, precision="bf16")


@pytest.fixture(scope="module")
def hift():
    from cosyllama.vocoder import HiFT
    from helpers import MODEL_DIR

    return HiFT.from_dir(MODEL_DIR)


# prompt tokens -> (shared frames, all its frames): on a block boundary, inside a block, too short to share one
@pytest.mark.parametrize("p, shared", [(50, 50), (45, 50), (20, 0)])
def test_the_first_chunk_solves_only_its_own_frames(flow, hift, p, shared):
    fp, tokens = _prompt_of(p), _tokens(120)[0].tolist()
    spy = _FlowSpy(flow)
    t2w = Token2Wav(spy, hift, 24000)
    assert t2w.shared_prompt_frames(p) == shared
    _, mel = _stream(t2w, tokens, fp, FIRST)
    (first, at_first), (second, at_second) = _request_calls(spy)[:2]
    assert at_first == 2 * p and first.last_start == 2 * p  # the whole prompt taken, only 2 x 8 frames solved
    assert first is not second and at_second == shared  # the second chunk: from the shared frames, as the reference
    _, ref = _stream(Token2Wav(flow, hift, 24000), tokens, fp)
    assert mel.shape == ref.shape
    # every frame after the first chunk's is the reference schedule's
    assert _diff(mel[:, :, 2 * FIRST:], ref[:, :, 2 * FIRST:]) <= TOL["bf16"]
    # The first chunk's own frames differ from the reference's (they see less of their block, and prompt frames
    # that read stand-in tokens): docs/streaming.md measures how much. Where the request's first tokens are the
    # stand-in ones (0), the prompt's frames are what the request's own first call would make of them, so the
    # chunk equals solving the prompt's last block with it (the path without a prompt cache) within bf16's
    # rounding. A wrong conv context there is off by ~1 (a one-frame shift: 1.0-1.5), wrong keys or positions
    # by more.
    zeros = [0] * (t2w._stand_in_tokens(p) + 3) + tokens[8:]
    _, mel = _stream(Token2Wav(flow, hift, 24000), zeros, fp, FIRST)
    _, solved = _stream(Token2Wav(flow, hift, 24000, prompt_cache_mb=0), zeros, fp, FIRST)
    assert _diff(mel[:, :, :2 * FIRST], solved[:, :, :2 * FIRST]) <= TOL["bf16"]


def test_reference_requests_get_the_same_shared_frames_from_either_entry(flow, hift):
    fp, tokens = _prompt_of(45), _tokens(120, seed=3)[0].tolist()
    t2w = Token2Wav(flow, hift, 24000)
    _, alone = _stream(t2w, tokens, fp)  # the voice keeps its shared frames only
    small = t2w.prompt_cache_info()["bytes"]
    _stream(t2w, tokens, fp, FIRST)  # now all its frames, solved again by the same call
    info = t2w.prompt_cache_info()  # one entry, now of 90 frames rather than 50 (and two conv contexts)
    assert info["prompts"] == 1 and small * 90 / 50 <= info["bytes"] <= small * 90 / 50 * 1.1
    _, after = _stream(t2w, tokens, fp)
    assert torch.equal(after, alone)


def test_a_voice_warmed_for_low_latency_keeps_all_its_frames(flow, hift):
    fp, tokens = _prompt_of(45), _tokens(120, seed=4)[0].tolist()
    spy = _FlowSpy(flow)
    t2w = Token2Wav(spy, hift, 24000)
    assert t2w.warm_prompt(fp, whole=True) and len(spy.calls) == 1
    solved = spy.calls[0][0]
    assert _prompt_call(solved)
    _stream(t2w, tokens, fp, FIRST)
    assert not any(_prompt_call(head) for head, *_ in spy.calls[1:])  # nothing solved again
    assert _request_calls(spy)[0][1] == 90
    # the prompt's 90 frames end inside the second block: 5 stand-in tokens complete it (and 3 of look-ahead)
    assert t2w._stand_in_tokens(45) == 5 and t2w._stand_in_tokens(50) == 1


def test_without_a_prompt_cache_the_first_chunk_solves_the_prompts_last_block(flow, hift):
    # kept nowhere, all the prompt's frames would be solved for every request: more than they save
    fp, tokens = _prompt_of(50), _tokens(120)[0].tolist()
    spy = _FlowSpy(flow)
    _stream(Token2Wav(spy, hift, 24000, prompt_cache_mb=0), tokens, fp, FIRST)
    assert _request_calls(spy)[0][1] == 50


def test_tts_warms_a_voice_for_low_latency_and_servers_ask_for_it(monkeypatch):
    from types import SimpleNamespace

    import cosyllama
    from cosyllama.server import startup
    from helpers import FIXTURES, MODEL_DIR

    tts = cosyllama.load(MODEL_DIR, precision="bf16")
    tts.add_voice("v", FIXTURES / "wavs" / "prompt_en_16k.wav", "Hello, this is my voice.")
    assert tts.warm_voice("v")
    shared = tts.token2wav.prompt_cache_info()["bytes"]
    assert tts.warm_voice("v", low_latency=True)  # the same entry, now with all the prompt's frames
    info = tts.token2wav.prompt_cache_info()
    assert info["prompts"] == 1 and info["bytes"] > shared
    # a server started with --first-chunk-tokens warms its voices so (its requests stream with it)
    asked = []
    monkeypatch.setattr(startup, "warm_voices", lambda t, voices=None, low_latency=False: asked.append(low_latency))
    monkeypatch.setattr(startup, "openmp_hint", lambda llm: None)
    from cosyllama.request import SynthesisOptions
    from cosyllama.server.options import ServingOptions

    for first in (None, 8):
        options = ServingOptions(tts.options, defaults=SynthesisOptions(first_chunk_tokens=first))
        startup.ready(SimpleNamespace(tts=tts, models=SimpleNamespace(llm=None), options=options))
    assert asked == [False, True]


def test_the_start_up_log_says_when_the_warmed_voices_do_not_all_fit(caplog):
    import logging

    import cosyllama
    from cosyllama.server import startup
    from helpers import FIXTURES, MODEL_DIR

    tts = cosyllama.load(MODEL_DIR, precision="bf16")
    wavs = sorted((FIXTURES / "wavs").glob("prompt*.wav"))[:2]  # two prompts: two entries
    for vid, wav in zip("ab", wavs):
        tts.add_voice(vid, wav)
    with caplog.at_level(logging.WARNING, logger=startup.log.name):
        startup._warm_all(tts, tts.voices, True)  # the default bound holds both
        assert not [r for r in caplog.records if "prompt cache" in r.getMessage()]
        one = tts.token2wav.prompt_cache_info()["bytes"] / 2
        tts.token2wav.clear_prompt_cache()
        tts.token2wav.prompt_cache_mb = 1.5 * one / 2**20  # room for one
        startup._warm_all(tts, tts.voices, True)
    said = [r.getMessage() for r in caplog.records if "prompt cache" in r.getMessage()]
    assert len(said) == 1 and "let 1 warmed voice(s) go, holding 1" in said[0] and "--prompt-cache-mb" in said[0]
