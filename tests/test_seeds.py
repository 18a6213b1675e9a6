"""The seed rule (:mod:`cosyllama.seeds`): one function gives a request's parts their seeds, for the pipeline's
text segments, a streamed session's sentences, a dialogue's turns and a retried take alike, wrapped into the seed
range, so a text streamed sentence by sentence and the same text sent whole get the same seeds at the top of the
range too (issue #53)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from cosyllama.dialogue import turn_seed
from cosyllama.limits import RequestLimits
from cosyllama.llm.takes import retry_seed
from cosyllama.request import SEED_RANGE, SynthesisOptions, SynthesisRequest
from cosyllama.seeds import offset_seed
from cosyllama.server.session import Sentence, Session, Template
from cosyllama.tts import TTS

TOP = SEED_RANGE[1]  # 2**31 - 1


def test_offset_seed_wraps_into_the_seed_range():
    assert offset_seed(None, 3) is None  # fresh entropy stays fresh
    assert offset_seed(5, 0) == 5 and offset_seed(5, 2) == 7
    assert offset_seed(TOP, 1) == 0 and offset_seed(TOP, 2) == 1
    assert all(SEED_RANGE[0] <= offset_seed(TOP, k) <= TOP for k in (0, 1, 1000, 2**20, 2**40))


class _Recorder:
    """A token source that records each decode's seed and makes no tokens."""

    def __init__(self):
        self.seeds = []

    def generate(self, prefill, n_text_tokens, options, cancel=None):
        self.seeds.append(options.seed)
        return iter(())


def _pipeline_seeds(seed: int, n: int) -> list[int]:
    """The seeds the pipeline decodes segments 0 .. n-1 of one request with: each segment's first take
    (``TTS._take``) and its plain token path (``TTS.segment_tokens``) both."""
    source = _Recorder()
    tts = SimpleNamespace(token_source=source)
    inp = SimpleNamespace(mode="zero_shot", llm_text_ids=torch.zeros(1, 3, dtype=torch.int32), text_ids=[1, 2, 3],
                          llm_prompt_speech_tokens=torch.tensor([1, 2]))
    opts = SynthesisOptions(seed=seed)
    for i in range(n):
        TTS._take(tts, inp, opts, i, 0)
        list(TTS.segment_tokens(tts, inp, opts, i))
    takes, plain = source.seeds[0::2], source.seeds[1::2]
    assert takes == plain, (takes, plain)
    return takes


def _session_seeds(seed: int, text: str) -> list[int]:
    """The seeds a streamed session gives the sentences of ``text``, sent in one piece."""

    async def go():
        serving = SimpleNamespace(limits=RequestLimits())
        session = Session(serving, door=None, idle_timeout=1.0)
        request = SynthesisRequest("stand-in", voice="anna", options=SynthesisOptions(seed=seed, stream=True))
        session.configure(Template(request))
        session.add_text(text)
        session.end_utterance()
        items = []
        while not session._work.empty():
            items.append(session._work.get_nowait())
        return [s.request.options.seed for s in items if isinstance(s, Sentence)]

    return asyncio.run(go())


def test_streamed_sentences_and_whole_segments_get_one_seed_at_the_top_of_the_range():
    text = "Hello there.\nHow are you today?\nFine, thanks."
    streamed = _session_seeds(TOP, text)
    assert streamed == [TOP, 0, 1]
    assert _pipeline_seeds(TOP, 3) == streamed
    assert _session_seeds(5, text) == _pipeline_seeds(5, 3) == [5, 6, 7]


def test_turns_and_retries_follow_the_one_rule():
    assert turn_seed(TOP, 1) == offset_seed(TOP, 1000) == 999
    assert retry_seed(TOP, 1, 1) == offset_seed(TOP, 1 + 2**20)
    assert retry_seed(TOP, 1, 0) == offset_seed(TOP, 1) == 0
