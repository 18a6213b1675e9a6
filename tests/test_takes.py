"""Bad takes caught and retried (docs/retries.md): the loop detector on synthetic and recorded token
sequences, and the pipeline's retries with a scripted token source, streamed and not."""

from __future__ import annotations

import random
from contextlib import nullcontext

import numpy as np
import pytest

from cosyllama.llm.decode import MAX_LEN_RATIO, SILENT_TOKENS
from cosyllama.llm.takes import (
    LOOP_MAX_PERIOD,
    LOOP_MIN_TOKENS,
    LoopDetector,
    loop_bound,
    retry_seed,
)
from cosyllama.request import RequestError, SynthesisOptions
from cosyllama.tts import TTS
from helpers import FIXTURES

SEED = 7


def _speech(n: int, rng: random.Random, avoid=()) -> list[int]:
    """``n`` tokens that never repeat within 60 (so only the loop a test builds repeats)."""
    out: list[int] = []
    while len(out) < n:
        t = rng.randrange(100, 6561)
        if t not in out[-60:] and t not in avoid and t not in SILENT_TOKENS:
            out.append(t)
    return out


def _first_loop(tokens) -> tuple[int, object] | None:
    det = LoopDetector()
    for i, t in enumerate(tokens):
        loop = det.push(t)
        if loop is not None:
            return i, loop
    return None


# -- the detector ---------------------------------------------------------------------------------


@pytest.mark.parametrize("period", [2, 3, 5, 8, 12, 13, 20, 25, 37, 50])
def test_loop_caught_at_its_bound_not_before(period):
    rng = random.Random(period)
    pattern = _speech(period, rng)
    prefix = _speech(40, rng, avoid=pattern)
    bound = loop_bound(period)
    # the pattern once, then repeats up to one token short of the bound: nothing
    short = prefix + (pattern * 60)[: period + bound - 1]
    assert _first_loop(short) is None
    # one token more: caught there, starting where the pattern starts
    found = _first_loop(prefix + pattern * 60)
    assert found is not None
    at, loop = found
    assert at == len(prefix) + period + bound - 1
    assert (loop.start, loop.period, loop.end) == (len(prefix), period, at + 1)
    assert loop.cut == len(prefix) + period


def test_bound_is_three_passes_and_a_second():
    assert [loop_bound(p) for p in (1, 2, 12, 13, 50)] == [25, 25, 25, 26, 100]
    assert LOOP_MIN_TOKENS == 25 and LOOP_MAX_PERIOD == 50


def test_longer_periods_and_silence_are_not_loops():
    rng = random.Random(1)
    pattern = _speech(LOOP_MAX_PERIOD + 1, rng)
    assert _first_loop(pattern * 5) is None  # beyond the longest period looked for
    assert _first_loop([1, 2, 28, 29] * 40) is None  # a silent pattern: the silent-token filter's business
    assert _first_loop([1] * 100) is None
    assert _first_loop([5] * 30) is not None  # one speech token held for over a second is


def _recorded_sequences():
    """Every recorded speech-token sequence of the fixtures: the reference LLM's takes (greedy, tiny model),
    the prompt tokens of the three real prompt clips, the flow and silent-filter inputs."""
    seqs = {}
    for path in sorted(FIXTURES.glob("*.npz")):
        with np.load(path) as z:
            for k in z.files:
                a = z[k]
                if a.dtype.kind in "iu" and a.size >= 19 and ("token" in k or k == "continuation"):
                    seqs[f"{path.stem}:{k}"] = [int(t) for t in a.reshape(-1)]
    return seqs


def test_no_false_positives_on_recorded_token_sequences():
    seqs = _recorded_sequences()
    assert len(seqs) >= 30
    for name, seq in seqs.items():
        assert _first_loop(seq) is None, name


# -- the seed rule --------------------------------------------------------------------------------


def test_retry_seed():
    assert retry_seed(None, 3, 1) is None
    assert retry_seed(SEED, 2, 0) == SEED + 2  # the first take: the seed rule
    assert retry_seed(SEED, 2, 1) == SEED + 2 + 2**20
    assert retry_seed(2**31 - 1, 1, 1) == 2**20  # wrapped into the seed range


