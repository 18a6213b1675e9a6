"""The streaming schedule is the reference's whatever the yaml says, and each value the yaml holds is
used where the reference uses it and ignored where the reference ignores it.

The reference's model wrapper fixes its streaming hops in code (first hop 25 tokens plus the prompt
pad that rounds the prompt up to a multiple of 25, doubling to at most 100) and reads only the
flow's look-ahead and mel-frames-per-token from the flow module, which the yaml builds; the DiT's
block-causal mask follows the yaml's ``chunk_size * token_mel_ratio`` (docs/reference.md#chunk-
schedule and #yaml-values-the-reference-ignores). Every recorded model has ``chunk_size`` 25, where
both readings agree, so these tests run a copy of the fixture model whose yaml says 20: the flow
calls (tokens per call, offsets, streaming flags), the emitted chunk sizes and the DiT's mask blocks
are checked against :func:`reference_schedule`, written from the reference's rule and sharing no code
with the engine. With the hop taken from ``chunk_size`` (the rule this replaced) the first chunk
would be 33 tokens instead of 28 and the test fails.
"""

from __future__ import annotations

import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from cosyllama.config import load_config
from cosyllama.engine import FlowPrompt, Token2Wav
from cosyllama.errors import ModelDirError
from cosyllama.flow import Flow, dit
from cosyllama.vocoder import HiFT
from helpers import MODEL_DIR, load_fixture

MEL_SAMPLES = 480  # samples per mel frame at 24 kHz


def reference_schedule(n_prompt: int, n_tokens: int, lookahead: int = 3) -> list[tuple[int, int, bool]]:
    """The reference wrapper's token2wav calls for ``n_tokens`` tokens that are all there: each
    ``(tokens given to the flow, token offset, streaming)``; the last call is the final one."""
    hop, offset, calls = 25, 0, []
    pad = math.ceil(n_prompt / 25) * 25 - n_prompt
    while True:
        this = hop + pad if offset == 0 else hop
        if n_tokens - offset < this + lookahead:
            break
        calls.append((offset + this + lookahead, offset, True))
        offset += this
        hop = min(100, 2 * hop)
    calls.append((n_tokens, offset, False))
    return calls


def _model_with_yaml(tmp_path, old: str, new: str):
    d = tmp_path / "model"
    shutil.copytree(MODEL_DIR, d)
    y = d / "cosyvoice3.yaml"
    text = y.read_text()
    assert text.count(old) == 1, old
    y.write_text(text.replace(old, new))
    return d


@pytest.fixture(scope="module")
def chunk20(tmp_path_factory):
    """Token2Wav of the fixture model with ``chunk_size: 20`` in its yaml."""
    d = _model_with_yaml(tmp_path_factory.mktemp("chunk20"), "chunk_size: 25", "chunk_size: 20")
    cfg = load_config(d)
    assert cfg.chunk_size == 20 and cfg.flow.static_chunk_size == 40
    return Token2Wav.from_config(cfg, Flow.from_config(cfg), HiFT.from_config(cfg))


def _prompt(n_prompt: int) -> FlowPrompt:
    a, _ = load_fixture("e2e_zero_shot_stream")
    tok = torch.from_numpy(a["in_flow_prompt_speech_token"])[:, :n_prompt]
    feat = torch.from_numpy(a["in_prompt_speech_feat"])[:, :2 * n_prompt]
    return FlowPrompt(tok, feat, torch.from_numpy(a["in_flow_embedding"]))


def _run(t2w: Token2Wav, n_prompt: int, n_tokens: int, monkeypatch):
    """Stream ``n_tokens`` tokens; returns the flow calls, the mask block sizes and the chunk sizes."""
    tokens = torch.randint(0, 6561, (n_tokens,), generator=torch.Generator().manual_seed(n_tokens)).tolist()
    calls, blocks = [], []
    real_flow, real_mask = t2w.flow.inference, dit.chunk_attention_mask

    def flow_inference(tok, *args, streaming, finalize, **kw):
        calls.append((tok.shape[1], streaming, finalize))
        return real_flow(tok, *args, streaming=streaming, finalize=finalize, **kw)

    def mask(n, chunk, device):
        blocks.append(chunk)
        return real_mask(n, chunk, device)

    monkeypatch.setattr(t2w.flow, "inference", flow_inference)
    monkeypatch.setattr(dit, "chunk_attention_mask", mask)
    chunks = [c.samples.size for c in t2w.stream(iter(tokens), _prompt(n_prompt), 0)]
    monkeypatch.undo()
    return calls, blocks, chunks


