"""Per-request streaming cache of the flow (FlowStreamCache): cached streaming calls give the mel
of recomputing everything, within float rounding, and an unusable cache is never used.

Tolerances: a cached call takes earlier blocks' K/V from an earlier call, where the reference
recomputes them with attention over more (masked) keys, which rounds differently: ~3e-6 at fp32 on
mels of magnitude ~10, ~2e-3 at bf16 (its own rounding). A wrong cache (wrong frames, positions or
conv context) is off by 0.1-10: see test_a_corrupted_cache_is_visible. The audio is not compared
tightly: the tiny random fixture vocoder turns a 1e-6 mel change into ~1e-2 of audio (and bf16
differences into sign flips), so the tests compare the mel the engine feeds the vocoder.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyllama.engine import FlowPrompt, Token2Wav
from cosyllama.errors import InputError
from cosyllama.flow import DEFAULT_STREAM_CACHE_MB, Flow, FlowStreamCache
from cosyllama.vocoder import HiFT
from helpers import FIXTURES, MODEL_DIR, interleave_chunks, load_fixture, recorded_flow_calls

TOL = {"fp32": 2e-5, "bf16": 1e-2}
STREAM_CASES = ["cross_lingual_stream", "instruct2_stream", "zero_shot_stream"]
N_TOKENS = 300  # with the 50-token fixture prompt: non-final calls of 28, 78, 178, 278 tokens


@pytest.fixture(scope="module")
def flows():
    return {p: Flow.from_dir(MODEL_DIR, precision=p) for p in ("fp32", "bf16")}


@pytest.fixture(scope="module")
def hift():
    return HiFT.from_dir(MODEL_DIR)


def _prompt(case="zero_shot_stream") -> FlowPrompt:
    a, _ = load_fixture(f"e2e_{case}")
    return FlowPrompt(*(torch.from_numpy(a[k]) for k in
                        ("in_flow_prompt_speech_token", "in_prompt_speech_feat", "in_flow_embedding")))


def _tokens(n=N_TOKENS, seed=1) -> torch.Tensor:
    return torch.randint(0, 6561, (1, n), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def _schedule(n_tokens: int, p: int = 50) -> list[int]:
    """Token counts of the engine's non-final streaming calls (hop 25 + pad, 50, 100, ...; +3 look-ahead)."""
    ends, off, hop, pad = [], 0, 25, -p % 25
    while n_tokens - off >= hop + (pad if off == 0 else 0) + 3:
        h = hop + (pad if off == 0 else 0)
        ends.append(off + h + 3)
        off, hop = off + h, min(100, 2 * hop)
    return ends


def _diff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.double() - b.double()).abs().max())


def _call(flow, tok, fp, n, cache=None):
    return flow.inference(tok[:, :n], fp.tokens, fp.feat, fp.embedding, streaming=True, finalize=False,
                          cache=cache)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cached_calls_equal_recomputing(flows, precision):
    flow, fp, tok = flows[precision], _prompt(), _tokens()
    cache = FlowStreamCache()
    ends = _schedule(N_TOKENS)
    assert ends == [28, 78, 178, 278]
    starts = []
    for n in ends:
        ref = _call(flow, tok, fp, n)
        got = _call(flow, tok, fp, n, cache)
        assert got.dtype == torch.float32
        assert _diff(got, ref) <= TOL[precision], (precision, n)
        starts.append(cache.last_start)
        assert cache.frames == 2 * (50 + n - 3)  # every block of the call kept (a multiple of 50)
    # Each call resumed after the previous call's frames: only the new ones were computed.
    assert starts == [0, 150, 250, 450]
    assert cache.rebuilds == 0 and cache.calls == 4
    assert cache.computed_frames == 2 * (50 + ends[-1] - 3)


def test_first_cached_call_is_the_reference_computation(flows):
    """At fp32 a call with nothing to reuse runs the reference ops (bit-equal on this CPU)."""
    flow, fp, tok = flows["fp32"], _prompt(), _tokens()
    ref, got = _call(flow, tok, fp, 78), _call(flow, tok, fp, 78, FlowStreamCache())
    assert _diff(got, ref) <= 1e-6


