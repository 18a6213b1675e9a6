"""Pronunciation lexicons and inline forms at the token level, against the fixture's real tokenizer
(src/cosyllama/text/lexicon.py, the frontend's hook, `cosyllama lexicon`)."""

from __future__ import annotations

import pytest
import torch

from cosyllama.cli import main
from cosyllama.errors import InputError
from cosyllama.frontend import Frontend, PromptFeatures
from cosyllama.request import SynthesisOptions
from cosyllama.text.lexicon import Lexicon, LexiconError, take_inline
from cosyllama.text.normalize import DEFAULT_PROMPT_PREFIX, TextNormalizer
from cosyllama.text.spellings import pinyin_tokens
from cosyllama.text.tokenizer import TextTokenizer
from helpers import MODEL_DIR

TOMATO = "[T][AH0][M][EY1][T][OW2]"


@pytest.fixture(scope="module")
def frontend():
    """A frontend with the real tokenizer and normalizer (no prompt models: these tests make no voice)."""
    tok = TextTokenizer(MODEL_DIR / "CosyVoice-BlankEN")
    fe = Frontend.__new__(Frontend)
    fe.tokenizer, fe.normalizer = tok, TextNormalizer(tok)
    return fe


@pytest.fixture(scope="module")
def voice():
    return PromptFeatures(speech_tokens=torch.zeros(4, dtype=torch.int32), speaker_embedding=torch.zeros(192),
                          prompt_feat=torch.zeros(8, 80), prompt_text=None, prompt_text_ids=())


@pytest.fixture(scope="module")
def lexicon(frontend):
    return Lexicon.from_mapping({"tomato": TOMATO, "几": "[j][ǐ]", "New York": "[N][UW1][Y][AO1][R][K]"},
                                frontend.tokenizer)


def ids(fe, tokens: str) -> list[int]:
    return [fe.tokenizer.token_to_id(t) for t in tokens.replace("][", "] [").split()]


def test_entry_tokens_replace_the_word_in_text_ids(frontend, voice, lexicon):
    plain = frontend.zero_shot("I like the tomato soup.", voice, "transcript")[0].text_ids
    with_lex = frontend.zero_shot("I like the tomato soup.", voice, "transcript", lexicon=lexicon)[0].text_ids
    tok = frontend.tokenizer
    word = tok.encode(" tomato")
    i = next(k for k in range(len(plain)) if list(plain[k:k + len(word)]) == word)
    expect = list(plain[:i]) + tok.encode(" ") + ids(frontend, TOMATO) + list(plain[i + len(word):])
    assert list(with_lex) == expect
    assert all(t in with_lex for t in ids(frontend, TOMATO))


def test_text_without_entries_is_unchanged(frontend, voice, lexicon):
    for text in ("Hello there, 25 degrees today.", "我有3个苹果。", "You are a helpful assistant.<|endofprompt|>Hi!",
                 "Braces {stay} and {a|b} too.", "[breath] I <strong>am</strong> here."):
        for mode in ("zero_shot", "cross_lingual"):
            args = (text, voice, "transcript") if mode == "zero_shot" else (text, voice)
            before = [i.text_ids for i in getattr(frontend, mode)(*args)]
            after = [i.text_ids for i in getattr(frontend, mode)(*args, lexicon=lexicon)]
            empty = [i.text_ids for i in getattr(frontend, mode)(*args, lexicon=Lexicon())]
            assert before == empty
            if "tomato" not in text:
                assert before == after


def test_entries_apply_after_normalization_so_digit_tokens_survive(frontend, lexicon):
    segs = frontend.normalize_and_split("I ate 3 tomatoes and a TOMATO in new york.", lexicon=lexicon)
    assert segs == [f"I ate three tomatoes and a {TOMATO} in [N][UW1][Y][AO1][R][K]."]
    # the segments are those of the text without entries (the splitter measured the plain words)
    long = " ".join(["The tomato is red and ripe today."] * 12)
    assert len(frontend.normalize_and_split(long, lexicon=lexicon)) == len(frontend.normalize_and_split(long))


def test_whole_word_and_case_rules(lexicon):
    assert lexicon.apply("Tomatoes, tomato's, TOMATO!") == f"Tomatoes, tomato's, {TOMATO}!"
    assert lexicon.apply("我有几个") == "我有[j][ǐ]个"  # CJK: exact substring
    assert lexicon.apply("[T] tomato[AA]") == f"[T] {TOMATO}[AA]"
    lex = Lexicon.from_mapping({"a": "[EY1]", "j": "[JH][EY1]"})
    assert lex.apply("[a] a [j][ǐ]") == "[a] [EY1] [j][ǐ]"  # tokens already in the text are never matched into
    prefix = DEFAULT_PROMPT_PREFIX.replace("assistant", "a")
    assert lex.apply(prefix + "a") == prefix + "[EY1]"  # the system prompt before the marker is left alone


