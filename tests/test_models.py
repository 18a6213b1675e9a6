"""Loaded models apart from the pipelines that use them (cosyllama.models, TTS.from_models), the
protocols between the stages (LLMBackend's attributes, the token source's flow pause and explicit
cancel token), the servers' one job class, and the CPU report's LLM label."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from helpers import MODEL_DIR, Gated, StartInPieces, slow_backend

PROMPT_WAV = str(MODEL_DIR.parent / "wavs" / "prompt_en_16k.wav")
LLM_ATTRIBUTES = ("name", "cfg", "n_seq_max", "max_seq_tokens", "n_threads")


@pytest.fixture(scope="module")
def tts():
    from cosyllama.tts import TTS

    return TTS(MODEL_DIR, threads=1, precision="fp32")


@pytest.fixture(scope="module")
def voice(tts):
    return tts.make_voice(PROMPT_WAV, "Hello, this is my voice.")


class _Counting(StartInPieces):
    """An LLM backend over ``inner`` that counts its live sequences and sets ``stepping`` after
    ``after`` decode steps."""

    def __init__(self, inner, after: int = 3):
        self.inner, self.name, self.cfg = inner, inner.name, inner.cfg
        self.n_seq_max, self.max_seq_tokens, self.n_threads = inner.n_seq_max, inner.max_seq_tokens, inner.n_threads
        self.live: set[int] = set()
        self.lock = threading.Lock()
        self.steps, self.after, self.stepping = 0, after, threading.Event()

    def begin(self, prefill, max_new_tokens):
        h = self.inner.begin(prefill, max_new_tokens)
        with self.lock:
            self.live.add(id(h))
        return h

    def prefill_step(self, h, max_positions):
        return self.inner.prefill_step(h, max_positions)

    def step(self, batch):
        self.steps += 1
        if self.steps >= self.after:
            self.stepping.set()
        return self.inner.step(batch)

    def release(self, h):
        with self.lock:
            self.live.discard(id(h))
        self.inner.release(h)

    def stats(self):
        return None


# -- models apart from pipelines ---------------------------------------------------------------------


def test_two_pipelines_over_one_models_share_the_models_and_differ_in_policy(tts, voice):
    from cosyllama.limits import RequestLimits
    from cosyllama.llm.decode import DirectTokens
    from cosyllama.models import Models
    from cosyllama.tts import TTS
    from cosyllama.voices import VoiceStore

    models = tts.models
    assert isinstance(models, Models)
    store = VoiceStore()
    a = TTS.from_models(models)
    b = TTS.from_models(models, limits=RequestLimits(input_chars=10), voices=store, flow_slots=1)
    for name in ("config", "device", "sample_rate", "frontend", "llm", "token2wav", "options"):
        assert getattr(a, name) is getattr(b, name) is getattr(tts, name) is getattr(models, name)
    assert a.models is b.models is models
    assert a.limits is None and b.limits == RequestLimits(input_chars=10)
    assert b.voices is store and a.voices is not store and a.voices is not tts.voices
    assert isinstance(a.token_source, DirectTokens) and a.token_source is not tts.token_source
    assert (a.flow_slots, b.flow_slots) == (0, 1)
    a.voices.add("x", voice)
    assert "x" not in b.voices and "x" not in tts.voices
    with pytest.raises(AttributeError):  # the models are read-only through a pipeline
        a.llm = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        models.llm = None


def test_the_pipeline_methods_that_copied_are_gone_and_nothing_copies(tts, monkeypatch):
    from cosyllama.limits import RequestLimits
    from cosyllama.tts import TTS
    from server_helpers import serving_of

    for name in ("with_token_source", "with_text_worker", "with_limits"):
        assert not hasattr(TTS, name)

    def no_copy(x):
        raise AssertionError(f"copy.copy({type(x).__name__}) was called")

    monkeypatch.setattr(copy, "copy", no_copy)
    served = serving_of(tts, limits=RequestLimits(), interleave="off")
    try:
        assert served.tts.models is tts.models and served.tts.token_source is served.scheduler
        assert tts.token_source is not served.scheduler and tts.limits is None  # the given TTS is left as it is
    finally:
        served.close()


def test_the_text_worker_is_a_part_of_the_pipeline_not_a_copied_frontend(tts):
    from cosyllama.tts import TTS

    shared = tts.frontend.normalizer
    p = TTS.from_models(tts.models, text_worker=True)
    try:
        assert p.frontend is tts.frontend and p.frontend.normalizer is shared  # the frontend is not copied
        assert p.normalizer is not shared and p.normalizer._worker is not None and shared._worker is None
        assert p.normalizer._wetext_normalizers is shared._wetext_normalizers  # the wetext objects are shared
        long = "This is sentence number 12 of a long text. " * 30
        assert p.frontend.normalize_and_split(long, normalizer=p.normalizer) == tts.frontend.normalize_and_split(long)
    finally:
        p.close()
    assert p.normalizer._worker is None
    tts.close()  # a pipeline without a worker of its own leaves the shared normalizer alone
    assert shared._wetext_normalizers


def test_the_servers_pipeline_gets_the_voices_passed_in(tts, voice):
    from cosyllama.limits import RequestLimits
    from cosyllama.voices import VoiceStore
    from server_helpers import serving_of

    store = VoiceStore()
    store.add("anna", voice)
    served = serving_of(tts, store, limits=RequestLimits(), interleave="off")
    try:
        assert served.tts.voices is store and "anna" not in tts.voices
    finally:
        served.close()


def test_batch_builds_its_own_pipeline_and_leaves_the_given_tts_alone(tts, tmp_path):
    from cosyllama.batch.engine import BatchEngine, EngineOptions
    from cosyllama.llm.scheduler import BatchScheduler
    from cosyllama.options import LoadOptions

    before = (tts.token_source, tts.token2wav, tts.llm)
    engine = BatchEngine(EngineOptions(LoadOptions(MODEL_DIR), concurrency=2, flow_slots=1), tmp_path,
                         models=tts.models, voices=tts.voices)
    try:
        assert isinstance(engine.tts.token_source, BatchScheduler) and engine.scheduler is engine.tts.token_source
        assert engine.scheduler.max_active == 2 and engine.tts.flow_slots == 1
        assert engine.tts.models is tts.models and engine.tts.voices is tts.voices
        assert (tts.token_source, tts.token2wav, tts.llm) == before  # nothing swapped in, even while it runs
    finally:
        engine.close()
    assert (tts.token_source, tts.token2wav, tts.llm) == before


def test_flow_slots_let_that_many_calls_into_the_flow_at_once(tts, voice):
    """A pipeline with ``flow_slots=1`` runs one call's flow + vocoder at a time (the pipeline's
    policy; the shared Token2Wav is not wrapped); without the limit two calls overlap."""
    from cosyllama.tts import TTS, SynthesisOptions

    class Spy:
        def __init__(self, inner):
            self.inner, self.inside, self.most, self.lock = inner, 0, 0, threading.Lock()
            self.entered = threading.Event()
            self.hold = threading.Event()

        def full(self, *args, **kw):
            with self.lock:
                self.inside += 1
                self.most = max(self.most, self.inside)
            self.entered.set()
            self.hold.wait(5)  # long enough for the other call to arrive, if it may
            try:
                return self.inner.full(*args, **kw)
            finally:
                with self.lock:
                    self.inside -= 1

    opts = SynthesisOptions(greedy=True, max_tokens=10, ignore_stop=True)
    for slots, most in ((1, 1), (0, 2)):
        spy = Spy(tts.token2wav)
        p = TTS.from_models(dataclasses.replace(tts.models, token2wav=spy), flow_slots=slots)
        arrived = threading.Barrier(2)

        def call():
            arrived.wait()
            p.cross_lingual("Hello.", voice=voice, options=opts).audio()

        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        assert spy.entered.wait(60)
        if slots == 0:
            deadline = threading.Event()
            for _ in range(600):  # until the other call is in the flow too
                if spy.most >= 2:
                    break
                deadline.wait(0.1)
        spy.hold.set()
        for t in threads:
            t.join(120)
        assert spy.most == most


# -- the token source: the flow pause and an explicit cancel token ---------------------------------------


def test_both_token_sources_implement_the_protocol(tts):
    from cosyllama.llm.decode import DirectTokens, TokenSource
    from cosyllama.llm.factory import make_token_source

    direct = make_token_source(tts.llm)
    batched = make_token_source(tts.llm, batched=True, max_active=3)
    try:
        assert isinstance(direct, DirectTokens) and batched.max_active == 3
        for src in (direct, batched):
            assert isinstance(src, TokenSource)
            with src.pause_for_flow(True), src.pause_for_flow(False):
                pass
    finally:
        batched.close()
        direct.close()


def test_the_pipeline_pauses_its_token_source_around_each_flow_call(tts, voice):
    """The pipeline, not the flow stage, holds the pause: around the one flow call of a
    non-streaming segment (never a first chunk), around each streamed chunk (first=True before the
    first audio only)."""
    from cosyllama.tts import TTS, SynthesisOptions

    calls = []

    class Source:
        def __init__(self, inner):
            self.inner = inner

        def generate(self, prefill, n_text_tokens, options, cancel=None):
            return self.inner.generate(prefill, n_text_tokens, options, cancel=cancel)

        @contextlib.contextmanager
        def pause_for_flow(self, first=False):
            calls.append(first)
            yield

        def close(self):
            pass

    p = TTS.from_models(tts.models, token_source=Source(tts.token_source))
    p.cross_lingual("Hello there.", voice=voice, options=SynthesisOptions(seed=1, max_tokens=40,
                                                                        ignore_stop=True)).audio()
    assert calls == [False]
    calls.clear()
    list(p.cross_lingual("Hello there.", voice=voice,
                         options=SynthesisOptions(seed=1, stream=True, ignore_stop=True, max_tokens=90)))
    assert calls[0] is True and not any(calls[1:]) and len(calls) >= 3


def test_a_scheduler_request_cancelled_from_another_thread_frees_its_sequence(tts, voice):
    """TTS.run(request, cancel=token): the token reaches the scheduler as an argument; cancelling it
    from a third thread (not the one iterating) frees the sequence and fails the synthesis."""
    from cosyllama.llm.decode import CancelToken, RequestCancelled
    from cosyllama.llm.factory import make_token_source
    from cosyllama.request import SynthesisOptions, SynthesisRequest
    from cosyllama.tts import TTS

    backend = _Counting(tts.llm)
    sched = make_token_source(backend, batched=True)
    try:
        p = TTS.from_models(tts.models, token_source=sched)
        token = CancelToken()
        req = SynthesisRequest("Hello there.", voice=voice,
                               options=SynthesisOptions(greedy=True, ignore_stop=True, max_tokens=20_000))
        syn = p.run(req, cancel=token)
        failed = []

        def consume():
            try:
                syn.audio()
            except RequestCancelled as e:
                failed.append(e)

        t = threading.Thread(target=consume)
        t.start()
        assert backend.stepping.wait(120)
        assert len(backend.live) == 1
        threading.Thread(target=token.cancel).start()
        t.join(120)
        assert failed and not t.is_alive()
        assert not backend.live and sched.stats()["active_sequences"] == 0
        with pytest.raises(RequestCancelled):  # a cancelled token refuses the next request at once
            p.run(req, cancel=token).audio()
    finally:
        sched.close()


def test_direct_tokens_honour_the_cancel_token_too(tts, voice):
    from cosyllama.llm.decode import CancelToken, RequestCancelled
    from cosyllama.request import SynthesisOptions, SynthesisRequest
    from cosyllama.tts import TTS

    backend = _Counting(tts.llm)
    p = TTS.from_models(dataclasses.replace(tts.models, llm=backend))
    token = CancelToken()
    syn = p.run(SynthesisRequest("Hello there.", voice=voice,
                                 options=SynthesisOptions(greedy=True, stream=True, ignore_stop=True,
                                                          max_tokens=20_000)), cancel=token)
    threading.Thread(target=lambda: (backend.stepping.wait(120), token.cancel())).start()
    with pytest.raises(RequestCancelled):
        for _ in syn:
            pass
    assert not backend.live


def test_no_context_variable_carries_the_cancel_token():
    import cosyllama.llm.decode as decode
    import cosyllama.llm.scheduler as scheduler
    from cosyllama.llm.decode import CancelToken

    assert not hasattr(CancelToken, "bound") and not hasattr(CancelToken, "_current")
    assert "contextvars" not in vars(scheduler) and "contextvars" not in vars(decode)
    assert scheduler.CancelToken is CancelToken  # still importable from the scheduler


# -- LLMBackend: the attributes its callers use ------------------------------------------------------------


def _backends(tts, tiny_gguf):
    from cosyllama.config import load_config
    from cosyllama.llm.static_decode import StaticTorchLLM
    from cosyllama.weights import load_llm_weights

    config = load_config(MODEL_DIR)
    static = StaticTorchLLM(config.llm, load_llm_weights(MODEL_DIR / "llm.pt", config.llm), "cpu", slots=2, ctx=64)
    out = {"TorchLLM": tts.llm, "StaticTorchLLM": static, "SlowBackend": slow_backend(tts.llm),
           "Gated": Gated(tts.llm),
           "_Counting": _Counting(tts.llm)}
    from test_scheduler import Watched

    out["Watched"] = Watched(tts.llm)
    try:
        from cosyllama.llm.llamacpp_backend import LlamaCppLLM

        out["LlamaCppLLM"] = LlamaCppLLM(tiny_gguf("speech", "F32"), config, n_threads=1, n_seq_max=2)
    except ImportError:  # llama-cpp-python not installed: the others still count
        pass
    return out


def test_every_backend_and_fake_has_the_attributes_of_llm_backend(tts, tiny_gguf):
    from cosyllama.llm.backend import LLMBackend

    declared = set(LLMBackend.__annotations__) | {"stats", "start", "step", "release"}
    assert set(LLM_ATTRIBUTES) | {"stats", "start", "step", "release"} == declared
    backends = _backends(tts, tiny_gguf)
    try:
        for label, b in backends.items():
            assert isinstance(b, LLMBackend), label
            for attr in LLM_ATTRIBUTES:
                assert hasattr(b, attr), (label, attr)
            assert isinstance(b.name, str)
            assert b.n_seq_max is None or b.n_seq_max >= 1, label
            assert b.max_seq_tokens is None or b.max_seq_tokens >= 1, label
            assert b.n_threads is None or b.n_threads >= 1, label
            stats = b.stats()
            assert stats is None or isinstance(stats, dict), label
        assert backends["StaticTorchLLM"].n_seq_max == 2 and backends["StaticTorchLLM"].max_seq_tokens == 64
        assert backends["TorchLLM"].n_threads is None and backends["TorchLLM"].stats() is None
    finally:
        if "LlamaCppLLM" in backends:
            backends["LlamaCppLLM"].close()


def test_a_static_torch_llm_holds_as_many_positions_as_it_says(tts):
    """StaticTorchLLM.max_seq_tokens is in RequestLimits.seq_tokens' unit (prompt + new tokens):
    a request of exactly that many positions starts, one more is refused."""
    from cosyllama.config import load_config
    from cosyllama.errors import InputError
    from cosyllama.llm.backend import Prefill
    from cosyllama.llm.static_decode import StaticTorchLLM
    from cosyllama.weights import load_llm_weights

    config = load_config(MODEL_DIR)
    static = StaticTorchLLM(config.llm, load_llm_weights(MODEL_DIR / "llm.pt", config.llm), "cpu", slots=1, ctx=32)
    prefill = Prefill((1, 2, 3, 4))  # 6 positions
    handle = static.begin(prefill, static.max_seq_tokens - len(prefill))
    static.release(handle)
    with pytest.raises(InputError):
        static.begin(prefill, static.max_seq_tokens - len(prefill) + 1)


# -- the CPU report names the LLM by the backend's own name ---------------------------------------------


def test_the_cpu_report_names_a_static_torch_llm_torch():
    """StaticTorchLLM (CUDA, or --llm-precision bf16) was reported as llama.cpp because the report
    compared the class name with "TorchLLM"; the backend's own ``name`` says torch."""
    from cosyllama.cpu import tts_path
    from cosyllama.llm.static_decode import StaticTorchLLM

    class FakeStatic(StaticTorchLLM):
        def __init__(self):  # no weights: only the class and its name matter here
            pass

    flow = SimpleNamespace(precision=torch.bfloat16, precision_choice=None)
    fake = SimpleNamespace(llm=FakeStatic(), device="cuda", token2wav=SimpleNamespace(
        flow=flow, hift=SimpleNamespace(compute_dtype=torch.float32)))
    path = tts_path(fake, "auto", threads=2)
    assert path.llm == "torch"
    assert "llama_cpp" not in path.as_dict()
    assert not any(line.startswith("llama.cpp build") for line in path.lines())
    llama = SimpleNamespace(name="llamacpp", extra_buffer_types_why="mocked")
    path = tts_path(SimpleNamespace(llm=llama, device="cpu", token2wav=fake.token2wav), "auto", threads=2)
    assert path.llm == "llamacpp" and path.llama_bufts == "mocked"


