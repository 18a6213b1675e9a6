"""A thread done with model code gives its OpenMP team back (cosyllama.openmp): libgomp keeps one team per
thread that ran a parallel region, and once teams outnumber the cores every region waits for its workers to
wake (a stream's first flow call 0.9 -> 1.3 s on 2 cores; docs/performance-notes.md, "One OpenMP team at a
time"). The first test checks libgomp does what the module relies on, by the threads the process has; the
others that each place model code leaves a thread gives its team back."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cosyllama import openmp
from server_helpers import wait_until


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settles(want: int, timeout: float = 30.0) -> int:
    """The process's thread count once it is ``want`` (a released worker leaves the list as it exits),
    or what it is after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while (n := _threads()) != want and time.monotonic() < end:
        time.sleep(0.01)
    return n


def _region() -> None:
    torch.nn.functional.gelu(torch.ones(1 << 20))  # far above ATen's grain: a parallel region


@pytest.fixture
def two_threads():
    if not openmp.can_release():
        pytest.skip("PyTorch's parallel regions do not run on a libgomp with OpenMP 5.0's pause here")
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def test_a_thread_gives_back_its_own_team_and_gets_a_new_one_when_it_needs_it(two_threads):
    _region()  # this thread's own team, which must survive the other thread's release
    base = _threads()

    def other():
        start = _threads()  # this thread included
        _region()
        with_team = _threads()
        assert openmp.release_thread_team()
        after = _settles(start)
        assert openmp.release_thread_team()  # holding none: nothing to do
        _region()  # a new team, as the next flow call on a served thread makes it
        again = _threads()
        assert openmp.release_thread_team()
        return start, with_team, after, again, _settles(start)

    with ThreadPoolExecutor(1) as pool:
        start, with_team, after, again, last = pool.submit(other).result()
    assert with_team == start + 1 and again == start + 1  # two threads: the caller and one worker
    assert after == start and last == start
    assert _settles(base) == base  # the main thread's team is untouched (its worker still runs)
    _region()
    assert _threads() == base


def test_hold_makes_a_team_on_a_thread_that_has_none(two_threads):
    def other():
        start = _threads()
        openmp.hold_thread_team()
        held = _threads()
        openmp.release_thread_team()
        return start, held, _settles(start)

    with ThreadPoolExecutor(1) as pool:
        start, held, after = pool.submit(other).result()
    assert held == start + 1 and after == start


def test_release_does_nothing_inside_a_parallel_region_or_without_libgomp(monkeypatch):
    monkeypatch.setattr(openmp, "_pause", lambda: None)
    assert not openmp.release_thread_team() and not openmp.can_release()


# -- where model code leaves a thread -------------------------------------------------------------


@pytest.fixture
def released(monkeypatch):
    """The threads that called release_thread_team, by name, in order (the wiring, not libgomp)."""
    names: list[str] = []

    def record():
        names.append(threading.current_thread().name)
        return True

    for module in ("cosyllama.openmp", "cosyllama.tts", "cosyllama.server.serving", "cosyllama.llm.scheduler",
                   "cosyllama.batch.engine"):
        monkeypatch.setattr(f"{module}.release_thread_team", record)
    monkeypatch.setattr("cosyllama.llm.scheduler.hold_thread_team",
                        lambda: names.append("hold:" + threading.current_thread().name))
    return names


def test_each_flow_call_gives_the_team_back(tts, voice, released):
    from cosyllama.tts import SynthesisOptions

    chunks = list(tts.zero_shot("Hello there.", voice=voice,
                                options=SynthesisOptions(seed=0, stream=True, max_tokens=60)))
    assert chunks and released and set(released) == {threading.current_thread().name}


def test_a_serving_call_gives_the_team_back_even_when_it_fails(tts, released):
    import asyncio

    from server_helpers import serving_of

    def fails():
        raise ValueError("a user's mistake")

    async def calls(serving):
        assert await serving.call(lambda x: x + 1, 1) == 2
        with pytest.raises(ValueError):
            await serving.call(fails)

    serving = serving_of(tts)
    try:
        released.clear()
        asyncio.run(calls(serving))
    finally:
        serving.close()
    assert [n for n in released if n.startswith("cosyllama-serve")] and len(released) == 2