def test_inline_form(frontend, voice):
    text = "Say {tomato|[T][AH0][M][AA1][T][OW2]} 5 times."
    seg = frontend.normalize_and_split(text)
    assert seg == ["Say [T][AH0][M][AA1][T][OW2] five times."]
    out = frontend.cross_lingual(text, voice)[0]
    assert out.text == DEFAULT_PROMPT_PREFIX + seg[0]
    assert frontend.normalize_and_split("我{几|[j][ǐ]}个。") == ["我[j][ǐ]个。"]
    assert take_inline("{a|b} {x}").text == "{a|b} {x}"  # not tokens: plain text
    with pytest.raises(InputError, match=r"\[ji3\]"):
        frontend.normalize_and_split("Say {ji|[ji3]}.")


def test_options_take_a_lexicon():
    lex = Lexicon.from_mapping({"tomato": TOMATO})
    assert SynthesisOptions(lexicon=lex).lexicon is lex
    assert (Lexicon.from_mapping({"tomato": "[T]"}) | lex).lookup("Tomato").spelled == TOMATO


def test_load_file_and_json(tmp_path, frontend):
    p = tmp_path / "lex.txt"
    p.write_text("# comment\n\ntomato\t[T][AH0][M][EY1][T][OW2]\nNew York\t[N][UW1] [Y][AO1][R][K]  # note\n"
                 "几 [j][ǐ]\n", encoding="utf-8")
    lex = Lexicon.load(p, frontend.tokenizer)
    assert len(lex) == 3 and lex.lookup("new york").spelled == "[N][UW1][Y][AO1][R][K]"
    j = tmp_path / "lex.json"
    j.write_text('{"tomato": "[T][AH0]", "几": ["[j]", "[ǐ]"]}', encoding="utf-8")
    assert Lexicon.load(j).lookup("几").tokens == ("[j]", "[ǐ]")


@pytest.mark.parametrize("content, match", [
    ("ok\t[T]\nbad\t[T][XX1]\n", r"lex\.txt:2: unknown token \[XX1\]"),
    ("ok\t[T]\nOK\t[K]\n", r"lex\.txt:2: duplicate word 'OK' \(first at .*lex\.txt:1\)"),
    ("lonely\n", r"lex\.txt:1: entry 'lonely' has no tokens"),
    ("a\tT AH\n", r"lex\.txt:1: .*not a token"),
    ("几\t[ji3]\n", r"lex\.txt:1: unknown token \[ji3\].*\[j\]\[ǐ\]"),
    ("a{b\t[T]\n", r"lex\.txt:1: word 'a\{b'"),
])
def test_bad_files_name_file_line_and_entry(tmp_path, content, match):
    p = tmp_path / "lex.txt"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(LexiconError, match=match):
        Lexicon.load(p)


def test_latin1_file_is_refused(tmp_path):
    p = tmp_path / "lex.txt"
    p.write_bytes("ok\t[T]\ncafé\t[K]\n".encode("latin-1"))
    with pytest.raises(LexiconError, match=r"lex\.txt:2: not UTF-8 \(byte 0xe9"):
        Lexicon.load(p)


def test_bad_json_and_missing_file(tmp_path):
    j = tmp_path / "lex.json"
    j.write_text('{"a": "[T]", "a": "[K]"}', encoding="utf-8")
    with pytest.raises(LexiconError, match="duplicate word 'a'"):
        Lexicon.load(j)
    with pytest.raises(LexiconError, match="cannot read it"):
        Lexicon.load(tmp_path / "nope.txt")


def test_pinyin_spelling_matches_the_vocabulary():
    assert pinyin_tokens("ji3") == ("[j]", "[ǐ]")
    assert pinyin_tokens("xiao3") == ("[x]", "[iǎo]")
    assert pinyin_tokens("lve4") == ("[l]", "[vè]")
    assert pinyin_tokens("an1") == ("[ān]",)
    with pytest.raises(LexiconError, match="not a pinyin syllable"):
        pinyin_tokens("xyz")


def test_suggest_english(capsys):
    pytest.importorskip("pocketsphinx")
    assert main(["lexicon", "suggest", "read"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split("\t")[:2] == ["read", "[R][EH][D]"] and out[1].split("\t")[1] == "[R][IY][D]"


def test_suggest_chinese_and_paste_back(capsys, tmp_path):
    pytest.importorskip("pypinyin")
    assert main(["lexicon", "suggest", "重庆"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("重庆\t[ch][óng][q][ìng]\t# pypinyin chong2 qing4")
    p = tmp_path / "lex.txt"
    p.write_text(out, encoding="utf-8")
    assert main(["lexicon", "check", str(p)]) == 0
    assert "1 entries" in capsys.readouterr().out


def test_cli_errors_are_one_line(capsys, tmp_path):
    assert main(["lexicon", "suggest", "zzqxw", "--language", "en"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no pronunciation known" in err
    p = tmp_path / "bad.txt"
    p.write_text("x\t[QQ]\n", encoding="utf-8")
    assert main(["lexicon", "check", str(p)]) == 2
    assert "bad.txt:1: unknown token [QQ]" in capsys.readouterr().err