@pytest.mark.parametrize("case", STREAM_CASES)
def test_cached_calls_match_the_recorded_upstream_calls(flows, case):
    """Every streaming flow call of the recorded end-to-end runs, made through one cache."""
    cache = FlowStreamCache()
    for k, _, mel, want in recorded_flow_calls(flows["fp32"], case, cache=cache):
        assert _diff(mel, torch.from_numpy(want)) <= TOL["fp32"], (case, k)
    assert cache.rebuilds == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_corrupted_cache_is_visible(flows, precision):
    """The cached K/V and conv context really are read: disturbing them changes the next call far
    beyond the tolerance (so the equality tests above can fail)."""
    flow, fp, tok = flows[precision], _prompt(), _tokens()
    ref = _call(flow, tok, fp, 178)

    def corrupted(edit):
        cache = FlowStreamCache()
        _call(flow, tok, fp, 78, cache)
        edit(cache)
        return _diff(_call(flow, tok, fp, 178, cache), ref)

    def flip_k(cache, slots=None):  # the cached frames' keys in reverse order
        for key in slots or list(cache.kv):
            k, v = cache.kv[key]
            cache.kv[key] = (k.flip(1), v)

    def zero_conv(cache):
        for s in cache.conv:
            cache.conv[s] = torch.zeros_like(cache.conv[s])

    assert corrupted(flip_k) > 0.1  # observed 0.25
    assert corrupted(zero_conv) > 0.5  # observed 1.2
    if precision == "fp32":  # one step's one block is enough to exceed the fp32 tolerance 1000-fold
        assert corrupted(lambda c: flip_k(c, [(5, 1)])) > 1000 * TOL["fp32"]  # observed 0.046


def _changed(fp: FlowPrompt, what: str) -> tuple[FlowPrompt, torch.Tensor]:
    tok = _tokens()
    if what == "tokens":  # an earlier token differs: the new call does not extend the cached one
        tok = tok.clone()
        tok[0, 10] = (tok[0, 10] + 1) % 6561
    elif what == "lookahead_token":  # the last look-ahead token of the cached 78-token call differs
        tok = tok.clone()
        tok[0, 77] = (tok[0, 77] + 1) % 6561
    elif what == "prompt_feat":
        fp = FlowPrompt(fp.tokens, fp.feat + 0.5, fp.embedding)
    elif what == "embedding":
        fp = FlowPrompt(fp.tokens, fp.feat, fp.embedding.flip(1))
    elif what == "prompt_tokens":
        fp = FlowPrompt(fp.tokens.flip(1), fp.feat, fp.embedding)
    return fp, tok


@pytest.mark.parametrize("what", ["tokens", "lookahead_token", "prompt_feat", "embedding", "prompt_tokens",
                                  "shorter", "weights", "steps"])
def test_an_inconsistent_cache_is_rebuilt(what, hift):
    flow = Flow.from_dir(MODEL_DIR)
    fp, tok = _prompt(), _tokens()
    cache = FlowStreamCache()
    _call(flow, tok, fp, 78, cache)
    assert cache.frames == 250
    n = 178
    if what == "shorter":  # fewer tokens than the cached call: not an extension
        n = 53
    elif what == "weights":
        sd = {k: v.clone() for k, v in flow.state_dict().items()}
        sd["decoder.estimator.transformer_blocks.0.ff.ff.2.bias"] += 1.0
        flow.load_state_dict(sd)
    elif what == "steps":
        flow.set_n_timesteps(5)
    else:
        fp, tok = _changed(fp, what)
    got = _call(flow, tok, fp, n, cache)
    ref = _call(flow, tok, fp, n)
    assert cache.rebuilds == 1 and cache.last_start == 0
    assert _diff(got, ref) <= 1e-6  # recomputed from scratch (the reference ops)
    # ... and the rebuilt cache serves the next call of the new inputs.
    got = _call(flow, tok, fp, 278, cache)
    assert cache.last_start == 2 * (50 + n - 3) and cache.rebuilds == 1
    assert _diff(got, _call(flow, tok, fp, 278)) <= TOL["fp32"]