# Prompt lengths with no pad (50), a pad of 10 (40) and of 12 (13); 260 tokens reach the 100-token cap.
@pytest.mark.parametrize("n_prompt,n_tokens", [(50, 88), (40, 260), (13, 140)])
def test_streaming_hops_ignore_the_yaml_chunk_size(chunk20, n_prompt, n_tokens, monkeypatch):
    calls, blocks, chunks = _run(chunk20, n_prompt, n_tokens, monkeypatch)
    want = reference_schedule(n_prompt, n_tokens)
    assert [(n, s, not s) for n, _, s in want] == calls, "flow calls differ from the reference's schedule"
    # Emitted samples: the vocoder of a streaming call holds back its last frames (as many as the recording's
    # streaming vocoder calls did), the final call gives the rest.
    hc = load_fixture("e2e_zero_shot_stream")[1]["meta"]["hift_calls"][0]
    held = hc["n_mel"] - hc["n_out"] // MEL_SAMPLES
    ends = [MEL_SAMPLES * (2 * (n - 3 if s else n) - (held if s else 0)) for n, _, s in want]
    assert chunks == [b - a for a, b in zip([0] + ends, ends)], "chunk sizes differ from the reference's schedule"
    # The DiT's block-causal mask does follow the yaml: 20 tokens * 2 = 40 frames, in every streaming call.
    assert blocks and set(blocks) == {40}


def test_schedule_rule_matches_the_recording():
    """:func:`reference_schedule` itself reproduces every recorded streaming run's token2wav calls."""
    for case in ("zero_shot_stream", "cross_lingual_stream", "instruct2_stream"):
        a, meta = load_fixture(f"e2e_{case}")
        recorded = [(c["n_tokens"], c["token_offset"], c["stream"]) for c in meta["meta"]["token2wav_calls"]]
        assert reference_schedule(a["in_flow_prompt_speech_token"].shape[1], a["flow_tokens"].shape[1]) == recorded


def test_the_wrapper_reads_lookahead_and_mel_ratio_from_the_flow(tmp_path):
    """The reference's wrapper reads ``flow.pre_lookahead_len`` and ``flow.token_mel_ratio`` (yaml values),
    so a yaml look-ahead of 2 changes the look-ahead; the hop stays 25."""
    d = _model_with_yaml(tmp_path, "    pre_lookahead_len: 3\n    pre_lookahead_layer",
                         "    pre_lookahead_len: 2\n    pre_lookahead_layer")
    y = d / "cosyvoice3.yaml"
    y.write_text(y.read_text().replace("        pre_lookahead_len: 3", "        pre_lookahead_len: 2"))
    cfg = load_config(d)
    stage = SimpleNamespace(cfg=cfg.flow)  # the checkpoints are shaped for 3: only the values are read here
    t2w = Token2Wav.from_config(cfg, stage, stage)
    assert (t2w.lookahead, t2w.token_mel_ratio, t2w.token_hop) == (2, 2, 25)


@pytest.mark.parametrize("old,new,what", [
    ("        pre_lookahead_len: 3", "        pre_lookahead_len: 4", "pre_lookahead_layer.pre_lookahead_len"),
    ("token_mel_ratio: 2", "token_mel_ratio: 3", "token_mel_ratio 3"),
    ("sample_rate: 24000", "sample_rate: 22050", "sample_rate 22050"),
])
def test_yaml_values_the_reference_would_mismatch_are_refused(tmp_path, old, new, what):
    """Where the reference would combine a yaml value with a constant of its code (the frontend's 2:1 prompt
    trim at 24 kHz, the wrapper's look-ahead against the look-ahead layer's), the model is refused by name."""
    d = _model_with_yaml(tmp_path, old, new)
    with pytest.raises(ModelDirError, match=what.split()[0]):
        load_config(d)
