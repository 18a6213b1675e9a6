"""The low-latency first chunk (``SynthesisOptions.first_chunk_tokens``, ``synth --first-chunk-tokens``,
docs/streaming.md): outside the reference's streaming schedule, off by default. The reference's first hop is made
as two chunks (N tokens, then the rest of it) and every later chunk is the reference's, so the flow's mel differs
from the reference schedule's only in the frames of the first N tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyllama.engine import TOKEN_HOP, _StreamState
from cosyllama.request import RequestError, SynthesisOptions, check_options
from helpers import FIXTURES, MODEL_DIR

TEXT = "Hello there, how are you today? The weather is fine, and the tea is hot."


def _hops(pad: int, first_chunk: int, n: int = 5) -> list[int]:
    st = _StreamState(prompt_pad=pad, hop=TOKEN_HOP, first_chunk=first_chunk)
    out = []
    for _ in range(n):
        hop = st.next_hop()
        out.append(hop)
        st.advance(hop)
    return out


def test_the_schedule_splits_only_the_first_hop():
    assert _hops(0, 0) == [25, 50, 100, 100, 100]  # the reference's
    assert _hops(7, 0) == [32, 50, 100, 100, 100]
    assert _hops(0, 10) == [10, 15, 50, 100, 100]  # the same boundaries from the second chunk's end on
    assert _hops(7, 10) == [10, 22, 50, 100, 100]
    assert _hops(0, 24) == [24, 1, 50, 100, 100]


@pytest.mark.parametrize("value, words", [(0, "from 5 to 24"), (4, "from 5 to 24"), (25, "from 5 to 24"),
                                          (True, "from 5 to 24"),
                                          (2.5, "from 5 to 24")])
def test_bad_values_are_refused_naming_the_field(value, words):
    with pytest.raises(RequestError) as e:
        check_options(SynthesisOptions(stream=True, first_chunk_tokens=value))
    assert e.value.field == "first_chunk_tokens" and words in str(e.value)
    assert "--first-chunk-tokens" in str(e.value.as_flag())


def test_it_needs_a_stream():
    with pytest.raises(RequestError, match="non-streamed synthesis has one chunk"):
        check_options(SynthesisOptions(first_chunk_tokens=10))
    check_options(SynthesisOptions(stream=True, first_chunk_tokens=10))


@pytest.fixture(scope="module")
def tts():
    from cosyllama.tts import TTS

    return TTS(MODEL_DIR, threads=1, precision="fp32")


def _run(tts, voice, first):
    mels = []
    real = tts.token2wav._vocode_new

    def spy(st, mel, finalize):
        mels.append(mel.detach().clone())
        return real(st, mel, finalize)

    tts.token2wav._vocode_new = spy
    try:
        syn = tts.synthesize(TEXT, voice=voice, seed=1, greedy=True, stream=True, first_chunk_tokens=first)
        chunks = [c.samples for c in syn]
    finally:
        tts.token2wav._vocode_new = real
    return chunks, torch.cat(mels, dim=2)[0]


@pytest.mark.parametrize("first", [8, 16])
def test_only_the_first_chunks_frames_differ_from_the_reference_schedule(tts, first):
    voice = tts.make_voice(FIXTURES / "wavs" / "prompt_en_16k.wav", "Hello, this is my voice.")
    ref_chunks, ref_mel = _run(tts, voice, None)
    chunks, mel = _run(tts, voice, first)
    assert len(chunks) == len(ref_chunks) + 1  # the reference's first chunk, made as two
    assert 0 < chunks[0].size < ref_chunks[0].size  # sooner: less audio before the first chunk
    assert sum(c.size for c in chunks) == sum(c.size for c in ref_chunks)
    assert mel.shape == ref_mel.shape
    split = 2 * first  # mel frames of the first chunk (2 per token)
    head = (mel[:, :split] - ref_mel[:, :split]).abs().max().item()
    rest = (mel[:, split:] - ref_mel[:, split:]).abs().max().item()
    assert head > 1e-3  # those frames saw less of their attention block: not the reference's
    assert rest < 1e-4, rest  # every frame after them is the reference schedule's (float rounding apart)
    assert np.isfinite(np.concatenate(chunks)).all()


def test_off_by_default_the_stream_is_the_reference_schedules(tts):
    voice = tts.make_voice(FIXTURES / "wavs" / "prompt_en_16k.wav", "Hello, this is my voice.")
    a, _ = _run(tts, voice, None)
    b = [c.samples for c in tts.synthesize(TEXT, voice=voice, seed=1, greedy=True, stream=True)]
    assert [x.tobytes() for x in a] == [x.tobytes() for x in b]


def test_synth_flag_and_its_line(tmp_path, capsys):
    from cosyllama.cli import main

    base = ["synth", "--model-dir", str(MODEL_DIR), "--out", str(tmp_path / "o.wav"), "--precision", "fp32",
            "--threads", "1", "--prompt-wav", str(FIXTURES / "wavs" / "prompt_en_16k.wav"), "--text", "Hi there.",
            "--greedy"]
    assert main([*base, "--first-chunk-tokens", "10"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--first-chunk-tokens" in err and "stream" in err, err
    assert main([*base, "--first-chunk-tokens", "30", "--stream"]) == 2
    assert "from 5 to 24" in capsys.readouterr().err
    assert main([*base, "--first-chunk-tokens", "10", "--stream"]) == 0
    err = capsys.readouterr().err
    assert "low-latency first chunk of 10 speech tokens, outside the reference's schedule" in err, err
    assert main([*base, "--stream"]) == 0
    assert "the reference's schedule" in capsys.readouterr().err


def test_the_servers_flag_applies_to_its_streamed_requests_only(capsys):
    from dataclasses import replace

    from cosyllama.cli import build_parser, main
    from cosyllama.commands.options import serving_options

    args = build_parser().parse_args(["serve", "--model-dir", str(MODEL_DIR), "--first-chunk-tokens", "10"])
    options = serving_options(args)
    assert options.defaults.first_chunk_tokens == 10
    assert options.request_options(streams=True).first_chunk_tokens == 10
    assert options.request_options(streams=False).first_chunk_tokens is None  # a whole file has one chunk
    assert options.request_options({"speed": 1.5}, streams=True).first_chunk_tokens is None  # made whole
    check_options(options.request_options(streams=False))
    assert replace(options.defaults, stream=True).first_chunk_tokens == 10
    for command in ("serve", "wyoming"):
        assert main([command, "--model-dir", str(MODEL_DIR), "--first-chunk-tokens", "0"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--first-chunk-tokens" in err and "from 5 to 24" in err, err
    assert main(["serve", "--model-dir", str(MODEL_DIR), "--first-chunk-tokens", "10", "--speed", "1.5"]) == 2
    assert "give one of them" in capsys.readouterr().err