def test_other_calls_leave_the_cache_alone(flows):
    flow, fp, tok = flows["fp32"], _prompt(), _tokens()
    cache = FlowStreamCache()
    _call(flow, tok, fp, 78, cache)
    before = (cache.frames, cache.calls, {k: v[0].clone() for k, v in cache.kv.items()})
    for streaming, finalize in ((False, True), (True, True)):
        out = flow.inference(tok[:, :100], fp.tokens, fp.feat, fp.embedding, streaming=streaming,
                             finalize=finalize, cache=cache)
        assert torch.equal(out, flow.inference(tok[:, :100], fp.tokens, fp.feat, fp.embedding,
                                               streaming=streaming, finalize=finalize))
    assert (cache.frames, cache.calls) == before[:2]
    assert all(torch.equal(cache.kv[k][0], v) for k, v in before[2].items())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_memory_bound_keeps_a_prefix_and_recomputes_the_rest(flows, precision):
    flow, fp, tok = flows[precision], _prompt(), _tokens()
    per_frame = flow.decoder.kv_bytes_per_frame()
    # tiny model: 10 steps x 2 blocks x 2 (K, V) x 2 rows x 64 channels x 4 (fp32) / 2 (bf16) bytes
    assert per_frame == 10 * 2 * 2 * 2 * 64 * (4 if precision == "fp32" else 2)
    bound_mb = 230 * per_frame / 2**20  # room for 230 frames: 200 kept (whole blocks)
    cache = FlowStreamCache(max_mb=bound_mb)
    starts = []
    for n in _schedule(N_TOKENS):
        got = _call(flow, tok, fp, n, cache)
        assert _diff(got, _call(flow, tok, fp, n)) <= TOL[precision], n
        kv_bytes = sum(t.numel() * t.element_size() for kv in cache.kv.values() for t in kv)
        assert kv_bytes <= bound_mb * 2**20
        starts.append(cache.last_start)
    assert starts == [0, 150, 200, 200]  # past the bound: the 200-frame prefix, the rest recomputed
    assert cache.frames == 200 and cache.rebuilds == 0
    # max_frames bounds the same way
    cache = FlowStreamCache(max_frames=120)
    for n in _schedule(N_TOKENS)[:3]:
        assert _diff(_call(flow, tok, fp, n, cache), _call(flow, tok, fp, n)) <= TOL[precision]
    assert cache.frames == 100 and cache.last_start == 100


def test_a_bound_below_one_block_disables_caching(flows):
    flow, fp, tok = flows["fp32"], _prompt(), _tokens()
    for cache in (FlowStreamCache(max_mb=0), FlowStreamCache(max_frames=49)):
        for n in _schedule(N_TOKENS)[:2]:
            assert torch.equal(_call(flow, tok, fp, n, cache), _call(flow, tok, fp, n))  # the plain path
        assert cache.frames == 0 and cache.calls == 0 and cache.nbytes == 0
    with pytest.raises(InputError, match=">= 0"):
        FlowStreamCache(max_mb=-1)


# ----------------------------------------------------------------------------------------------
# Through the engine


class _FlowSpy:
    """Delegates to a Flow; records (first tokens, cache, cached frames at the call, finalize) per call."""

    def __init__(self, flow):
        self.flow, self.calls = flow, []

    def __getattr__(self, name):
        return getattr(self.flow, name)

    def inference(self, token, prompt_token, prompt_feat, embedding, cache=None, **kw):
        self.calls.append((token[0, :8].clone(), cache, None if cache is None else cache.frames, kw["finalize"]))
        return self.flow.inference(token, prompt_token, prompt_feat, embedding, cache=cache, **kw)


class _VocoderSpy:
    """Delegates to a HiFT; keeps all mel of the utterance it was given (streamed chunk by chunk)."""

    def __init__(self, hift):
        self.hift, self.mel = hift, None

    def new_stream(self):
        self.mel = None
        return self.hift.new_stream()

    def stream_step(self, state, mel, finalize):
        self.mel = mel.clone() if self.mel is None else torch.cat([self.mel, mel], dim=2)
        return self.hift.stream_step(state, mel, finalize)


def _prompt_call(head: torch.Tensor) -> bool:
    """A spied call is a prompt's frames solved alone (``Token2Wav._prompt_entry``: zero stand-in tokens that fill
    the prompt's last block, at least one, and 3 of look-ahead)."""
    return head.numel() >= 4 and not bool(head.any())


