"""PyTorch LLM stage against the golden fixtures (teacher-forced log-probs, greedy decoding)."""

import numpy as np
import pytest
import torch

from cosyllama.llm.backend import Prefill
from cosyllama.llm.decode import DecodeOptions, SilentTokenFilter, TokenDecoder, generate
from cosyllama.llm.torch_backend import TorchLLM
from helpers import MODEL_DIR, fixture_prefill, generate_many, load_fixture


@pytest.fixture(scope="module")
def llm():
    return TorchLLM.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def tf():
    return load_fixture("llm_teacher_forced")


def test_prefill_assembly_equals_fixture(llm, tf):
    a, _ = tf
    pf = fixture_prefill(a)
    emb = llm.model.prefill_embeddings(pf.text_ids, pf.prompt_speech_tokens)
    assert len(pf) == a["lm_input"].shape[1]
    np.testing.assert_allclose(emb.numpy(), a["lm_input"][0], atol=0, rtol=0)


def test_teacher_forced_logp_cached(llm, tf):
    a, _ = tf
    seq, lp = llm.start(fixture_prefill(a), len(a["continuation"]))
    rows = [lp] + [llm.step([(seq, t)])[0] for t in a["continuation"].tolist()]
    got = torch.stack(rows).numpy()
    assert np.abs(got - a["logp_cached"]).max() <= 1e-4
    np.testing.assert_array_equal(got.argmax(-1), a["argmax_cached"])


def test_cached_decode_equals_full_forward(llm, tf):
    a, _ = tf
    pf = fixture_prefill(a)
    emb = llm.model.prefill_embeddings(pf.text_ids, pf.prompt_speech_tokens)
    cont = llm.model.speech_embedding.weight[torch.as_tensor(a["continuation"], dtype=torch.long)]
    full = llm.full_forward_logp(torch.cat([emb, cont]))
    l0 = emb.shape[0]
    full_rows = full[l0 - 1:].numpy()  # position L0-1+k predicts after continuation[:k]
    seq, lp = llm.start(pf, len(a["continuation"]))
    cached = torch.stack([lp] + [llm.step([(seq, t)])[0] for t in a["continuation"].tolist()]).numpy()
    assert np.abs(full_rows - cached).max() <= 1e-5
    assert np.abs(full_rows[a["logp_full_rows"]] - a["logp_full"]).max() <= 1e-4


def test_greedy_tokens_equal_fixture(llm):
    a, meta = load_fixture("llm_greedy")
    pf = fixture_prefill(a)
    n_text = a["text"].shape[1]
    toks = list(generate(llm, pf, n_text, DecodeOptions(greedy=True)))
    assert toks == a["tokens"].tolist()
    assert meta["meta"]["min_len"] == 2 * n_text and meta["meta"]["max_len"] == 20 * n_text


def test_greedy_stop_id_and_scores(llm):
    a, meta = load_fixture("llm_greedy")
    pf = fixture_prefill(a)
    dec = TokenDecoder(llm.cfg, a["text"].shape[1], DecodeOptions(greedy=True))
    seq, lp = llm.start(pf, dec.max_len)
    step = 0
    while True:
        masked = lp.clone()
        if step < dec.min_len:
            masked[llm.cfg.speech_token_size:] = float("-inf")
        top = torch.topk(masked, 5)
        np.testing.assert_array_equal(top.indices.numpy(), a["step_top5_ids"][step])
        np.testing.assert_allclose(top.values.numpy(), a["step_top5_scores"][step], atol=1e-4)
        tok = dec.choose(lp)
        step += 1
        if tok is None:
            break
        (lp,) = llm.step([(seq, tok)])
    assert dec.stop_id == meta["meta"]["stop_token_id"]
    assert step == meta["meta"]["n_steps"]


def test_min_len_masks_every_special_id(llm):
    """Deviation Q1: before min_len no special id can stop decoding, not only 6561."""
    cfg = llm.cfg
    dec = TokenDecoder(cfg, 3, DecodeOptions(greedy=True))
    logp = torch.full((cfg.vocab_size,), -50.0)
    logp[cfg.eos] = 0.0
    logp[6700] = -1.0
    logp[17] = -2.0
    assert [dec.choose(logp) for _ in range(dec.min_len)] == [17] * 6
    assert dec.choose(logp) is None and dec.stop_id == cfg.eos


def test_max_len_bounds_output(llm):
    a, _ = load_fixture("llm_greedy")
    toks = list(generate(llm, fixture_prefill(a), 1, DecodeOptions(greedy=True, ignore_stop=True, max_len=7)))
    assert len(toks) == 7 and all(t < 6561 for t in toks)


def test_generate_many_equals_each_alone(llm):
    a, _ = load_fixture("llm_greedy")
    pf = fixture_prefill(a)
    pf2 = Prefill(pf.text_ids[:-2], pf.prompt_speech_tokens[:20])
    reqs = [(pf, 9, DecodeOptions(greedy=True)), (pf2, 7, DecodeOptions(greedy=True)),
            (pf, 9, DecodeOptions(seed=3))]
    alone = [list(generate(llm, p, n, o)) for p, n, o in reqs]
    assert generate_many(llm, reqs) == alone
    assert alone[0] == a["tokens"].tolist()


def test_seeded_sampling_reproducible(llm):
    a, _ = load_fixture("llm_greedy")
    pf = fixture_prefill(a)
    runs = [list(generate(llm, pf, 9, DecodeOptions(seed=1234))) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0
    other = list(generate(llm, pf, 9, DecodeOptions(seed=99, ignore_stop=True, max_len=40)))
    assert other != list(generate(llm, pf, 9, DecodeOptions(seed=98, ignore_stop=True, max_len=40)))


def test_silent_token_filter_equals_fixture():
    a, _ = load_fixture("llm_job_silence_filter")
    assert SilentTokenFilter().filter(a["llm_tokens"].tolist()) == a["kept_tokens"].tolist()


def test_batched_step_equals_stepping_each_alone(llm):
    """Sequences at different lengths stepped together (one pass through the body) give each one's
    log-probs as stepping it alone, up to float rounding, and advance each cache by one."""
    a, _ = load_fixture("llm_teacher_forced")
    base = fixture_prefill(a)
    prefills = [base, Prefill(base.text_ids[:-3], base.prompt_speech_tokens),
                Prefill(base.text_ids, base.prompt_speech_tokens[:-5])]
    toks = a["continuation"].tolist()

    def run(together: bool):
        seqs = [llm.start(pf, 16)[0] for pf in prefills]
        out = []
        for k in range(4):
            batch = [(s, toks[(k + i) % len(toks)]) for i, s in enumerate(seqs)]
            out.append(torch.stack(llm.step(batch) if together else [llm.step([b])[0] for b in batch]))
        lengths = [s.cache.length for s in seqs]
        for s in seqs:
            llm.release(s)
        return torch.stack(out), lengths

    (together, len_t), (alone, len_a) = run(True), run(False)
    assert len_t == len_a == [len(pf) + 4 for pf in prefills]
    assert together.shape == (4, 3, 6761)
    assert (together - alone).abs().max() <= 1e-5
    assert torch.equal(together.argmax(-1), alone.argmax(-1))


def test_a_sequence_twice_in_one_step_is_refused(llm):
    from cosyllama.errors import InputError

    a, _ = load_fixture("llm_teacher_forced")
    seq, _ = llm.start(fixture_prefill(a), 4)
    with pytest.raises(InputError, match="only once"):
        llm.step([(seq, 1), (seq, 2)])
    assert seq.cache.length == len(fixture_prefill(a))  # nothing was fed
    llm.release(seq)