# -- one job class for both servers ------------------------------------------------------------------------------


def test_the_servers_share_one_job_class():
    from cosyllama.server import speech, speech_stream, wyoming
    from cosyllama.server.job import SpeechFormat, SpeechJob, SynthesisJob

    assert issubclass(SpeechJob, SynthesisJob)
    assert wyoming.SynthesisJob is SynthesisJob and speech_stream.SpeechFormat is SpeechFormat
    assert SpeechFormat.job.__annotations__["return"] in (SpeechJob, "SpeechJob")  # the WebSocket's sentences
    assert not hasattr(speech, "_Job") and not hasattr(wyoming, "_Job")


def test_a_job_runs_its_request_with_its_own_cancel_token(tts, voice):
    from cosyllama.request import SynthesisOptions, SynthesisRequest
    from cosyllama.server.job import SynthesisJob

    seen = {}

    class Recorder:
        def run(self, request, *, cancel=None):
            seen["request"], seen["cancel"] = request, cancel
            return tts.run(request, cancel=cancel)

    req = SynthesisRequest("Hi.", voice=voice, options=SynthesisOptions(greedy=True, max_tokens=8, ignore_stop=True))
    job = SynthesisJob(Recorder(), req)
    job.open()
    assert seen["request"] is req and seen["cancel"] is job.token
    n = 0
    while (samples := job.next()) is not None:
        n += samples.size
    assert n > 0
    job.close()
    assert job.token.cancelled
    job.close()  # twice is harmless
