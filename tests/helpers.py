"""Shared test helpers: the fixture model's paths, golden-vector loading, and replays of recorded
upstream calls. Imported by the test modules (``from helpers import ...``); pytest fixtures live
in ``conftest.py``."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cosyllama.llm.backend import LLMBackend, Prefill
    from cosyllama.llm.decode import DecodeOptions

FIXTURES = Path(__file__).parent / "fixtures" / "cosyvoice3-tiny"
MODEL_DIR = FIXTURES / "model"


def load_fixture(name: str) -> tuple[dict, dict]:
    """Return (arrays, json sidecar) of a fixture file base name, e.g. 'llm_greedy'."""
    import json

    arrays = dict(np.load(FIXTURES / f"{name}.npz"))
    meta = json.loads((FIXTURES / f"{name}.json").read_text())
    return arrays, meta


def fixture_prefill(a: dict):
    """The LLM prompt (:class:`~cosyllama.llm.backend.Prefill`) of an LLM fixture's arrays: its
    prompt transcript + text ids, and its prompt speech tokens."""
    from cosyllama.llm.backend import Prefill

    return Prefill(tuple(a["prompt_text"][0].tolist() + a["text"][0].tolist()),
                   tuple(a["prompt_speech_token"][0].tolist()))


def recorded_flow_calls(flow, case: str, **kw):
    """Replay each ``flow.inference`` call the upstream wrapper made in the end-to-end run ``case``
    (fixture ``e2e_<case>``); yields ``(k, call, mel, expected_mel)``. ``kw`` goes to every call."""
    import torch

    arr, meta = load_fixture(f"e2e_{case}")
    prompt = (torch.from_numpy(arr["in_flow_prompt_speech_token"]), torch.from_numpy(arr["in_prompt_speech_feat"]))
    tokens, emb = torch.from_numpy(arr["flow_tokens"]), torch.from_numpy(arr["in_flow_embedding"])
    for k, call in enumerate(meta["meta"]["flow_calls"]):
        assert call["n_prompt_tokens"] == prompt[0].shape[1]
        mel = flow.inference(tokens[:, :call["n_tokens"]], *prompt, emb, streaming=call["streaming"],
                             finalize=call["finalize"], **kw)
        yield k, call, mel, arr[f"flow_call{k}_mel"]


def synthesize_call(tts, call: dict, **kw):
    """Run one recorded e2e call (its ``meta.call``) through the public API, greedy."""
    wav = FIXTURES / call["prompt_wav"]
    opts = dict(stream=call["stream"], speed=call["speed"], greedy=True, **kw)
    if call["mode"] == "zero_shot":
        return tts.zero_shot(call["tts_text"], wav, call["prompt_text"], **opts)
    if call["mode"] == "cross_lingual":
        return tts.cross_lingual(call["tts_text"], wav, **opts)
    return tts.instruct(call["tts_text"], call["instruct_text"], wav, **opts)


def interleave_chunks(gens: dict) -> dict:
    """Advance the named chunk generators one chunk each in turn until all are done; returns each
    one's chunk samples in order (for checking that interleaved requests don't affect each other)."""
    gens = dict(gens)
    got = {k: [] for k in gens}
    while gens:
        for k in list(gens):
            try:
                got[k].append(next(gens[k]).samples)
            except StopIteration:
                del gens[k]
    return got


def generate_many(backend: LLMBackend, requests: Sequence[tuple[Prefill, int, DecodeOptions]]) -> list[list[int]]:
    """Decode several requests together: one backend ``step`` call advances every live sequence.
    Returns each request's tokens (same rules as ``generate``). The smallest batched driver of
    :class:`~cosyllama.llm.decode.TokenDecoder`; the product's is the server's scheduler."""
    from cosyllama.llm.decode import TokenDecoder

    decoders = [TokenDecoder(backend.cfg, n, opt) for _, n, opt in requests]
    handles: list[object] = []
    try:
        pending: list[tuple[int, object]] = []  # (request, its log-prob row)
        for i, (prefill, _, _) in enumerate(requests):
            handle, logp = backend.start(prefill, decoders[i].max_len)
            handles.append(handle)
            pending.append((i, logp))
        while pending:
            batch = []
            for i, logp in pending:
                tok = decoders[i].choose(logp)
                if tok is None or decoders[i].done:
                    backend.release(handles[i])
                else:
                    batch.append((i, tok))
            if not batch:
                break
            outs = backend.step([(handles[i], tok) for i, tok in batch])
            pending = [(i, out) for (i, _), out in zip(batch, outs)]
    finally:
        for h in handles:
            backend.release(h)
    return [d.tokens for d in decoders]


def maxdiff(actual, expected) -> float:
    """Max abs difference of two arrays or tensors (any device), after checking their shapes."""
    import torch

    a = torch.as_tensor(actual).detach().cpu().double().numpy()
    e = np.asarray(torch.as_tensor(expected).detach().cpu(), dtype=np.float64)
    assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
    return float(np.abs(a - e).max()) if a.size else 0.0


def mixed_requests(pf):
    """Four requests from one prefill that end at different steps (forced lengths 5 and 30, a
    greedy stop, a seeded sample): a batch that pads, shrinks and moves sequences between slots."""
    from cosyllama.llm.backend import Prefill
    from cosyllama.llm.decode import DecodeOptions

    return [(pf, 9, DecodeOptions(greedy=True, ignore_stop=True, max_len=5)),
            (Prefill(pf.text_ids[:-2], pf.prompt_speech_tokens[:20]), 7, DecodeOptions(greedy=True)),
            (pf, 9, DecodeOptions(seed=3)),
            (Prefill(pf.text_ids[3:], pf.prompt_speech_tokens), 9, DecodeOptions(greedy=True, ignore_stop=True,
                                                                                 max_len=30))]


# ----------------------------------------------------------------------------------------------
# How close a log-spectral feature of ours must be to the reference's recording.
#
# Error model. Both implementations compute the same float32 STFT, mel sum and log; they differ only in
# rounding (summation order: MKL/oneDNN/PocketFFT kernels differ between CPU vendors and ISAs). An FFT's
# rounding error is spread over the bins at about eps * sqrt(log2 N) of the frame's spectral amplitude, so
# it is the same in absolute terms for every band of a frame and, after the log, grows as the band's own
# amplitude falls below the frame's strongest band: |dL| ~ c * eps * A_max / A_band, with c = sqrt(log2 N)
# for a magnitude mel and twice that for a power mel (relative error doubles when squared), doubled again
# for two independent implementations. The bound adds the 1e-4 the fixtures README gives for strong bands.
# Checked on: AVX2 AMD (Zen 3) and AVX512-BF16 AMD (Zen 4), where every feature was within 1e-4 alone, and
# Intel AMX (Sapphire Rapids class), where the weakest bands need 0.87 * eps * A_max / A_band (Kaldi
# fbank, c = 12 here) and 0.07 * eps * A_max / A_band (prompt mel, c = 6.6): a margin of ~14x and ~90x.
# A systematic error is held to the 1e-4 in the strong bands, where it shows (tests/test_audio.py
# deliberately breaks pre-emphasis, the window, the mel filters and the gain: each fails).
# ----------------------------------------------------------------------------------------------

FEATURE_ATOL = 1e-4  # strong bands (fixtures README, section 7)
FLOAT32_EPS = float(np.finfo(np.float32).eps)


def log_spectrum_tolerance(ref_log: np.ndarray, banks: np.ndarray, n_fft: int, power: bool,
                           band_axis: int = -1) -> np.ndarray:
    """Per-element bound on |ours - ref| for a natural-log mel feature ``ref_log`` (error model above).

    ``banks``: the mel filters ``(n_mels, n_fft // 2 + 1)``; ``power``: the bands sum |X|^2 (Kaldi fbank)
    rather than |X| (Matcha mel); ``band_axis``: the axis of ``ref_log`` that holds the bands."""
    other_axes = tuple(i for i in range(ref_log.ndim) if i != band_axis % ref_log.ndim)
    width = np.expand_dims(banks.sum(axis=1), axis=other_axes)
    energy = np.exp(ref_log.astype(np.float64)) / width
    amp = np.sqrt(energy) if power else energy
    c = (2 if power else 1) * 2 * np.sqrt(np.log2(n_fft))
    return FEATURE_ATOL + c * FLOAT32_EPS * amp.max(axis=band_axis, keepdims=True) / amp


def assert_log_spectrum_close(name: str, ours, ref: np.ndarray, banks: np.ndarray, n_fft: int, power: bool,
                              band_axis: int = -1) -> None:
    """Assert ``ours`` is within :func:`log_spectrum_tolerance` of ``ref`` everywhere."""
    ours = np.asarray(ours)
    assert ours.shape == ref.shape, f"{name}: shape {ours.shape} != {ref.shape}"
    tol = log_spectrum_tolerance(ref, banks, n_fft, power, band_axis)
    excess = np.abs(ours.astype(np.float64) - ref) - tol
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[worst] <= 0, (f"{name}: differs by {abs(float(ours[worst]) - float(ref[worst])):.3g} at {worst}, "
                                f"bound {float(tol[worst]):.3g}")


# ----------------------------------------------------------------------------------------------
# A slow LLM backend: the one fake the server, limits and web page tests share


class StartInPieces:
    """A test backend's ``start`` (the whole prefill of a request decoding alone) as its own ``begin`` and
    ``prefill_step``, so a wrapper that watches those sees every sequence."""

    def start(self, prefill, max_new_tokens):
        h = self.begin(prefill, max_new_tokens)
        while (logp := self.prefill_step(h, 1 << 30)) is None:
            pass
        return h, logp


class SlowBackend:
    """An LLM backend that delegates to ``inner`` and pauses on the way, so that a test can catch a
    request where it wants it: ``step_delay`` seconds per decode step, ``position_delay`` per prompt
    position and ``piece_delay`` per prefill piece of ``chunk`` positions (a whole ``start`` sleeps as
    long as its positions and pieces would). ``prefilling`` is true inside a prefill call; ``pieces``
    counts prefill pieces."""

    def __init__(self, inner, *, step_delay: float = 0.0, position_delay: float = 0.0, piece_delay: float = 0.0,
                 chunk: int = 1, name: str | None = None):
        self.inner, self.name = inner, inner.name if name is None else name
        self.step_delay, self.position_delay, self.piece_delay, self.chunk = (step_delay, position_delay,
                                                                              piece_delay, chunk)
        self.prefilling = False
        self.pieces = 0

    def __getattr__(self, attr):  # cfg, n_seq_max, max_seq_tokens, release, stats, ...
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def step(self, batch):
        if self.step_delay:
            time.sleep(self.step_delay)
        return self.inner.step(batch)

    def start(self, prefill, max_new_tokens):
        self.prefilling = True
        try:
            time.sleep(self.position_delay * len(prefill) + self.piece_delay * -(-len(prefill) // self.chunk))
            return self.inner.start(prefill, max_new_tokens)
        finally:
            self.prefilling = False

    def begin(self, prefill, max_new_tokens):
        return self.inner.begin(prefill, max_new_tokens)

    def prefill_step(self, handle, max_positions):
        self.prefilling = True
        self.pieces += 1
        try:
            positions = min(max_positions, handle.n_prompt - handle.n_past) if self.position_delay else 0
            time.sleep(self.piece_delay + self.position_delay * positions)
            return self.inner.prefill_step(handle, max_positions)
        finally:
            self.prefilling = False


def slow_backend(inner, **delays) -> SlowBackend:
    """A :class:`SlowBackend` over ``inner``."""
    return SlowBackend(inner, **delays)


class Gated:
    """An LLM backend whose decode steps can be held: after :meth:`hold_after` ``n`` more steps run,
    then steps wait until :meth:`let_go` (so a sequence is still decoding when a client goes)."""

    def __init__(self, inner):
        self.inner, self.name, self.cfg = inner, getattr(inner, "name", "torch"), inner.cfg
        self.n_seq_max, self.max_seq_tokens, self.n_threads = inner.n_seq_max, inner.max_seq_tokens, inner.n_threads
        self._cond = threading.Condition()
        self._budget: int | None = None

    def hold_after(self, n: int) -> None:
        with self._cond:
            self._budget = n

    def let_go(self) -> None:
        with self._cond:
            self._budget = None
            self._cond.notify_all()

    def start(self, prefill, max_new_tokens):
        return self.inner.start(prefill, max_new_tokens)

    def begin(self, prefill, max_new_tokens):
        return self.inner.begin(prefill, max_new_tokens)

    def prefill_step(self, handle, max_positions):
        return self.inner.prefill_step(handle, max_positions)

    def step(self, batch):
        with self._cond:
            while self._budget is not None and self._budget <= 0:
                self._cond.wait()
            if self._budget is not None:
                self._budget -= 1
        return self.inner.step(batch)

    def release(self, handle):
        self.inner.release(handle)

    def stats(self):
        return self.inner.stats()


class LoopbackServer:
    """uvicorn serving ``app`` on a free 127.0.0.1 port in a background thread; ``config``: more
    ``uvicorn.Config`` arguments (e.g. the connection guard's)."""

    def __init__(self, app, **config):
        import socket
        import threading
        import time

        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def wait_for_health(proc, url: str, log_path, seconds: float) -> None:
    """Wait until the server process ``proc`` answers ``GET {url}/health`` with 200; fail with the
    tail of its log (``log_path``) if it exits first or ``seconds`` pass."""
    import time

    import httpx

    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None, Path(log_path).read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)