def test_retries_checked():
    for bad in (-1, 6, True, 1.0, "2"):
        with pytest.raises(RequestError, match="retries") as e:
            from cosyllama.request import check_options

            check_options(SynthesisOptions(retries=bad))
        assert e.value.field == "retries"


# -- the pipeline, with a scripted token source ------------------------------------------------------


class Scripted:
    """A token source whose take for a seed is ``script(seed, n_text)`` (at most max_len of it, as the
    decoder allows); records the seeds asked for and how many tokens each take gave."""

    def __init__(self, script):
        self.script, self.seeds, self.given = script, [], []

    def generate(self, prefill, n_text_tokens, options, cancel=None):
        self.seeds.append(options.seed)
        max_len = options.max_len if options.max_len is not None else int(MAX_LEN_RATIO * n_text_tokens)
        toks = self.script(options.seed, n_text_tokens)[:max_len]
        self.given.append(0)

        def gen():
            for t in toks:
                self.given[-1] += 1
                yield t
        return gen()

    def pause_for_flow(self, first=False):
        return nullcontext()

    def close(self):
        pass


@pytest.fixture(scope="module")
def base():
    from server_helpers import tiny_tts

    return tiny_tts()


@pytest.fixture(scope="module")
def voice(base):
    from server_helpers import PROMPT_TEXT, PROMPT_WAV

    return base.make_voice(PROMPT_WAV, PROMPT_TEXT)


TEXT = "Hello there, how are you today?"
GOOD = _speech(60, random.Random(11))
PATTERN = _speech(12, random.Random(12), avoid=GOOD)
LOOPING = GOOD[:30] + PATTERN * 20  # caught at 30 + 12 + 25 tokens; cut after 42


def _tts(base, script):
    src = Scripted(script)
    return TTS.from_models(base.models, token_source=src), src


def _run(tts, voice, **opts):
    opts.setdefault("retries", 2)  # the advised value where bad takes are replaced (the default, 0, only reports)
    syn = tts.zero_shot(TEXT, voice=voice, seed=SEED, **opts)
    return syn.audio(), syn.timings


def test_loop_retried_with_the_next_seed(base, voice):
    stream = False
    tts, src = _tts(base, lambda seed, n: LOOPING if seed == SEED else GOOD)
    audio, t = _run(tts, voice, stream=stream)
    assert src.seeds == [SEED, SEED + 2**20]
    assert src.given[0] == 30 + 12 + 25  # the looping take stopped where it was caught
    assert t.tokens == [GOOD]
    [r] = t.retries
    assert (r.segment, r.attempt, r.seed, r.reason, r.tokens, r.period, r.start, r.action) == (
        0, 0, SEED, "loop", 67, 12, 30, "retried")
    assert "loop of 12 tokens from token 30" in r.describe()
    # the audio is the good take's, as if it had been the first
    good, _ = _tts(base, lambda seed, n: GOOD)
    assert np.array_equal(audio, _run(good, voice, stream=stream)[0])


def test_stream_caught_before_its_first_chunk_is_retried(base, voice):
    # one token held from the start: caught at 26 tokens, before the first chunk (25 + 3 tokens here)
    held = [GOOD[0]] * 40
    tts, src = _tts(base, lambda seed, n: held if seed == SEED else GOOD)
    audio, t = _run(tts, voice, stream=True)
    assert src.seeds == [SEED, SEED + 2**20] and src.given[0] == 26
    assert [(r.reason, r.period, r.start, r.tokens, r.action) for r in t.retries] == [("loop", 1, 0, 26, "retried")]
    assert t.tokens == [GOOD]
    good, _ = _tts(base, lambda seed, n: GOOD)
    assert np.array_equal(audio, _run(good, voice, stream=True)[0])


