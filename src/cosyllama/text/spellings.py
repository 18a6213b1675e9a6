"""Other spellings of CosyVoice3's pronunciation tokens (docs/pronunciation.md): numbered or tone-marked pinyin
and bare ARPAbet turned into the vocabulary's tokens (what SSML's ``<phoneme>`` takes), and ``cosyllama lexicon
suggest``'s entries from kept libraries (pypinyin for Chinese, the CMU dictionary PocketSphinx ships for
English)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from .lexicon import PRONUNCIATION_TOKENS, Entry, LexiconError, _check_word, _hint, is_cjk
from .tokenizer import ARPABET_TOKENS

__all__ = ["CMUDICT_HINT", "PYPINYIN_HINT", "arpabet_tokens", "pinyin_tokens", "suggest"]


# -- other spellings: numbered pinyin, bare ARPAbet ------------------------------------------------------

_INITIALS = ("zh", "ch", "sh", "b", "p", "m", "f", "d", "t", "n", "l", "g", "k", "h", "j", "q", "x", "r", "z", "c",
             "s", "y", "w")
_MARKS = {"a": "āáǎà", "e": "ēéěè", "i": "īíǐì", "o": "ōóǒò", "u": "ūúǔù", "ü": "ǖǘǚǜ"}
_UNMARK = {m: (v, t + 1) for v, marks in _MARKS.items() for t, m in enumerate(marks)}


def pinyin_tokens(syllable: str) -> tuple[str, ...]:
    """CosyVoice3's tokens of one pinyin syllable, numbered (``ji3``, ``lv4``, ``lu:4``, ``ma5``/``ma``
    for the neutral tone) or tone-marked (``jǐ``): ``("[j]", "[ǐ]")``. The final carries the tone mark
    (on a, else e, else the o of ou, else the last vowel); ü is written u after j, q, x, y, and v before
    another letter (``lüè`` → ``[l][vè]``), as the vocabulary spells them. Raises :class:`LexiconError`
    when the syllable is not pinyin or its final has no token."""
    s = unicodedata.normalize("NFC", syllable.strip().lower()).replace("u:", "ü").replace("v", "ü")
    tone = 5
    if s and s[-1] in "012345":
        tone, s = int(s[-1]) or 5, s[:-1]
    plain = []
    for c in s:
        if c in _UNMARK:
            base, t = _UNMARK[c]
            plain.append(base)
            tone = t
        else:
            plain.append(c)
    s = "".join(plain)
    initial = next((i for i in _INITIALS if s.startswith(i) and len(s) > len(i)), "")
    final = s[len(initial):]
    if not final or not all(c in "aeiouüngr" for c in final) or not any(c in "aeiouü" for c in final):
        raise LexiconError(f"{syllable!r} is not a pinyin syllable (e.g. ji3, xiao3, lv4)")
    if initial in ("j", "q", "x", "y"):
        final = final.replace("ü", "u")
    if tone != 5:
        if "a" in final:
            at = final.index("a")
        elif "e" in final:
            at = final.index("e")
        elif "ou" in final:
            at = final.index("o")
        else:
            at = max(final.rfind(v) for v in "iouü")
        final = final[:at] + _MARKS[final[at]][tone - 1] + final[at + 1:]
    if final not in ("ü", "ǖ", "ǘ", "ǚ", "ǜ"):
        final = final.replace("ü", "v").replace("ǖ", "v").replace("ǘ", "v").replace("ǚ", "v").replace("ǜ", "v")
    tokens = ((f"[{initial}]",) if initial else ()) + (f"[{final}]",)
    for t in tokens:
        if t not in PRONUNCIATION_TOKENS:
            raise LexiconError(f"pinyin {syllable!r} would be {''.join(tokens)}, but {t} is not in CosyVoice3's "
                               "vocabulary (it has no token for this final with this tone)")
    return tokens


def arpabet_tokens(phones: str) -> tuple[str, ...]:
    """CosyVoice3's tokens of ARPAbet phones separated by spaces (``"T AH0 M EY1 T OW2"``, any case)."""
    tokens = tuple(f"[{p.upper()}]" for p in phones.split())
    if not tokens:
        raise LexiconError("no phones given")
    for t in tokens:
        if t not in PRONUNCIATION_TOKENS or t[1:-1] not in {a[1:-1] for a in ARPABET_TOKENS}:
            raise LexiconError(f"unknown ARPAbet phone {t[1:-1]!r} ({_hint('[AA]')})")
    return tokens


