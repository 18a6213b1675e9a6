"""Flow.inference_batch: several equal-length requests in one ODE solve, each row equal to the
request's own Flow.inference within the float tolerance (the rows share no arithmetic), and a
perturbed row outside it (so the equality can fail). Tiny fixture model, CPU."""

from __future__ import annotations

import pytest
import torch

from cosyllama.errors import InputError
from cosyllama.flow import Flow, FlowStreamCache
from helpers import MODEL_DIR, load_fixture, maxdiff

# As tests/test_flow_cache.py: fp32 rounding through 10 Euler steps; bf16 its own rounding. Observed
# on CPU: fp32 2e-6, bf16 0. int8 solves its rows one by one, so its rows are bit-equal.
TOL = {"fp32": 2e-5, "bf16": 1e-2, "int8": 0.0}


@pytest.fixture(scope="module")
def flow():
    return Flow.from_dir(MODEL_DIR)


def _requests(vocab: int) -> list[tuple]:
    """Three requests of equal mel length (prompt + tokens = 55 tokens) that differ in everything
    else: the fixture call, a shorter prompt with more tokens, and random ones."""
    fx = load_fixture("flow")[0]
    tok, pt = torch.from_numpy(fx["token"]), torch.from_numpy(fx["prompt_token"])
    pf, emb = torch.from_numpy(fx["prompt_feat"]), torch.from_numpy(fx["embedding"])
    p, t = pt.shape[1], tok.shape[1]
    g = torch.Generator().manual_seed(1)
    return [(tok, pt, pf, emb),
            (torch.randint(0, vocab, (1, t + 4), generator=g), pt[:, :p - 4], pf[:, :2 * (p - 4)],
             torch.randn(1, 192, generator=g)),
            (torch.randint(0, vocab, (1, t), generator=g), torch.randint(0, vocab, (1, p), generator=g),
             torch.randn(1, 2 * p, 80, generator=g) - 5, torch.randn(1, 192, generator=g))]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_batched_rows_equal_single_solves(flow, precision):
    flow.set_precision(precision)
    try:
        reqs = _requests(flow.cfg.vocab_size)
        single = [flow.inference(*r) for r in reqs]
        batch = flow.inference_batch(reqs)
        assert len(batch) == len(reqs)
        for k, (b, s) in enumerate(zip(batch, single)):
            assert b.shape == s.shape, k
            assert maxdiff(b, s) <= TOL[precision], (precision, k, maxdiff(b, s))
    finally:
        flow.set_precision("fp32")


def test_perturbed_row_fails_the_bound_and_leaves_the_others_alone(flow):
    """One request's prompt mel nudged by 0.01 in one frame: its row leaves the fp32 bound by far
    (the bound can fail), the other rows stay within it (nothing leaks between rows)."""
    reqs = _requests(flow.cfg.vocab_size)
    single = [flow.inference(*r) for r in reqs]
    tok, pt, pf, emb = reqs[1]
    pf = pf.clone()
    pf[:, 3] += 0.01
    batch = flow.inference_batch([reqs[0], (tok, pt, pf, emb), reqs[2]])
    assert maxdiff(batch[1], single[1]) > 10 * TOL["fp32"]
    assert maxdiff(batch[0], single[0]) <= TOL["fp32"]
    assert maxdiff(batch[2], single[2]) <= TOL["fp32"]


def test_streaming_batch_and_one_row(flow):
    reqs = _requests(flow.cfg.vocab_size)
    batch = flow.inference_batch(reqs, streaming=True, finalize=False)
    for r, b in zip(reqs, batch):
        assert maxdiff(b, flow.inference(*r, streaming=True, finalize=False)) <= TOL["fp32"]
    one = flow.inference_batch(reqs[:1])[0]
    assert torch.equal(one, flow.inference(*reqs[0]))  # a batch of one runs the same operations
    assert flow.inference_batch([]) == []


def test_unequal_lengths_and_a_shared_cache_are_refused(flow):
    reqs = _requests(flow.cfg.vocab_size)
    tok, pt, pf, emb = reqs[0]
    with pytest.raises(InputError, match="equal length"):
        flow.inference_batch([reqs[0], (tok[:, :-1], pt, pf, emb)])
    inp = flow.prepare(*reqs[0])
    two = [torch.cat([x, x]) for x in (inp.mu, inp.spks, inp.cond)]
    with pytest.raises(InputError, match="one request"):
        flow.decoder(*two, streaming=True, cache=FlowStreamCache(), keep=50)


def test_bench_flow_batch_part_on_the_tiny_model(tmp_path, monkeypatch, capsys):
    """`cosyllama bench --parts flow-batch` end to end at a toy size (what the GPU check runs at full
    size): a row per N, the batched mels as close to the one-by-one ones as the batch test allows."""
    import json

    from cosyllama.cli import main

    monkeypatch.setenv("COSYLLAMA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "fb.json"
    assert main(["bench", "--model-dir", str(MODEL_DIR), "--parts", "flow-batch", "--flow-precisions", "fp32",
                 "--batch-sizes", "1,2", "--prompt-seconds", "0.4", "--output-seconds", "0.8", "--threads", "1",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["variant"], r["n"]) for r in res["flow_batch"]] == [("fp32", 1), ("fp32", 2)]
    assert all(r["max_abs_diff_batched_vs_serial"] <= TOL["fp32"] and r["speedup"] > 0 for r in res["flow_batch"])
    assert res["flow"] == [] and "one after another vs one batch" in capsys.readouterr().out
    assert main(["bench", "--parts", "flow-batch", "--batch-sizes", "2,0"]) == 2
    assert "--batch-sizes '2,0'" in capsys.readouterr().err