def test_bounded_retries_give_up_with_the_last_take_cut(base, voice):
    tts, src = _tts(base, lambda seed, n: LOOPING)
    audio, t = _run(tts, voice, retries=2)
    assert src.seeds == [SEED, SEED + 2**20, SEED + 2 * 2**20]
    assert [r.action for r in t.retries] == ["retried", "retried", "cut"]
    assert t.tokens == [LOOPING[:42]]  # the last take, ending after the pattern's first pass
    cut, _ = _tts(base, lambda seed, n: LOOPING[:42])
    assert np.array_equal(audio, _run(cut, voice, retries=0)[0])


def test_retries_off_reports_and_keeps_the_take(base, voice):
    tts, src = _tts(base, lambda seed, n: LOOPING)
    _, t = _run(tts, voice, retries=0)
    assert src.seeds == [SEED]
    assert t.tokens == [LOOPING[: src.given[0]]]  # all the LLM made (to max_len): the reference's take
    assert [(r.reason, r.action) for r in t.retries] == [("loop", "kept")]


def test_greedy_is_cut_not_retried(base, voice):
    tts, src = _tts(base, lambda seed, n: LOOPING)
    _, t = _run(tts, voice, greedy=True)
    assert len(src.seeds) == 1
    assert [(r.reason, r.action) for r in t.retries] == [("loop", "cut")]
    assert t.tokens == [LOOPING[:42]]


