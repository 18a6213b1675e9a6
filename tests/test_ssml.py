"""The SSML subset parser (src/cosyllama/text/ssml.py): parts, mapping, refusals, bounds."""

from __future__ import annotations

import time

import pytest

from cosyllama.text.ssml import (
    MAX_DEPTH,
    Boundary,
    Break,
    Span,
    SsmlError,
    looks_like_ssml,
    parse_ssml,
)
from cosyllama.text.tokenizer import TextTokenizer
from helpers import MODEL_DIR


def speak(body: str) -> str:
    return f'<speak version="1.1" xmlns="http://www.w3.org/2001/10/synthesis" xml:lang="en-US">{body}</speak>'


def test_mapping():
    doc = parse_ssml(speak(
        '<p><s>Hello <emphasis>big</emphasis> world.</s><s>Now<break time="700ms"/>wait.</s></p>'
        '<voice name="anna"><prosody rate="x-slow">Slow <sub alias="World Wide Web">WWW</sub>.</prosody></voice>'
        '<phoneme alphabet="x-pinyin" ph="ji3">几</phoneme> <phoneme alphabet="x-arpabet" ph="T AH0 M EY1 T OW2">'
        'tomato</phoneme><break strength="strong"/><break time="2s"/><prosody rate="150%">q</prosody>'))
    assert doc.parts == (
        Span("Hello <strong>big</strong> world."), Boundary(), Span("Now"), Break(0.7), Span("wait."), Boundary(),
        Span("Slow World Wide Web.", "anna", 0.5), Span("{几|[j][ǐ]} {tomato|[T][AH0][M][EY1][T][OW2]}"),
        Break(0.75), Break(2.0), Span("q", None, 1.5))
    assert doc.warnings == () and doc.lang == "en-US"
    assert [p.kind for p in doc.parts][:4] == ["text", "boundary", "text", "break"]


def test_phonemes_reach_the_tokenizer_as_their_tokens():
    from cosyllama.frontend import Frontend
    from cosyllama.text.normalize import TextNormalizer

    tok = TextTokenizer(MODEL_DIR / "CosyVoice-BlankEN")
    fe = Frontend.__new__(Frontend)
    fe.tokenizer, fe.normalizer = tok, TextNormalizer(tok)
    doc = parse_ssml(speak('I ate 3 <phoneme alphabet="x-arpabet" ph="T AH0 M EY1 T OW2">tomatoes</phoneme>.'), tok)
    (seg,) = fe.normalize_and_split(doc.text())
    assert seg == "I ate three [T][AH0][M][EY1][T][OW2]."
    assert tok.encode(seg)[-7:-1] == [tok.token_to_id(t) for t in ("[T]", "[AH0]", "[M]", "[EY1]", "[T]", "[OW2]")]


def test_rates_and_breaks_are_bounded():
    doc = parse_ssml(speak('<prosody rate="fast"><prosody rate="+50%">a</prosody></prosody>'
                           '<prosody rate="900%">b</prosody><break time="30s"/><prosody rate="-10%">c</prosody>'))
    assert doc.parts == (Span("a", None, 2.25), Span("b", None, 4.0), Break(10.0), Span("c", None, 0.9))
    assert any("outside 0.25-4.0" in w for w in doc.warnings)
    assert any("cut to 10 s" in w for w in doc.warnings)


def test_unknown_elements_are_spoken_and_reported_once():
    doc = parse_ssml(speak('<say-as interpret-as="date">today</say-as> and <say-as>more</say-as> <foo>x</foo>'
                           '<phoneme alphabet="ipa" ph="təˈmeɪtoʊ">tomato</phoneme>'))
    assert doc.text() == "today and more xtomato"
    assert len(doc.warnings) == 3
    assert "<say-as>" in doc.warnings[0] and "<foo>" in doc.warnings[1] and "ipa" in doc.warnings[2]


@pytest.mark.parametrize("doc, match", [
    ("<speak>a<b></speak>", r"line 1, column \d+: malformed XML"),
    ("<speak>\n  <p>a</s></speak>", r"line 2, column \d+: malformed XML \(mismatched tag\)"),
    ("<voice>a</voice>", "root element must be <speak>"),
    (speak('<prosody rate="zoom">a</prosody>'), "prosody rate 'zoom'"),
    (speak('<break time="5 minutes"/>'), "break time '5 minutes'"),
    (speak('<phoneme alphabet="x-pinyin" ph="xyz">a</phoneme>'), "not a pinyin syllable"),
    (speak('<phoneme alphabet="x-arpabet" ph="[QQ]">a</phoneme>'), r"unknown token \[QQ\]"),
    (speak('<voice>a</voice>'), "needs a name"),
    ("a" * 300_000, "at most"),
])
def test_bad_documents(doc, match):
    with pytest.raises(SsmlError, match=match):
        parse_ssml(doc)


def test_nesting_bound():
    ok = speak("<s>" * (MAX_DEPTH - 2) + "x" + "</s>" * (MAX_DEPTH - 2))
    assert parse_ssml(ok).text() == "x"
    deep = speak("<emphasis>" * 1000 + "x" + "</emphasis>" * 1000)
    with pytest.raises(SsmlError, match=f"nested deeper than {MAX_DEPTH}"):
        parse_ssml(deep)


BOMB = """<?xml version="1.0"?>
<!DOCTYPE speak [
 <!ENTITY a "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa">
 <!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">
 <!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;">
 <!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">
 <!ENTITY e "&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;">
 <!ENTITY f "&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;">
 <!ENTITY g "&f;&f;&f;&f;&f;&f;&f;&f;&f;&f;&f;&f;&f;&f;&f;&f;">
]>
<speak>&g;</speak>"""

EXTERNAL = """<?xml version="1.0"?>
<!DOCTYPE speak [<!ENTITY x SYSTEM "file:///etc/passwd">]>
<speak>&x;</speak>"""


@pytest.mark.parametrize("doc", [BOMB, EXTERNAL, '<!DOCTYPE speak SYSTEM "http://example.invalid/x.dtd"><speak/>'])
def test_dtds_and_entities_are_refused_at_once(doc):
    t0 = time.perf_counter()
    with pytest.raises(SsmlError, match=r"line [12], column \d+: a DOCTYPE"):
        parse_ssml(doc)
    assert time.perf_counter() - t0 < 0.5


def test_undeclared_entity_is_malformed():
    with pytest.raises(SsmlError, match="undefined entity"):
        parse_ssml(speak("&nope;"))
    assert parse_ssml(speak("a &amp; b &lt;c&gt;")).text() == "a & b <c>"


def test_emphasis_stays_balanced_across_a_break():
    doc = parse_ssml(speak('<emphasis level="strong">a<break/>b</emphasis><emphasis level="none">c</emphasis>'))
    assert doc.parts == (Span("<strong>a</strong>"), Break(0.5), Span("<strong>b</strong>c"))


def test_looks_like_ssml():
    assert looks_like_ssml('  <?xml version="1.0"?>\n<speak>x</speak>')
    assert looks_like_ssml("<speak/>")
    assert not looks_like_ssml("<speaker>x</speaker>") and not looks_like_ssml("Hello <speak>")