def _stream(flow, hift, mb, tokens, fp):
    voc = _VocoderSpy(hift)
    spy = _FlowSpy(flow)
    chunks = list(Token2Wav(spy, voc, 24000, stream_cache_mb=mb).stream(iter(tokens), fp, 0))
    return chunks, voc.mel, spy


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_engine_stream_with_cache_equals_without(flows, hift, precision):
    fp, tokens = _prompt(), _tokens()[0].tolist()
    plain, mel0, spy0 = _stream(flows[precision], hift, 0, tokens, fp)
    cached, mel1, spy1 = _stream(flows[precision], hift, 2048, tokens, fp)
    assert all(c[1] is None for c in spy0.calls)
    # The prompt's shared block in a call of its own (see the next section), then the request's calls.
    caches = [c[1] for c in spy1.calls if c[1] is not None]
    assert len({id(c) for c in caches}) == 2 and spy1.calls[0][1] is caches[0]
    cache = caches[-1]
    assert cache.reused_frames == 50 + 150 + 250 + 450 and cache.rebuilds == 0
    assert [c.samples.size for c in cached] == [c.samples.size for c in plain]
    assert [c.is_final for c in cached] == [c.is_final for c in plain]
    # The mel the vocoder got last (all chunks): earlier chunks from cached calls.
    assert mel1.shape == mel0.shape == (1, 80, 2 * len(tokens))
    assert _diff(mel1, mel0) <= TOL[precision]
    # The final call (full attention) is never given the cache, which is freed before it.
    assert spy1.calls[-1][3] is True and spy1.calls[-1][1] is None
    assert cache.nbytes == 0 and cache.frames == 0


def test_engine_cache_default_follows_the_precision(flows, hift):
    assert Token2Wav(flows["fp32"], hift, 24000).new_stream_cache() is None  # reference parity
    c = Token2Wav(flows["bf16"], hift, 24000).new_stream_cache()
    assert isinstance(c, FlowStreamCache) and c.max_mb == DEFAULT_STREAM_CACHE_MB
    assert Token2Wav(flows["fp32"], hift, 24000, stream_cache_mb=64).new_stream_cache().max_mb == 64
    assert Token2Wav(flows["bf16"], hift, 24000, stream_cache_mb=0).new_stream_cache() is None
    with pytest.raises(InputError, match="stream_cache_mb"):
        Token2Wav(flows["fp32"], hift, 24000, stream_cache_mb=-1)


def test_interleaved_requests_have_their_own_caches(flows, hift):
    flow = flows["bf16"]
    fa, fb = _prompt("zero_shot_stream"), _prompt("instruct2_stream")
    ta, tb = _tokens(seed=1)[0].tolist(), _tokens(seed=2)[0].tolist()
    alone = {k: [c.samples for c in Token2Wav(flow, hift, 24000, stream_cache_mb=2048).stream(iter(t), f, 0)]
             for k, t, f in (("a", ta, fa), ("b", tb, fb))}
    spy = _FlowSpy(flow)
    t2w = Token2Wav(spy, hift, 24000, stream_cache_mb=2048)
    gens = {"a": t2w.stream(iter(ta), fa, 0), "b": t2w.stream(iter(tb), fb, 0)}
    got = interleave_chunks(gens)  # alternate one chunk at a time
    for k in "ab":
        assert len(got[k]) == len(alone[k])
        for g, w in zip(got[k], alone[k]):
            np.testing.assert_array_equal(g, w)
    used = [(head, cache) for head, cache, _, _ in spy.calls if cache is not None and not _prompt_call(head)]
    caches = {id(c): c for _, c in used}
    assert len(caches) == 2  # one per request (besides each prompt's call of its own)
    for c in caches.values():  # each saw one request's tokens only, reused its frames, never rebuilt
        heads = [h for h, cc in used if cc is c]
        assert all(torch.equal(h, heads[0]) for h in heads)
        assert c.rebuilds == 0 and c.reused_frames > 0 and c.nbytes == 0


def test_closing_a_stream_frees_its_cache(flows, hift):
    spy = _FlowSpy(flows["bf16"])
    gen = Token2Wav(spy, hift, 24000).stream(iter(_tokens()[0].tolist()), _prompt(), 0)
    next(gen)
    next(gen)
    cache = spy.calls[-1][1]
    assert cache is not None and cache.frames == 250 and cache.nbytes > 0
    gen.close()
    assert cache.frames == 0 and cache.nbytes == 0 and cache.mel is None