def test_runaway_retried_then_kept(base, voice):
    endless = _speech(2000, random.Random(5))
    tts, src = _tts(base, lambda seed, n: endless)
    _, t = _run(tts, voice, retries=1)
    assert len(src.seeds) == 2
    n = src.given[0]
    assert n == int(MAX_LEN_RATIO * (n // MAX_LEN_RATIO))  # it ran to max_len
    assert [(r.reason, r.tokens, r.action) for r in t.retries] == [("runaway", n, "retried"), ("runaway", n, "kept")]
    assert t.tokens == [endless[:n]]


def test_stream_after_audio_went_out_is_cut(base, voice):
    # the loop starts after the first chunk (25 + pad + 3 tokens) has been sent: it cannot be made again
    late = _speech(80, random.Random(21), avoid=PATTERN) + PATTERN * 20
    tts, src = _tts(base, lambda seed, n: late)
    syn = tts.zero_shot(TEXT, voice=voice, seed=SEED, stream=True, retries=2)
    chunks = list(syn)
    assert len(src.seeds) == 1
    [r] = syn.timings.retries
    assert (r.reason, r.start, r.action) == ("loop", 80, "cut")
    assert syn.timings.tokens == [late[:92]]
    assert chunks[-1].tokens == tuple(late[:92])


def test_normal_take_identical_with_and_without_detection(base, voice):
    """The real (tiny) LLM: a take that passes gives the same bytes with retries on and off."""
    for stream in (False, True):
        on = base.zero_shot(TEXT, voice=voice, seed=SEED, stream=stream, retries=2)
        a_on = on.audio()
        a_off = base.zero_shot(TEXT, voice=voice, seed=SEED, stream=stream, retries=0).audio()
        assert on.timings.retries == []
        assert a_on.tobytes() == a_off.tobytes()


# -- the server: a request field, a header, the log -------------------------------------------------


class Forced:
    """An LLM backend over ``inner`` whose sequence k puts all probability on the tokens of ``takes[k]`` (the
    last one again after), then on a stop id: the server's batching scheduler decodes scripted takes."""

    STOP = 6562

    def __init__(self, inner, takes):
        self.inner, self.takes, self.name, self.cfg = inner, takes, inner.name, inner.cfg
        self.n_seq_max, self.max_seq_tokens, self.n_threads = inner.n_seq_max, inner.max_seq_tokens, inner.n_threads
        self.script: dict[int, tuple[list[int], list[int]]] = {}  # id(handle) -> (take, position)
        self.started = 0

    def _logp(self, handle):
        import torch

        take, pos = self.script[id(handle)]
        tok = take[pos[0]] if pos[0] < len(take) else self.STOP
        pos[0] += 1
        logp = torch.full((self.cfg.vocab_size,), -1e9)
        logp[tok] = 0.0
        return logp

    def _new(self, handle):
        self.script[id(handle)] = (self.takes[min(self.started, len(self.takes) - 1)], [0])
        self.started += 1

    def start(self, prefill, max_new_tokens):
        h, _ = self.inner.start(prefill, max_new_tokens)
        self._new(h)
        return h, self._logp(h)

    def begin(self, prefill, max_new_tokens):
        h = self.inner.begin(prefill, max_new_tokens)
        self._new(h)
        return h

    def prefill_step(self, handle, max_positions):
        return None if self.inner.prefill_step(handle, max_positions) is None else self._logp(handle)

    def step(self, batch):
        self.inner.step(batch)
        return [self._logp(h) for h, _ in batch]

    def release(self, handle):
        self.script.pop(id(handle), None)
        self.inner.release(handle)

    def stats(self):
        return self.inner.stats()


def test_server_retries_header_field_and_log(base, voice, caplog):
    import dataclasses
    import logging

    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from cosyllama.server.app import create_app
    from helpers import LoopbackServer
    from server_helpers import PROMPT_TEXT, PROMPT_WAV

    assert LOOPING[30:42] == PATTERN and len(set(PATTERN)) == 12  # period 12: RAS's window of 10 lets it through
    forced = Forced(base.llm, [LOOPING, GOOD])
    tts = TTS.from_models(dataclasses.replace(base.models, llm=forced))
    srv = LoopbackServer(create_app(tts))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/voices", files={"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")},
                       data={"text": PROMPT_TEXT, "id": "en"})
            assert r.status_code == 200
            with caplog.at_level(logging.WARNING, logger="cosyllama.server"):
                r = c.post("/v1/audio/speech", json={"input": TEXT, "voice": "en", "seed": SEED, "retries": 2,
                                                     "response_format": "wav"})
            assert r.status_code == 200, r.text
            assert r.headers["x-cosyllama-retries"] == (
                f"segment=0 attempt=0 seed={SEED} reason=loop tokens=67 action=retried period=12 start=30")
            assert "bad take: segment 0 take 0 (seed 7): loop of 12 tokens from token 30" in caplog.text
            r = c.post("/v1/audio/speech", json={"input": TEXT, "voice": "en", "response_format": "wav"})
            assert r.status_code == 200 and "x-cosyllama-retries" not in r.headers  # GOOD: nothing caught
            for bad in (-1, 6):
                r = c.post("/v1/audio/speech", json={"input": TEXT, "voice": "en", "retries": bad})
                assert r.status_code == 422, r.text
                err = r.json()["error"]
                assert err["param"] == "retries" and "retries must be an integer from 0 to 5" in err["message"]
        forced.started = 0  # the scripted LLM's next take loops again, the one after is good
        _websocket_reports_the_retry(srv)
    finally:
        srv.stop()


def _websocket_reports_the_retry(srv):
    """The WebSocket's audio.done of a sentence whose take was caught carries the caught takes."""
    import json

    pytest.importorskip("websockets")
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{srv.port}/v1/audio/speech/stream", open_timeout=60, max_size=None) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "en", "seed": SEED, "response_format": "pcm",
                            "retries": 2}))
        ws.send(json.dumps({"type": "input.text", "text": TEXT}))
        ws.send(json.dumps({"type": "input.done"}))
        done = []
        while True:
            m = ws.recv(timeout=60)
            if isinstance(m, str):
                m = json.loads(m)
                if m["type"] == "audio.done":
                    done.append(m)
                if m["type"] == "session.done":
                    break
    caught = [r for d in done for r in d.get("retries", [])]
    assert caught and caught[0]["reason"] == "loop" and caught[0]["action"] == "retried"


def test_serve_and_synth_flags(tmp_path, capsys):
    from cosyllama.cli import main
    from server_helpers import PROMPT_WAV

    for cmd in (["serve", "--model-dir", "x", "--retries", "9"],
                ["synth", "--model-dir", "x", "--text", "hi", "--prompt-wav", str(PROMPT_WAV),
                 "--out", str(tmp_path / "o.wav"), "--retries", "-1"]):
        assert main(cmd) == 2
        assert "--retries must be an integer from 0 to 5" in capsys.readouterr().err
