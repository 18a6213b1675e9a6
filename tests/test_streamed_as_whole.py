"""A text streamed sentence by sentence (the WebSocket's ``input.text``, Wyoming's ``synthesize-chunk``) is
spoken as the same text sent whole when the whole text splits at the same places: the reference keeps a
segment's leading spaces (docs/reference.md#segment-splitting), so a streamed sentence after the first carries
the whitespace that stood before it (:class:`~cosyllama.server.sentences.SentenceStream`'s ``leads``), put back
by the frontend as the whole text's segmentation keeps it (:func:`cosyllama.frontend.continued_lead`)."""

from __future__ import annotations

import pytest

from cosyllama.frontend import continued_lead
from cosyllama.limits import RequestLimits
from cosyllama.server.sentences import SentenceStream
from server_helpers import tiny_tts

A = ("The old lighthouse keeper climbed the long winding stairs every single evening before the sun went down "
     "over the grey and restless sea.")
B = ("He checked the great lamp, wiped the salty glass until it shone, and wrote the wind and the weather in a "
     "small leather book he kept.")
ZA = ("老灯塔看守人每天傍晚太阳落山之前都会爬上那段又长又弯的楼梯，去看一看灯，擦一擦玻璃，"
      "再把风和天气写进他那本小小的皮面本子里，日复一日从不间断。")
ZB = ("冬天的时候风暴很大，海浪拍打着塔下的岩石，声音震耳欲聋，可是他一点也不在意，"
      "因为他知道只要灯还亮着，所有出海的人就都能平安回家，这就是他的工作。")
# spaces and line breaks: what texts put between sentences (tabs and no-break spaces there are kept or dropped
# by wetext's grammars case by case; the promise does not cover them, docs/server.md)
SEPARATORS = (" ", "  ", "\n", " \n", "\r\n", "\n\n")


@pytest.fixture(scope="module")
def frontend():
    return tiny_tts().frontend


def _streamed(text: str, pieces: int = 7) -> tuple[list[str], list[str]]:
    """``text`` fed to a SentenceStream in ``pieces`` pieces: its sentences and the lead of each."""
    stream = SentenceStream(RequestLimits())
    sentences, leads = [], []
    step = max(1, len(text) // pieces)
    for i in range(0, len(text), step):
        sentences += stream.add(text[i:i + step])
        leads += stream.leads
    sentences += stream.finish()
    leads += stream.leads
    return sentences, leads


def test_a_sentence_stream_keeps_the_whitespace_before_each_sentence():
    assert _streamed("One. Two!  Three?\nFour") == (["One.", "Two!", "Three?", "Four"], ["", " ", "  ", "\n"])
    # the whitespace of a slice that said nothing (a lone line break) goes to the next sentence
    assert _streamed("One.\n\n Two. ... Three")[1] == ["", "\n\n ", " "]
    assert _streamed("  Lead. Next")[1] == ["  ", " "]  # the session drops a first sentence's lead


@pytest.mark.parametrize("sep", SEPARATORS)
@pytest.mark.parametrize("a, b", [(A, B), (ZA, ZB)], ids=["en", "zh"])
def test_each_streamed_sentence_is_the_whole_texts_segment(frontend, a, b, sep):
    whole = frontend.normalize_and_split(a + sep + b)
    assert len(whole) == 2, whole  # the whole text splits where the stream does
    sentences, leads = _streamed(a + sep + b)
    assert len(sentences) == 2
    streamed = [s for text, lead in zip(sentences, ["", leads[1]])
                for s, _ in frontend._segments(text, True, True, None, None, lead)]
    assert streamed == whole, (sep, streamed, whole)


def test_without_the_lead_a_space_separated_sentence_differs():
    """The case the lead is for: without it the second segment loses the space the whole text keeps."""
    assert continued_lead(" ", B) == " " and continued_lead("\n", B) == "" and continued_lead(" ", ZB) == ""
    assert continued_lead("\n\n", B) == " " and continued_lead("\r\n\r\n", B) == " "  # paragraphs: joined by a space
    assert continued_lead(" ", "<|endofprompt|>" + B) == ""


def test_cross_lingual_and_zero_shot_inputs_match_too(frontend):
    from server_helpers import PROMPT_TEXT, PROMPT_WAV

    voice = frontend.make_voice(PROMPT_WAV, PROMPT_TEXT)
    for mode in (frontend.cross_lingual, frontend.zero_shot):
        whole = mode(A + " " + B, voice)
        parts = mode(A, voice) + mode(B, voice, lead=" ")
        assert [i.text for i in parts] == [i.text for i in whole] and len(whole) == 2
        assert mode(B, voice)[0].text != whole[1].text  # without the lead it is not the same input