def test_tts_passes_the_cache_bound_to_its_engine():
    import cosyllama

    assert cosyllama.load(MODEL_DIR, precision="bf16").token2wav.new_stream_cache().max_mb == DEFAULT_STREAM_CACHE_MB
    assert cosyllama.load(MODEL_DIR, precision="bf16", stream_cache_mb=0).token2wav.new_stream_cache() is None
    assert cosyllama.load(MODEL_DIR, precision="fp32", stream_cache_mb=64).token2wav.new_stream_cache().max_mb == 64
    with pytest.raises(InputError):
        cosyllama.load(MODEL_DIR, stream_cache_mb=-1)


# ----------------------------------------------------------------------------------------------
# Frames shared between requests of one prompt


def _streams(t2w, runs):
    """Stream each (tokens, prompt) in turn through one engine; the vocoder-side mel of each."""
    out = []
    for tokens, fp in runs:
        voc = _VocoderSpy(t2w.hift)
        t2w.hift = voc
        try:
            chunks = list(t2w.stream(iter(tokens), fp, 0))
        finally:
            t2w.hift = voc.hift
        out.append((chunks, voc.mel))
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_requests_with_one_prompt_share_its_blocks(flows, hift, precision):
    fp, ta, tb = _prompt(), _tokens(seed=1)[0].tolist(), _tokens(seed=2)[0].tolist()
    spy = _FlowSpy(flows[precision])
    t2w = Token2Wav(spy, hift, 24000, stream_cache_mb=2048, prompt_cache_mb=512)
    assert t2w.shared_prompt_frames(50) == 50  # 2 * (50 - 3) = 94 -> one whole 50-frame block
    (_, _), (chunks_b, mel_b) = _streams(t2w, [(ta, fp), (tb, fp)])
    firsts = [c for c in spy.calls if c[1] is not None and torch.equal(c[0], torch.tensor(ta[:8]))][:1]
    firsts += [c for c in spy.calls if c[1] is not None and torch.equal(c[0], torch.tensor(tb[:8]))][:1]
    assert [frames for _, _, frames, _ in firsts] == [50, 50]  # both first chunks started after the shared block
    prompt_calls = [c for c in spy.calls if torch.equal(c[0], torch.zeros(4, dtype=c[0].dtype))]
    assert len(prompt_calls) == 1  # solved once, in a call of its own, before A's first chunk
    info = t2w.prompt_cache_info()
    assert info["prompts"] == 1 and 0 < info["bytes"] <= 512 * 2**20
    # B equals B on an engine that shares nothing, up to the rounding the cache is allowed.
    alone_chunks, alone_mel = _streams(Token2Wav(flows[precision], hift, 24000, stream_cache_mb=2048,
                                                 prompt_cache_mb=0), [(tb, fp)])[0]
    assert [c.samples.size for c in chunks_b] == [c.samples.size for c in alone_chunks]
    assert _diff(mel_b, alone_mel) <= TOL[precision]


def test_other_prompts_and_voices_do_not_reuse_the_blocks(flows, hift):
    fp, tok = _prompt(), _tokens()[0].tolist()
    other_voice = FlowPrompt(fp.tokens, fp.feat, fp.embedding + 0.5)
    spy = _FlowSpy(flows["bf16"])
    t2w = Token2Wav(spy, hift, 24000)  # defaults: both caches on at bf16
    _streams(t2w, [(tok, fp), (tok, _prompt("instruct2_stream")), (tok, other_voice), (tok, fp)])
    calls = [(frames, cache, _prompt_call(head)) for head, cache, frames, _ in spy.calls if cache is not None]
    first_of_each = []
    for frames, cache, alone in calls:
        if not first_of_each or first_of_each[-1][1] is not cache:
            first_of_each.append((frames, cache, alone))
    # each new prompt or voice has its block solved alone, then its request starts after it; only the same
    # prompt and voice again reuses the kept block
    assert [(f, alone) for f, _, alone in first_of_each] == [(0, True), (50, False), (0, True), (100, False),
                                                              (0, True), (50, False), (50, False)]
    assert t2w.prompt_cache_info()["prompts"] == 3