# -- suggestions from kept dictionaries ----------------------------------------------------------------

PYPINYIN_HINT = "suggesting Chinese entries needs pypinyin: pip install 'cosyllama[lexicon]' (or 'pypinyin>=0.50')"
CMUDICT_HINT = ("suggesting English entries needs the CMU dictionary PocketSphinx ships: "
                "pip install 'cosyllama[align]' (or 'pocketsphinx>=5.0')")


def suggest(word: str, language: str | None = None) -> list[Entry]:
    """Proposed entries for ``word``, the likeliest first: Chinese (``language`` "zh", or None and
    the word holds CJK) from pypinyin's readings (the phrase's reading, then for a single character
    its other readings); English ("en") from the CMU pronouncing dictionary PocketSphinx's wheel
    ships (each listed variant; its phones carry no stress, so the unstressed tokens ``[AH]`` are
    used). Empty when the word is not known. Raises :class:`~cosyllama.errors.MissingDependencyError`
    naming the extra to install."""
    word = _check_word(word)
    if language is None:
        language = "zh" if is_cjk(word) else "en"
    if language == "zh":
        return _suggest_zh(word)
    if language == "en":
        return _suggest_en(word)
    raise LexiconError(f"language {language!r}: give zh or en")


def _suggest_zh(word: str) -> list[Entry]:
    from ..errors import MissingDependencyError

    try:
        from pypinyin import Style, lazy_pinyin, pinyin
    except ImportError:
        raise MissingDependencyError(PYPINYIN_HINT) from None
    if not is_cjk(word):
        raise LexiconError(f"{word!r} holds no Chinese character; use --language en")
    readings = [lazy_pinyin(word, style=Style.TONE3, neutral_tone_with_five=True, errors="ignore")]
    if len(word) == 1:
        readings += [[r] for r in pinyin(word, style=Style.TONE3, heteronym=True, neutral_tone_with_five=True,
                                         errors="ignore")[0]]
    out, seen = [], set()
    for syllables in readings:
        key = tuple(syllables)
        if not syllables or key in seen:
            continue
        seen.add(key)
        try:
            tokens = tuple(t for syl in syllables for t in pinyin_tokens(syl))
        except LexiconError as e:
            out.append(Entry(word, (), f"pypinyin {' '.join(syllables)}: {e}"))
            continue
        out.append(Entry(word, tokens, f"pypinyin {' '.join(syllables)}"))
    return out


def _cmudict_path() -> Path:
    from ..errors import MissingDependencyError

    try:
        import pocketsphinx
    except ImportError:
        raise MissingDependencyError(CMUDICT_HINT) from None
    path = Path(pocketsphinx.get_model_path()) / "en-us" / "cmudict-en-us.dict"
    if not path.is_file():
        raise MissingDependencyError(f"{path} is missing from this pocketsphinx install; {CMUDICT_HINT}")
    return path


def _suggest_en(word: str) -> list[Entry]:
    if is_cjk(word):
        raise LexiconError(f"{word!r} holds Chinese characters; use --language zh")
    key = word.casefold()
    out = []
    prefix = key.encode("utf-8")
    with open(_cmudict_path(), "rb") as f:
        for line in f:
            if not line.startswith(prefix):
                continue
            head, _, phones = line.decode("utf-8", "replace").strip().partition(" ")
            if head.casefold() == key or re.fullmatch(re.escape(key) + r"\(\d+\)", head.casefold()):
                try:
                    out.append(Entry(word, arpabet_tokens(phones), f"CMUdict {head}"))
                except LexiconError:
                    continue
    return out
