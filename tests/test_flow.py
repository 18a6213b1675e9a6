"""Flow stage against the upstream fixtures (flow.npz, noise_buffers.npz, e2e_*.npz)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyllama.errors import CheckpointError, DeviceError, InputError
from cosyllama.flow import Flow, chunk_attention_mask, cosine_t_span, flow_noise
from helpers import MODEL_DIR, load_fixture, recorded_flow_calls

ATOL = 1e-3  # fixture README §7: 10 Euler steps amplify float differences; we observe ~0 on CPU
E2E = ["cross_lingual_nonstream", "cross_lingual_stream", "instruct2_nonstream", "instruct2_stream",
       "zero_shot_nonstream", "zero_shot_nonstream_speed1.5", "zero_shot_stream"]


def close(actual, expected, atol=ATOL, what=""):
    a = torch.as_tensor(actual).detach().cpu().numpy()
    e = np.asarray(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    diff = float(np.abs(a.astype(np.float64) - e.astype(np.float64)).max()) if a.size else 0.0
    assert diff <= atol, f"{what}: max abs diff {diff:.3g} > {atol}"


@pytest.fixture(scope="module")
def fx():
    return load_fixture("flow")[0]


@pytest.fixture(scope="module")
def flow():
    return Flow.from_dir(MODEL_DIR)


def args(fx, n=None):
    tok = torch.from_numpy(fx["token"])
    if n is not None:
        tok = tok[:, :n]
    return (tok, torch.from_numpy(fx["prompt_token"]), torch.from_numpy(fx["prompt_feat"]),
            torch.from_numpy(fx["embedding"]))


def test_noise_buffer_is_seed0_randn_and_leaves_global_rng_alone():
    nb = load_fixture("noise_buffers")[0]["flow_rand_noise_prefix"]
    before = torch.get_rng_state()
    noise = flow_noise()
    assert torch.equal(torch.get_rng_state(), before)
    assert noise.shape == (1, 80, 15000) and noise.dtype == torch.float32
    assert np.array_equal(noise[:, :, :nb.shape[2]].numpy(), nb)
    # the reference values of docs/reference.md#flow-noise
    assert torch.allclose(noise[0, :2, :3], torch.tensor([[-1.1258, -1.1524, -0.2506], [0.8692, 0.5762, -0.4120]]),
                          atol=1e-4)


def test_schedule_and_masks(fx, flow):
    assert np.array_equal(cosine_t_span(10).numpy(), fx["t_span"])
    assert np.array_equal(chunk_attention_mask(100, 50).numpy(), fx["stream_chunk1_attn_mask"])
    m = chunk_attention_mask(120, 50)
    assert [int(m[i].sum()) for i in (0, 49, 50, 119)] == [50, 50, 100, 120]
    close(flow.decoder.estimator.rotary_embed(110), fx["dit_rope_freqs"][0], 0, "rope")


def test_inputs_before_solver(fx, flow):
    seen = {}
    hooks = [flow.input_embedding.register_forward_hook(lambda m, i, o: seen.__setitem__("emb", o)),
             flow.pre_lookahead_layer.register_forward_hook(lambda m, i, o: seen.__setitem__("look", o))]
    try:
        with torch.no_grad():
            inp = flow.prepare(*args(fx))
    finally:
        for h in hooks:
            h.remove()
    close(inp.spks, fx["spks"], 1e-6, "spks")
    close(seen["emb"], fx["token_embedding"], 1e-6, "token_embedding")
    close(seen["look"], fx["h_lookahead"], 1e-5, "h_lookahead")
    close(inp.mu, fx["mu"], 1e-5, "mu")
    close(inp.cond, fx["cond"], 0, "cond")
    assert inp.prompt_frames == fx["prompt_feat"].shape[1]


def test_solver_and_dit_internals(fx, flow):
    """Euler times/states, estimator outputs and DiT internals at step 0, so a failure names the part."""
    est = flow.decoder.estimator
    calls, step0 = [], {}

    def record(name):
        def hook(m, i, o):
            if len(calls) == 0:  # still inside the first estimator call
                step0.setdefault(name, []).append(o)
        return hook

    hooks = [est.register_forward_hook(lambda m, i, o: calls.append((i[0][0], i[2][0], o)))]
    hooks += [est.time_embed.register_forward_hook(record("time_embed")),
              est.input_embed.register_forward_hook(record("input_embed")),
              est.norm_out.register_forward_hook(record("norm_out")),
              est.proj_out.register_forward_hook(record("proj_out"))]
    hooks += [b.register_forward_hook(record(f"block{i}")) for i, b in enumerate(est.transformer_blocks)]
    try:
        with torch.no_grad():
            inp = flow.prepare(*args(fx))
            out = flow.decoder(inp.mu, inp.spks, inp.cond)
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == 10
    close(torch.stack([c[1] for c in calls]), fx["euler_t"], 0, "euler_t")
    close(torch.stack([c[0] for c in calls]), fx["euler_x"], ATOL, "euler_x")
    close(torch.stack([calls[0][2], calls[-1][2]]), fx["euler_estimator_out_first_last"], ATOL, "estimator out")
    close(step0["time_embed"][0], fx["dit_time_embed_step0"], 1e-5, "time_embed")
    close(step0["input_embed"][0], fx["dit_input_embed_step0"], 1e-4, "input_embed")
    for i in range(len(est.transformer_blocks)):
        close(step0[f"block{i}"][0], fx[f"dit_block{i}_out_step0"], 1e-4, f"block{i}")
    close(step0["norm_out"][0], fx["dit_norm_out_step0"], 1e-4, "norm_out")
    close(step0["proj_out"][0], fx["dit_proj_out_step0"], 1e-4, "proj_out")
    close(out, fx["decoder_out"], ATOL, "decoder_out")


def test_mel_non_streaming(fx, flow):
    mel = flow.inference(*args(fx))
    assert mel.dtype == torch.float32
    close(mel, fx["mel"], ATOL, "mel")
    close(mel, fx["stream_final_mel"], ATOL, "stream_final_mel")


def test_mel_streaming(fx, flow):
    n = int(fx["stream_chunk1_n_tokens"][0])
    seen = {}
    h = flow.pre_lookahead_layer.register_forward_hook(lambda m, i, o: seen.__setitem__("look", o))
    try:
        mel = flow.inference(*args(fx, n), streaming=True, finalize=False)
    finally:
        h.remove()
    close(seen["look"], fx["stream_chunk1_h_lookahead"], 1e-5, "stream h_lookahead")
    close(mel, fx["stream_chunk1_mel"], ATOL, "stream_chunk1_mel")
    mel = flow.inference(*args(fx), streaming=True, finalize=True)
    close(mel, fx["mel_streaming_attention_finalize"], ATOL, "mel_streaming_attention_finalize")


@pytest.mark.parametrize("case", E2E)
def test_every_recorded_flow_call(case, flow):
    """Each flow.inference call the upstream wrapper made in the end-to-end runs."""
    for k, call, mel, want in recorded_flow_calls(flow, case):
        assert mel.shape[2] == call["n_mel_out"]
        close(mel, want, ATOL, f"{case} call {k}")


def test_bad_inputs_are_refused(fx, flow):
    tok, ptok, pfeat, emb = args(fx)
    with pytest.raises(InputError, match="prompt_feat"):
        flow.inference(tok, ptok, pfeat[:, :-1], emb)
    with pytest.raises(InputError, match="embedding"):
        flow.inference(tok, ptok, pfeat, emb[:, :80])
    with pytest.raises(InputError, match=r"ids are 0\.\.6560"):
        flow.inference(tok + 6561, ptok, pfeat, emb)
    with pytest.raises(InputError, match="at least 4 tokens"):
        flow.inference(tok[:, :3], ptok, pfeat, emb, finalize=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(DeviceError, match="cuda"):
        Flow.from_dir(MODEL_DIR, device="cuda")


def _copy_model(tmp_path, flow_sd):
    import shutil

    d = tmp_path / "model"
    shutil.copytree(MODEL_DIR, d, ignore=shutil.ignore_patterns("flow.pt", "llm.pt"))
    (d / "llm.pt").touch()  # the config reader only checks that it exists
    torch.save(flow_sd, d / "flow.pt")
    return d


@pytest.mark.parametrize("change, match", [
    ("drop", "missing keys: decoder.estimator.proj_out.bias"),
    ("rename", "unexpected keys: decoder.estimator.proj_out.bias_renamed"),
    ("reshape", r"wrong shapes: decoder.estimator.proj_out.bias \(79,\)"),
])
def test_broken_flow_checkpoint_is_refused_by_name(tmp_path, change, match):
    sd = torch.load(MODEL_DIR / "flow.pt", weights_only=True)
    key = "decoder.estimator.proj_out.bias"
    if change == "drop":
        del sd[key]
    elif change == "rename":
        sd[key + "_renamed"] = sd.pop(key)
    else:
        sd[key] = sd[key][:-1].clone()
    with pytest.raises(CheckpointError, match=match):
        Flow.from_dir(_copy_model(tmp_path, sd))