def test_the_prompt_cache_bound_and_its_default(flows, hift):
    fa, tok = _prompt(), _tokens()[0].tolist()
    fb = FlowPrompt(fa.tokens, fa.feat, fa.embedding + 0.5)  # another voice, same size of shared frames
    assert Token2Wav(flows["fp32"], hift, 24000)._prompt_cache_bytes() == 0  # off with the stream cache
    assert Token2Wav(flows["bf16"], hift, 24000)._prompt_cache_bytes() == 512 * 2**20
    assert Token2Wav(flows["bf16"], hift, 24000, prompt_cache_mb=0)._prompt_cache_bytes() == 0
    with pytest.raises(InputError, match="prompt_cache_mb"):
        Token2Wav(flows["bf16"], hift, 24000, prompt_cache_mb=-1)
    tiny = Token2Wav(flows["bf16"], hift, 24000, prompt_cache_mb=1e-3)  # below one prompt's blocks
    _streams(tiny, [(tok, fa)])
    assert tiny.prompt_cache_info() == {"prompts": 0, "bytes": 0}
    one = Token2Wav(flows["bf16"], hift, 24000)
    _streams(one, [(tok, fa)])
    size = one.prompt_cache_info()["bytes"]
    one.prompt_cache_mb = 1.5 * size / 2**20  # room for one prompt: the newer one stays
    _streams(one, [(tok, fb)])
    assert one.prompt_cache_info() == {"prompts": 1, "bytes": size}
    assert one._prompt_frames_for(one._prompt_key(fb)) is not None
    assert one._prompt_frames_for(one._prompt_key(fa)) is None
    one.clear_prompt_cache()
    assert one.prompt_cache_info() == {"prompts": 0, "bytes": 0}


def test_a_prefix_short_of_the_cache_needs_its_conv_context(flows):
    flow, fp, tok = flows["bf16"], _prompt(), _tokens()
    cache = FlowStreamCache()
    _call(flow, tok, fp, 78, cache)  # keeps 250 frames
    assert cache.frames == 250 and cache.prefix(50, 50) is None  # no context kept at frame 50
    assert cache.prefix(50).frames == 250 and cache.prefix(10_000) is None
    marked = FlowStreamCache()
    marked.mark_prefix(50)
    _call(flow, tok, fp, 78, marked)
    part = marked.prefix(50, 50)
    assert part.frames == 50 and part.mel.shape[2] == 50
    assert all(k.shape[1] == 50 and v.shape[1] == 50 for k, v in part.kv.values())
    # It resumes a call with other tokens after the prompt: same mel as recomputing.
    other = _tokens(seed=7)
    fresh = FlowStreamCache()
    fresh.load(part)
    got = _call(flow, other, fp, 78, fresh)
    assert fresh.last_start == 50 and fresh.rebuilds == 0
    assert _diff(got, _call(flow, other, fp, 78)) <= TOL["bf16"]


def test_a_warmed_voice_shares_its_blocks_from_its_first_request(flows, hift):
    fp, tok = _prompt(), _tokens()[0].tolist()
    spy = _FlowSpy(flows["bf16"])
    t2w = Token2Wav(spy, hift, 24000)
    assert t2w.warm_prompt(fp) and t2w.prompt_cache_info()["prompts"] == 1
    assert t2w.warm_prompt(fp)  # already kept: nothing solved again
    n_warm = len(spy.calls)
    assert n_warm == 1
    (chunks, mel), = _streams(t2w, [(tok, fp)])
    first = next(frames for _, cache, frames, _ in spy.calls[n_warm:] if cache is not None)
    assert first == 50  # the very first request already started after the shared block
    alone_chunks, alone_mel = _streams(Token2Wav(flows["bf16"], hift, 24000, prompt_cache_mb=0), [(tok, fp)])[0]
    assert [c.samples.size for c in chunks] == [c.samples.size for c in alone_chunks]
    assert _diff(mel, alone_mel) <= TOL["bf16"]
    # Nothing to warm with the caches off, or with a prompt too short to share a whole block.
    assert not Token2Wav(flows["fp32"], hift, 24000).warm_prompt(fp)
    short = FlowPrompt(fp.tokens[:, :20], fp.feat[:, :40], fp.embedding)
    assert not Token2Wav(flows["bf16"], hift, 24000).warm_prompt(short)


