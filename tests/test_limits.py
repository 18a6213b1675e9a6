"""Per-request limits (cosyllama.limits), the LLM's per-sequence budget and prefill in pieces: both
backends, and the scheduler interleaving pieces with the other sequences' decode steps."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from cosyllama.config import load_config
from cosyllama.errors import InputError
from cosyllama.limits import LIMIT_HELP, LimitExceeded, RequestLimits, limit_flag
from cosyllama.llm.backend import LLMBackend, Prefill
from cosyllama.llm.decode import DecodeOptions, generate
from cosyllama.llm.scheduler import BatchScheduler, CancelToken, RequestCancelled
from cosyllama.llm.torch_backend import TorchLLM
from helpers import MODEL_DIR, fixture_prefill, load_fixture, slow_backend


@pytest.fixture(scope="module")
def torch_llm():
    return TorchLLM.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def prefill():
    arrays, _ = load_fixture("llm_teacher_forced")
    return fixture_prefill(arrays), int(arrays["text"].shape[1])


# -- the limits --------------------------------------------------------------------------------


def test_limits_name_the_flag_and_the_limit():
    lim = RequestLimits(input_chars=10, instructions_tokens=5, seq_tokens=100)
    lim.check_chars("input", "x" * 10)
    lim.check_chars("instructions", None)
    with pytest.raises(LimitExceeded, match=r"input is too long: 11 characters, at most 10 allowed "
                                            r"\(--max-input-chars\)") as e:
        lim.check_chars("input", "x" * 11)
    assert (e.value.field, e.value.limit, e.value.flag) == ("input", 10, "--max-input-chars")
    assert isinstance(e.value, InputError)
    with pytest.raises(LimitExceeded, match=r"6 text tokens.*at most 5 allowed \(--max-instructions-tokens\)"):
        lim.check_tokens("instructions", 6)
    lim.check_sequence(60, 40, "fits")
    with pytest.raises(LimitExceeded, match=r"needs up to 101 LLM positions \(61 of prompt \+ up to 40 speech "
                                            r"tokens\), at most 100 allowed \(--max-seq-tokens\)"):
        lim.check_sequence(61, 40, "over")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InputError, match="--max-transcript-chars must be an integer >= 1"):
            RequestLimits(transcript_chars=bad)


def test_limits_from_serve_arguments_and_help(capsys):
    from cosyllama.cli import build_parser, main
    from cosyllama.commands.options import request_limits

    args = build_parser().parse_args(["serve", "--model-dir", "m", "--max-instructions-chars", "300",
                                      "--max-seq-tokens", "2048"])
    assert request_limits(args) == RequestLimits(instructions_chars=300, seq_tokens=2048)
    assert request_limits(SimpleNamespace()) == RequestLimits()  # absent flags: defaults
    assert set(LIMIT_HELP) == set(RequestLimits.__dataclass_fields__)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name, field in RequestLimits.__dataclass_fields__.items():
        assert f"{limit_flag(name)} N" in out and f"(default {field.default})" in out
    assert "--prefill-chunk N" in out
    # refused before any model is loaded: one line, exit 2
    assert main(["serve", "--model-dir", "/nonexistent", "--max-seq-tokens", "0"]) == 2
    assert "--max-seq-tokens must be an integer >= 1" in capsys.readouterr().err
    assert main(["serve", "--model-dir", "/nonexistent", "--prefill-chunk", "0"]) == 2
    assert "--prefill-chunk must be >= 1" in capsys.readouterr().err


def test_tts_checks_tokens_and_the_budget_before_any_llm_work(torch_llm):
    """A TTS with limits refuses an over-long instruction (in tokens) or a segment whose sequence
    would not fit, before the LLM runs; the same call passes without limits or with room."""
    from cosyllama.tts import TTS

    class NoLLM:  # any LLM call would fail the test
        def generate(self, *a, **kw):
            raise AssertionError("the LLM ran")

    tts = TTS.from_models(TTS(MODEL_DIR, llm_backend=torch_llm).models, token_source=NoLLM())
    voice = tts.make_voice(str(MODEL_DIR.parent / "wavs" / "prompt_en_16k.wav"), "Hello, this is my voice.")
    tight = TTS.from_models(tts.models, token_source=tts.token_source,
                            limits=RequestLimits(instructions_tokens=8, seq_tokens=200))
    with pytest.raises(LimitExceeded, match="--max-instructions-tokens"):
        tight.instruct("Hi.", "Please speak very slowly and softly.", voice=voice)
    with pytest.raises(LimitExceeded, match="--max-seq-tokens"):
        tight.cross_lingual("A sentence long enough that twenty speech tokens per text token do not fit.",
                            voice=voice)
    with pytest.raises(LimitExceeded, match="--max-transcript-chars"):
        TTS.from_models(tts.models, limits=RequestLimits(transcript_chars=5)).make_voice(
            str(MODEL_DIR.parent / "wavs" / "prompt_en_16k.wav"), "Hello, this is my voice.")
    assert tts.limits is None  # other pipelines leave this one alone
    with pytest.raises(AssertionError, match="the LLM ran"):  # fits: the LLM is asked
        list(TTS.from_models(tts.models, token_source=tts.token_source,
                             limits=RequestLimits()).cross_lingual("Hi.", voice=voice))


# -- the budget in the backends ----------------------------------------------------------------


def test_torch_budget(prefill):
    from cosyllama.config import load_config
    from cosyllama.weights import load_llm_weights

    cfg = load_config(MODEL_DIR)
    weights = load_llm_weights(cfg.model_dir / "llm.pt", cfg.llm)
    p, _ = prefill
    small = TorchLLM(cfg.llm, weights, max_seq_tokens=len(p) + 10)
    small.release(small.begin(p, 10))
    with pytest.raises(InputError, match=f"needs {len(p) + 11} LLM positions.*max_seq_tokens={len(p) + 10}"):
        small.begin(p, 11)
    with pytest.raises(InputError, match="must be 1..32768"):
        TorchLLM(cfg.llm, weights, max_seq_tokens=32769)


def test_llamacpp_budget_caps_the_context(tiny_gguf, prefill):
    pytest.importorskip("llama_cpp")
    from cosyllama.llm.llamacpp_backend import LlamaCppLLM

    p, _ = prefill
    with LlamaCppLLM(tiny_gguf("speech", "F32"), load_config(MODEL_DIR), n_threads=1, n_seq_max=2,
                     max_seq_tokens=2000) as b:
        b.release(b.begin(p, 2000 - len(p)))
        n_ctx = b.n_ctx
        with pytest.raises(InputError, match="max_seq_tokens=2000"):
            b.begin(p, 2001 - len(p))
        assert b.n_ctx == n_ctx == 2 * 2048 and b.stats()["max_seq_tokens"] == 2000  # never grew past the cap


# -- prefill in pieces -------------------------------------------------------------------------


def _pieces(backend, p, n_new, size):
    h = backend.begin(p, n_new)
    n = 0
    while (logp := backend.prefill_step(h, size)) is None:
        n += 1
    return h, logp, n + 1


def test_torch_prefill_in_pieces_equals_one_pass(torch_llm, prefill):
    p, _ = prefill
    assert isinstance(torch_llm, LLMBackend)  # begin and prefill_step are the protocol's
    h1, whole = torch_llm.start(p, 30)
    h2, pieced, n = _pieces(torch_llm, p, 30, 7)
    assert n == -(-len(p) // 7)
    torch.testing.assert_close(pieced, whole, atol=2e-5, rtol=0)
    tok = int(whole.argmax())
    (a,), (b,) = torch_llm.step([(h1, tok)]), torch_llm.step([(h2, tok)])
    torch.testing.assert_close(b, a, atol=2e-5, rtol=0)
    with pytest.raises(RuntimeError, match="complete"):
        torch_llm.prefill_step(h2, 7)
    for h in (h1, h2):
        torch_llm.release(h)


def test_llamacpp_prefill_in_pieces_equals_one_pass(tiny_gguf, prefill):
    pytest.importorskip("llama_cpp")
    from cosyllama.llm.llamacpp_backend import LlamaCppLLM

    p, _ = prefill
    for layout in ("speech", "merged"):
        with LlamaCppLLM(tiny_gguf(layout, "F32"), load_config(MODEL_DIR), n_threads=1, n_seq_max=2) as b:
            h1, whole = b.start(p, 30)
            h2, pieced, n = _pieces(b, p, 30, 5)
            assert n == -(-len(p) // 5) and b.cells_used(h2.seq_id) == len(p)
            torch.testing.assert_close(pieced, whole, atol=1e-4, rtol=0)
            b.release(h1)
            b.release(h2)
            with pytest.raises(InputError, match="still in its prefill"):
                h3 = b.begin(p, 30)
                b.prefill_step(h3, 5)
                b.step([(h3, 1)])
            b.release(h3)
            assert b.cells_used(h3.seq_id) == 0


def test_scheduler_pieces_equal_alone(torch_llm, prefill):
    p, n_text = prefill
    opts = DecodeOptions(greedy=True, max_len=60)
    alone = list(generate(torch_llm, p, n_text, opts))
    with BatchScheduler(torch_llm, prefill_chunk=9) as sched:
        got = [list(sched.generate(p, n_text, opts)) for _ in range(2)]
        pieces = sched.stats()["prefill_pieces"]
    assert got == [alone, alone]
    assert pieces == 2 * -(-len(p) // 9)


def _logging_steps(backend, log: list) -> None:
    """Append ``("step", n)`` to ``log`` at each decode step of ``n`` sequences of ``backend`` and
    ``("piece", handle)`` at each prefill piece (the scheduler's worker is the only caller: in order)."""
    step, prefill_step = backend.step, backend.prefill_step

    def logged_step(batch):
        log.append(("step", len(batch)))
        return step(batch)

    def logged_piece(handle, max_positions):
        log.append(("piece", handle))
        return prefill_step(handle, max_positions)

    backend.step, backend.prefill_step = logged_step, logged_piece


def test_long_prefill_interleaves_with_decoding(torch_llm, prefill):
    """A long prompt prefilled in 12 pieces beside a short request that decodes: one piece at most
    between two decode steps, and the short request decodes between every two of the long one's
    pieces (whole, the prefill would run between two steps). Counted, not timed: the short request
    decodes until the long one is done (5 ms a step, so that its first 2,000 steps outlast the long
    request's submission however busy the machine)."""
    p, n_text = prefill
    long = Prefill(p.text_ids * 6, p.prompt_speech_tokens)
    pieces = -(-len(long) // 32)
    backend = slow_backend(torch_llm, step_delay=0.005, name="slow")
    log: list = []
    _logging_steps(backend, log)
    with BatchScheduler(backend, prefill_chunk=32) as sched:
        short = sched.generate(Prefill(p.text_ids[:5]), 1, DecodeOptions(greedy=True, min_len=2000, max_len=2000))
        next(short)
        long_tokens = sched.generate(long, n_text, DecodeOptions(greedy=True, max_len=5))
        t = threading.Thread(target=lambda: list(long_tokens))
        t.start()
        for _ in short:
            if not t.is_alive():
                break
        t.join()
        short.close()
    handles = [h for what, h in log if what == "piece"]
    long_handle = max(handles, key=handles.count)
    at = [i for i, (what, h) in enumerate(log) if what == "piece" and h is long_handle]
    assert len(at) == pieces, f"the long prompt ran in {len(at)} pieces, not {pieces}"
    between = [log[i + 1:j] for i, j in zip(at, at[1:])]
    steps = [sum(what == "step" for what, _ in seg) for seg in between]
    assert all(n == 1 for n in steps), f"decode steps between the long prompt's pieces: {steps}"
    kinds = [what for what, _ in log]
    assert "piece, piece" not in ", ".join(kinds), "two prefill pieces ran between two decode steps"


def test_cancel_between_pieces(torch_llm, prefill):
    """A request cancelled during its prefill is released after at most one more piece."""
    p, n_text = prefill
    long = Prefill(p.text_ids * 6, p.prompt_speech_tokens)
    backend = slow_backend(torch_llm, piece_delay=0.1, chunk=16, name="slow")
    with BatchScheduler(backend, prefill_chunk=16) as sched:
        token = CancelToken()
        it = sched.generate(long, n_text, DecodeOptions(greedy=True), cancel=token)
        got = []

        def consume():
            try:
                list(it)
            except RequestCancelled as e:
                got.append(e)

        t = threading.Thread(target=consume)
        t.start()
        deadline = time.monotonic() + 5
        while backend.pieces < 2:
            assert time.monotonic() < deadline, "the prompt is not being prefilled in pieces"
            time.sleep(0.01)
        token.cancel()
        at_cancel = backend.pieces  # a piece counts when it begins
        t.join(60)  # only a hang reaches this
        assert not t.is_alive(), "the cancelled request was not released"
        stats = sched.stats()
    assert got and stats["active_sequences"] == 0 and stats["tokens"] == 0
    # after the cancel, one piece at most began (the worker may have been past its check)
    assert backend.pieces <= at_cancel + 1 < -(-len(long) // 16)