def test_loading_making_and_warming_a_voice_give_the_team_back(tts, released):
    from cosyllama.models import Models
    from cosyllama.options import LoadOptions
    from server_helpers import MODEL_DIR, PROMPT_TEXT, PROMPT_WAV

    Models.load(LoadOptions(MODEL_DIR, threads=1, precision="fp32"))
    assert released == [threading.current_thread().name]
    voice = tts.make_voice(PROMPT_WAV, PROMPT_TEXT)
    tts.warm_voice(voice)
    assert released == [threading.current_thread().name] * 3


def test_the_scheduler_gives_its_team_back_before_it_waits(tts, released):
    from cosyllama.llm.backend import Prefill
    from cosyllama.llm.decode import DecodeOptions
    from cosyllama.llm.scheduler import BatchScheduler

    with BatchScheduler(tts.llm) as sched:
        wait_until(lambda: "cosyllama-scheduler" in released, "the idle scheduler to give its team back")
        released.clear()
        tokens = list(sched.generate(Prefill((1, 2, 3), (4, 5)), 5, DecodeOptions(greedy=True, max_len=5)))
        assert tokens
        wait_until(lambda: released[-1:] == ["cosyllama-scheduler"], "the scheduler, idle again, to give it back")
    # while it decoded it held a team again (llama.cpp's threads beside flow calls: their workers must not spin)
    assert "hold:cosyllama-scheduler" in released


def test_the_scheduler_paused_for_a_first_chunk_gives_its_team_back_and_holds_one_again(tts, released):
    from cosyllama.llm.backend import Prefill
    from cosyllama.llm.decode import DecodeOptions
    from cosyllama.llm.scheduler import BatchScheduler

    with BatchScheduler(tts.llm, interleave="first") as sched:
        tokens = sched.generate(Prefill((1, 2, 3), (4, 5)), 5, DecodeOptions(greedy=True, max_len=40,
                                                                               ignore_stop=True))
        next(tokens)
        with sched.pause_for_flow(first=True):
            released.clear()
            wait_until(lambda: "cosyllama-scheduler" in released, "the paused scheduler to give its team back")
        assert len(list(tokens)) == 39
    assert released.index("hold:cosyllama-scheduler") > released.index("cosyllama-scheduler")


def test_a_served_model_gives_the_loading_threads_team_back(tts, released):
    from server_helpers import serving_of

    serving = serving_of(tts)
    try:
        assert released[-1] == threading.current_thread().name
    finally:
        serving.close()


def test_a_batch_engine_gives_the_loading_threads_team_back(tts, released, tmp_path):
    from cosyllama.batch.engine import BatchEngine, EngineOptions

    engine = BatchEngine(EngineOptions(tts.options), tmp_path, models=tts.models, voices=tts.voices)
    try:
        assert threading.current_thread().name in released  # the rows run on the engine's workers
    finally:
        engine.close()


def test_the_http_routes_model_calls_give_the_team_back(tts, voice, monkeypatch):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from cosyllama.server.app import create_app
    from cosyllama.server.options import ServeOptions, ServingOptions
    from helpers import LoopbackServer

    wrapped: list[str] = []

    def spy(fn):
        wrapped.append(getattr(fn, "__name__", repr(fn)))
        return fn

    for module in ("cosyllama.server.speech", "cosyllama.server.captioned"):
        monkeypatch.setattr(f"{module}.gives_team_back", spy)
    tts.voices.add("en", voice, replace=True)
    srv = LoopbackServer(create_app(tts, ServeOptions(ServingOptions(tts.options))))
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            body = {"input": "Hello there.", "voice": "en", "greedy": True, "response_format": "pcm"}
            assert c.post("/v1/audio/speech", json={**body, "stream": True}).status_code == 200
            assert c.post("/dev/captioned_speech", json={**body, "stream": True}).status_code == 200
    finally:
        srv.stop()
    assert {"open", "next_bytes", "next_line"} <= set(wrapped)