def test_tts_warm_voice_by_id():
    import cosyllama

    tts = cosyllama.load(MODEL_DIR, precision="bf16")
    voice = tts.add_voice("v", FIXTURES / load_fixture("e2e_zero_shot_stream")[1]["meta"]["call"]["prompt_wav"])
    assert tts.warm_voice("v") and tts.token2wav.prompt_cache_info()["prompts"] == 1
    assert tts.warm_voice(voice)  # the same voice object: already kept
    assert tts.token2wav.prompt_cache_info()["prompts"] == 1
    # A streaming request with the voice finds what was warmed (a different key would add an entry).
    spy = _FlowSpy(tts.token2wav.flow)
    tts.token2wav.flow = spy
    try:
        tts.cross_lingual("Hello there, this is a test.", voice="v", stream=True, greedy=True).audio()
    finally:
        tts.token2wav.flow = spy.flow
    assert tts.token2wav.prompt_cache_info()["prompts"] == 1
    assert next(frames for _, cache, frames, _ in spy.calls if cache is not None) > 0


def test_static_int8_cached_calls_equal_recomputing(monkeypatch, tmp_path):
    """With static activation scales no frame's quantization depends on the others (the dynamic path's
    per-call scale does), so cached streaming calls stay within bf16's tolerance of recomputing."""
    from cosyllama import precision as prec
    from cosyllama.flow import check, fast_dit
    from cosyllama.precision import INT8

    # bf16 and VNNI counted present: cache and recomputation run the same products, whatever they compute here
    # (without VNNI their int16 pair sums saturate: cosyllama.cpu.has_vnni)
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(prec, "cpu_has_int8_vnni", lambda: True)
    if fast_dit.int8_engine_problem(fast_dit.STATIC_ENGINE, on_cpu=False):
        pytest.skip(fast_dit.int8_engine_problem(fast_dit.STATIC_ENGINE, on_cpu=False))
    monkeypatch.setenv("COSYLLAMA_CACHE", str(tmp_path))
    flow = Flow.from_dir(MODEL_DIR)
    check.Candidate(INT8, fast_dit.STATIC_ENGINE).apply(flow)
    fp, tok, cache = _prompt(), _tokens(), FlowStreamCache()
    for n in _schedule(N_TOKENS):
        assert _diff(_call(flow, tok, fp, n, cache), _call(flow, tok, fp, n)) <= TOL["bf16"], n
    assert cache.calls == 4 and cache.last_start == 450


def _pcm(chunks) -> bytes:
    return b"".join((np.clip(c.samples, -1, 1) * 32767).astype("<i2").tobytes() for c in chunks)


def test_a_streams_audio_does_not_depend_on_what_the_prompt_cache_held(hift):
    """int8 with dynamic activation scales: one scale per product call, from all of the call's rows, so
    the shared block solved together with a request's first tokens would differ in its last bits from the
    block solved alone. A request's audio is the same bytes whether the block was kept by an earlier
    request, warmed, evicted or never kept (the prompt cache off), as every door's request must be."""
    flow = Flow.from_dir(MODEL_DIR, precision="int8")
    # 100 tokens: two cached chunks (28 and 78 tokens) and the final call; short enough for the QEMU pass
    fp, ta, tb = _prompt(), _tokens(100, seed=1)[0].tolist(), _tokens(100, seed=2)[0].tolist()

    def stream(t2w, tokens):
        return _pcm(t2w.stream(iter(tokens), fp, 0))

    t2w = Token2Wav(flow, hift, 24000)  # both caches on by default at int8
    cold = stream(t2w, tb)  # B first: the block is solved for it
    assert t2w.prompt_cache_info()["prompts"] == 1
    stream(t2w, ta)
    assert stream(t2w, tb) == cold  # B again, from the kept block
    t2w.clear_prompt_cache()  # evicted
    assert stream(t2w, tb) == cold
    warmed = Token2Wav(flow, hift, 24000)
    assert warmed.warm_prompt(fp) and stream(warmed, tb) == cold
    assert stream(Token2Wav(flow, hift, 24000, prompt_cache_mb=0), tb) == cold
