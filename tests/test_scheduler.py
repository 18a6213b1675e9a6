"""BatchScheduler: batched decoding equals decoding alone, cancellation frees at once, failures stay
inside their request, admission limits."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from cosyllama.config import load_config
from cosyllama.llm.backend import Prefill
from cosyllama.llm.decode import DecodeOptions, generate
from cosyllama.llm.llamacpp_backend import BackendBusyError
from cosyllama.llm.scheduler import BatchScheduler, CancelToken, RequestCancelled, SchedulerBusyError
from cosyllama.llm.torch_backend import TorchLLM
from helpers import FIXTURES, MODEL_DIR, Gated, StartInPieces, load_fixture


class Watched(StartInPieces):
    """Wraps a backend: counts live sequences and the largest step batch; can be told to fail."""

    def __init__(self, inner, n_slots: int | None = None):
        self.inner, self.cfg, self.name = inner, inner.cfg, "watched"
        self.n_seq_max, self.max_seq_tokens, self.n_threads = None, inner.max_seq_tokens, None
        self.n_slots = n_slots
        self.live: set[int] = set()
        self.max_step = 0
        self.fail_start: set[tuple[int, ...]] = set()  # text_ids whose start raises
        self.fail_step = False
        self.lock = threading.Lock()

    def begin(self, prefill, max_new_tokens):
        if prefill.text_ids in self.fail_start:
            raise ValueError("bad prefill")
        with self.lock:
            if self.n_slots is not None and len(self.live) >= self.n_slots:
                raise BackendBusyError("full")
        h = self.inner.begin(prefill, max_new_tokens)
        with self.lock:
            self.live.add(id(h))
        return h

    def prefill_step(self, h, max_positions):
        return self.inner.prefill_step(h, max_positions)

    def step(self, batch):
        if self.fail_step:
            raise RuntimeError("step failed")
        self.max_step = max(self.max_step, len(batch))
        return self.inner.step(batch)

    def release(self, h):
        with self.lock:
            self.live.discard(id(h))
        self.inner.release(h)

    def stats(self):
        return None


@pytest.fixture(scope="module")
def torch_llm():
    return TorchLLM.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def prefills():
    arrays, _ = load_fixture("llm_teacher_forced")
    text = [int(x) for x in np.concatenate([arrays["prompt_text"][0], arrays["text"][0]])]
    speech = tuple(int(x) for x in arrays["prompt_speech_token"][0])
    n_text = int(arrays["text"].shape[1])
    # eight different requests: prompts of different lengths, so the sequences are out of step
    return [(Prefill(tuple(text[: len(text) - k]), speech[: len(speech) - 3 * k]), max(1, n_text - k))
            for k in range(8)]


def _opts(i: int) -> DecodeOptions:
    # half greedy, half seeded RAS: both must be independent of the batch they run in. max_len
    # keeps the torch runs short (min_len, stop and max_len rules all still apply).
    return DecodeOptions(greedy=True, max_len=80) if i % 2 == 0 else DecodeOptions(seed=100 + i, max_len=80)


def test_batched_equals_alone(torch_llm, prefills):
    alone = [list(generate(torch_llm, p, n, _opts(i))) for i, (p, n) in enumerate(prefills)]
    be = Watched(torch_llm)
    with BatchScheduler(be, max_active=8) as sched:
        barrier = threading.Barrier(len(prefills))

        def run(i):
            p, n = prefills[i]
            it = sched.generate(p, n, _opts(i))
            barrier.wait()
            return list(it)

        with ThreadPoolExecutor(len(prefills)) as pool:
            batched = list(pool.map(run, range(len(prefills))))
        stats = sched.stats()
    assert batched == alone
    assert be.max_step >= 4 and stats["max_batch"] == be.max_step  # really decoded together
    assert stats["active_sequences"] == 0 and not be.live


def test_close_frees_sequence_at_once(torch_llm, prefills):
    be = Watched(torch_llm)
    with BatchScheduler(be) as sched:
        p, n = prefills[0]
        other = sched.generate(p, n, DecodeOptions(greedy=True))
        it = sched.generate(p, n, DecodeOptions(greedy=True))
        next(other)
        for _ in range(3):
            next(it)
        assert len(be.live) == 2
        it.close()
        assert len(be.live) == 1 and sched.stats()["active_sequences"] == 1
        assert list(other)  # the other request goes on
        assert not be.live
        # a request closed before its first token never takes a sequence for long
        it = sched.generate(p, n, DecodeOptions(greedy=True))
        it.close()
        assert list(sched.generate(p, n, DecodeOptions(greedy=True))) == \
            list(generate(torch_llm, p, n, DecodeOptions(greedy=True)))


def test_cancel_token_from_another_thread(torch_llm, prefills):
    be = Watched(torch_llm)
    with BatchScheduler(be) as sched:
        p, n = prefills[0]
        token = CancelToken()
        it = sched.generate(p, n, DecodeOptions(greedy=True, ignore_stop=True, max_len=10_000), cancel=token)
        next(it)
        assert len(be.live) == 1
        threading.Thread(target=token.cancel).start()
        with pytest.raises(RequestCancelled):
            for _ in it:
                pass
        it.close()
        assert not be.live and sched.stats()["active_sequences"] == 0
        with pytest.raises(RequestCancelled):
            next(sched.generate(p, n, DecodeOptions(greedy=True), cancel=token))


def test_one_bad_request_fails_alone(torch_llm, prefills):
    be = Watched(torch_llm)
    bad, n_bad = prefills[1]
    be.fail_start.add(bad.text_ids)
    with BatchScheduler(be) as sched:
        p, n = prefills[0]
        good = sched.generate(p, n, DecodeOptions(greedy=True))
        first = next(good)
        with pytest.raises(ValueError, match="bad prefill"):
            list(sched.generate(bad, n_bad, DecodeOptions(greedy=True)))
        assert [first, *good] == list(generate(torch_llm, p, n, DecodeOptions(greedy=True)))
        # a failing step fails the requests in it, and the worker keeps serving
        it = sched.generate(p, n, DecodeOptions(greedy=True))
        next(it)
        be.fail_step = True
        with pytest.raises(RuntimeError, match="step failed"):
            list(it)
        be.fail_step = False
        assert list(sched.generate(p, n, DecodeOptions(greedy=True))) == \
            list(generate(torch_llm, p, n, DecodeOptions(greedy=True)))
        assert not be.live


def test_full_backend_waits_then_admission_queue_refuses(torch_llm, prefills):
    be = Watched(torch_llm, n_slots=2)
    with BatchScheduler(be, max_active=4, max_waiting=8) as sched:
        # the backend refuses the 3rd and 4th start: they wait for a release instead of failing
        its = [sched.generate(p, n, DecodeOptions(greedy=True)) for p, n in prefills[:4]]
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(list, its))
        assert outs == [list(generate(torch_llm, p, n, DecodeOptions(greedy=True))) for p, n in prefills[:4]]
        assert be.max_step <= 2 and not be.live
    with BatchScheduler(be, max_active=1, max_waiting=0) as sched:
        p, n = prefills[0]
        it = sched.generate(p, n, DecodeOptions(greedy=True))
        next(it)
        with pytest.raises(SchedulerBusyError, match="retry later"):
            next(sched.generate(p, n, DecodeOptions(greedy=True)))
        it.close()
        assert list(sched.generate(p, n, DecodeOptions(greedy=True, max_len=3))) == \
            list(generate(torch_llm, p, n, DecodeOptions(greedy=True, max_len=3)))


def test_closed_scheduler_fails_its_requests(torch_llm, prefills):
    be = Watched(torch_llm)
    sched = BatchScheduler(be)
    p, n = prefills[0]
    it = sched.generate(p, n, DecodeOptions(greedy=True, ignore_stop=True, max_len=10_000))
    next(it)
    sched.close()
    with pytest.raises(SchedulerBusyError):
        list(it)
    assert not be.live
    with pytest.raises(SchedulerBusyError, match="closed"):
        next(sched.generate(p, n, DecodeOptions(greedy=True)))


def test_llamacpp_eight_concurrent_equal_alone(tiny_gguf, prefills):
    pytest.importorskip("llama_cpp")
    from cosyllama.llm.llamacpp_backend import LlamaCppLLM

    path = tiny_gguf("speech", "F32")
    llm = LlamaCppLLM(path, load_config(MODEL_DIR), n_threads=1, n_seq_max=8)
    try:
        opts = DecodeOptions(greedy=True)
        alone = [list(generate(llm, p, n, opts)) for p, n in prefills]
        be = Watched(llm)
        gated = Gated(llm)  # the scheduler decodes ahead of its reader: held, the sequence is still live when looked at
        with BatchScheduler(gated) as sched, BatchScheduler(be) as watched:
            assert sched.max_active == 8
            barrier = threading.Barrier(len(prefills))

            def run(i):
                it = watched.generate(*prefills[i], opts)
                barrier.wait()
                return list(it)

            with ThreadPoolExecutor(len(prefills)) as pool:
                batched = list(pool.map(run, range(len(prefills))))
            assert batched == alone
            assert be.max_step >= 4
            assert llm.stats()["active_sequences"] == 0
            gated.hold_after(1)
            it = sched.generate(*prefills[0], opts)
            next(it)
            assert llm.stats()["active_sequences"] == 1
            # Closing waits until the worker has freed the sequence, and the worker may be held inside its next
            # step by now (it decodes ahead): close from another thread, then let the steps go. Closing here,
            # held, hung whenever the worker reached the held step first (a CI run on a quiet machine did).
            closer = threading.Thread(target=it.close)
            closer.start()
            gated.let_go()
            closer.join(timeout=60)
            assert not closer.is_alive(), "closing the iterator did not return"
            assert llm.stats()["active_sequences"] == 0  # close() returns once its sequence is freed
    finally:
        llm.close()


@pytest.mark.parametrize("mode,first,pauses", [("all", False, True), ("all", True, True), ("first", True, True),
                                              ("first", False, False), ("off", True, False)])
def test_interleave_holds_decode_steps_while_a_pause_for_flow_is_held(torch_llm, prefills, mode, first, pauses):
    """Where ``interleave`` says so, no decode step runs while a request's flow work holds its turn
    (``first``: only the turn of a stream's first chunk); elsewhere the turn is a no-op. The tokens
    are the same as alone either way."""
    p, n = prefills[0]
    opts = DecodeOptions(greedy=True, max_len=40)
    alone = list(generate(torch_llm, p, n, opts))
    with BatchScheduler(Watched(torch_llm), interleave=mode) as sched:
        it = sched.generate(p, n, opts)
        got = [next(it)]
        with sched.pause_for_flow(first=first):
            held_at = sched.stats()["steps"]
            if pauses:  # the worker may finish the step it was in; none starts after it, however long we hold
                assert not _wait(lambda: sched.stats()["steps"] > held_at + 1, 1.0)
            else:  # decoding goes on beside the flow
                assert _wait(lambda: sched.stats()["steps"] > held_at + 3, 60.0)
        got += list(it)
    assert got == alone
    with pytest.raises(ValueError, match="interleave"):
        BatchScheduler(Watched(torch_llm), interleave="on")


def test_the_engine_asks_for_a_first_turn_only_before_a_streams_first_audio():
    """``Token2Wav.stream`` holds ``turn(first=True)`` for the flow calls before its first audio only;
    a TTS's later text segments never do; the non-streaming path never does."""
    import contextlib

    import cosyllama
    from cosyllama.tts import TTS, SynthesisOptions

    tts = cosyllama.load(MODEL_DIR, precision="fp32")
    calls = []

    class Source:
        def __init__(self, inner):
            self.inner = inner

        def generate(self, *a, **kw):
            return self.inner.generate(*a, **kw)

        def pause_for_flow(self, first=False):
            calls.append(first)
            return contextlib.nullcontext()

    view = TTS.from_models(tts.models, token_source=Source(tts.token_source))
    voice = view.make_voice(str(FIXTURES / "wavs/prompt_en_16k.wav"))
    opts = SynthesisOptions(seed=1, stream=True, ignore_stop=True, max_tokens=90)
    list(view.cross_lingual("Hello there.", voice=voice, options=opts))
    assert calls[0] is True and not any(calls[1:]) and len(calls) >= 3
    calls.clear()
    list(view.cross_lingual("Hello there. " * 40 + "And a second segment here. " * 40, voice=voice,
                            options=SynthesisOptions(seed=1, stream=True, max_tokens=30, ignore_stop=True)))
    assert calls.count(True) == 1 and calls[0] is True
    calls.clear()
    view.cross_lingual("Hello there.", voice=voice, options=SynthesisOptions(seed=1, max_tokens=40,
                                                                          ignore_stop=True)).audio()
    assert calls == [False]


def _wait(cond, timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_servers_interleave_where_the_stages_threads_outnumber_the_cores(monkeypatch):
    """The rule (docs/amx.md, "Two cores, streaming"): a stream's first chunk gets the cores alone when
    the stages' threads do not fit them, the stages overlap when they do, and never hold the LLM back
    for a flow on a GPU; ``serve`` and ``wyoming`` follow it unless told (``--interleave``)."""

    import cosyllama
    from cosyllama import cpu
    from server_helpers import serving_of

    assert cpu.interleave_stages(2, 2, cores=2)[0] == "first" and cpu.interleave_stages(2, 2, cores=4)[0] == "off"
    assert cpu.interleave_stages(1, 1, cores=2)[0] == "off"
    assert cpu.interleave_stages(8, 8, "cuda", cores=2)[0] == "off"
    from cosyllama.commands.options import interleave_choice

    assert [interleave_choice(v) for v in ("auto", "off", "first", "all")] == [None, "off", "first", "all"]
    tts = cosyllama.load(MODEL_DIR, precision="fp32")
    for cores, want in ((1, "first"), (64, "off")):
        monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        s = serving_of(tts)
        try:
            assert s.scheduler.interleave == want and s.scheduler.stats()["interleave"] == want  # /health shows it
        finally:
            s.close()
    s = serving_of(tts, interleave="all")
    assert s.scheduler.interleave == "all"
    s.close()
