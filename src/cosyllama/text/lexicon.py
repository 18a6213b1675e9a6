"""Pronunciation lexicons: words spoken as CosyVoice3's own pronunciation tokens (docs/pronunciation.md).

CosyVoice3's text vocabulary holds 84 ARPAbet phone tokens (``[AA]``, ``[AA0]`` ... ``[ZH]``) and 176
pinyin initial/final tokens (``[j]``, ``[ǐ]``, ``[iǎo]`` ...). A word written as such tokens is spoken
as they say. A :class:`Lexicon` maps words to token sequences and replaces each whole word of a text
by its tokens; the inline form ``{word|[t][o][k][e][n][s]}`` does the same for one place in a text.

Where in the frontend (:meth:`cosyllama.frontend.Frontend.normalize_and_split`): text normalization
spells digits out (``[AH0]`` would become ``[AHzero]``, or wetext refuses the text), so

* inline forms are taken out of the text before normalization (each becomes one private-use
  character, which the normalizer and the splitter leave alone) and put back, as tokens, into the
  segments it returns;
* lexicon entries are applied to each segment after normalization and splitting: an entry matches a
  word as the normalizer leaves it (numbers spelled out), and the segments are the ones a text
  without entries gets.

Matching (:meth:`Lexicon.apply`): an entry holding a CJK character (Han, kana, hangul) matches
wherever its exact characters stand (Chinese has no spaces between words); any other entry matches
whole words only, ignoring case (``str.casefold``): not inside a longer run of letters/digits, nor
before or after an apostrophe that joins letters (``don`` does not match in ``don't``). At each
place the longest entry wins; replaced text is not matched again. Special tokens already in the
text (``[breath]``, ``[j]``, ``<strong>`` ...) and ``<|…|>`` markup are never matched into, and
in a text holding ``<|endofprompt|>`` only what follows the last marker is (the system prompt before
it is not spoken).
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from ..errors import InputError
from .tokenizer import ARPABET_TOKENS, ENDOFPROMPT, PINYIN_TOKENS, SPECIAL_TOKENS

PRONUNCIATION_TOKENS = frozenset(ARPABET_TOKENS + PINYIN_TOKENS)
MAX_FILE_BYTES = 32 * 1024 * 1024  # a lexicon file larger than this is refused
MAX_WORD_CHARS = 100  # a lexicon word longer than this is refused
MAX_ENTRY_TOKENS = 200  # nor an entry of more tokens
MAX_INLINE = 1000  # inline forms in one text

_TOKEN_RE = re.compile(r"\[[^\[\]]*\]")
# {word|[tokens]}: the word has no braces or bar; the tokens start with "[" (else it is plain text)
INLINE_RE = re.compile(r"\{([^{}|]*)\|(\s*\[[^{}|]*)\}")
_CJK_RE = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af\U00020000-\U0003134f]")
# what a lexicon match never reaches into: special tokens written in the text and <|…|> markup
_PROTECTED_RE = re.compile("|".join([r"<\|.*?\|>"] + [re.escape(t) for t in sorted(SPECIAL_TOKENS, key=len,
                                                                                       reverse=True)]))
_PUA_FIRST, _PUA_LAST = 0xE000, 0xF8FF  # the placeholders of inline forms
_FORBIDDEN_WORD_CHARS = set("[]{}|<>")



class LexiconError(InputError):
    """A lexicon file or entry that cannot be used; the message names the file, line and entry."""


def is_cjk(text: str) -> bool:
    """True if ``text`` holds a Han, kana or hangul character (such words are matched as substrings)."""
    return _CJK_RE.search(text) is not None


def _hint(token: str) -> str:
    inner = token[1:-1]
    if inner.upper() == inner and inner[:2].isalpha() and inner.isascii():
        return "ARPAbet phones are [AA] ... [ZH], the vowels also with stress 0/1/2 ([AH0], [EY1])"
    if inner.isascii() and any(c.isdigit() for c in inner):
        return ("pinyin is written as an initial and a final with its tone mark, e.g. [j][ǐ] for ji3, [x][iǎo] "
                "for xiao3; cosyllama lexicon suggest WORD proposes an entry")
    return "see docs/pronunciation.md for the token list (text.tokenizer.ARPABET_TOKENS, PINYIN_TOKENS)"


def _clip(text: str, n: int = 64) -> str:
    """A piece of a lexicon as a message quotes it: at most ``n`` characters (a message must not grow with
    a request's lexicon)."""
    return text if len(text) <= n else text[:n] + "..."


def parse_tokens(spec: str, tokenizer=None) -> tuple[str, ...]:
    """The pronunciation tokens of ``spec`` (``"[j][ǐ]"`` or ``"[j] [ǐ]"``); each must be one of
    CosyVoice3's ARPAbet or pinyin tokens (and, with a ``tokenizer``, one id of it). Raises
    :class:`LexiconError` naming the first token that is not."""
    spec = unicodedata.normalize("NFC", spec.strip())
    if not spec:
        raise LexiconError("no tokens given")
    tokens = []
    pos = 0
    for m in _TOKEN_RE.finditer(spec):
        between = spec[pos:m.start()]
        if between.strip():
            raise LexiconError(f"{_clip(between.strip())!r} is not a token: write each token in brackets, "
                               "e.g. [j][ǐ]")
        tokens.append(m.group())
        pos = m.end()
    if spec[pos:].strip():
        raise LexiconError(f"{_clip(spec[pos:].strip())!r} is not a token: write each token in brackets, e.g. [j][ǐ]")
    if len(tokens) > MAX_ENTRY_TOKENS:
        raise LexiconError(f"{len(tokens)} tokens; an entry has at most {MAX_ENTRY_TOKENS}")
    for t in tokens:
        known = t in PRONUNCIATION_TOKENS and (tokenizer is None or tokenizer.token_to_id(t) is not None)
        if not known:
            raise LexiconError(f"unknown token {_clip(t)}: not one of CosyVoice3's pronunciation tokens ({_hint(t)})")
    return tuple(tokens)


def _check_word(word: str) -> str:
    word = unicodedata.normalize("NFC", " ".join(word.split()))
    if not word:
        raise LexiconError("empty word")
    if len(word) > MAX_WORD_CHARS:
        raise LexiconError(f"word of {len(word)} characters; at most {MAX_WORD_CHARS}")
    bad = sorted(set(word) & _FORBIDDEN_WORD_CHARS)
    if bad:
        raise LexiconError(f"word {word!r} holds {''.join(bad)!r}; a word has none of []{{}}|<>")
    if any(unicodedata.category(c)[0] == "C" for c in word):
        raise LexiconError(f"word {word!r} holds a control character")
    return word


def _key(word: str) -> str:
    return word if is_cjk(word) else word.casefold()


@dataclass(frozen=True)
class Entry:
    """One lexicon entry: ``word`` is spoken as ``tokens`` (e.g. ``("[j]", "[ǐ]")``); ``where``
    names its origin (``"file.txt:3"``) for messages."""

    word: str
    tokens: tuple[str, ...]
    where: str = ""

    @property
    def spelled(self) -> str:
        """The tokens as they go into the text: ``"[j][ǐ]"``."""
        return "".join(self.tokens)


def _entry(word: str, spec: str, tokenizer, where: str, hint: str = "") -> Entry:
    """One entry of a lexicon file (a text line or a JSON pair): its word checked, its tokens parsed."""
    word = _check_word(word)
    if not spec.strip():
        raise LexiconError(f"entry {word!r} has no tokens{hint}")
    return Entry(word, parse_tokens(spec, tokenizer), where)


class Lexicon:
    """Words and their pronunciation tokens; immutable once made, safe to share between threads.

    Make one with :meth:`load` (a file), :meth:`from_mapping` (a dict) or from :class:`Entry` objects;
    :meth:`apply` replaces the words of a text by their tokens. ``a | b``: both, ``b``'s entries
    winning where both have a word.
    """

    def __init__(self, entries: Iterable[Entry] = ()):
        self._latin: dict[str, Entry] = {}
        self._cjk: dict[str, Entry] = {}
        for e in entries:
            table = self._cjk if is_cjk(e.word) else self._latin
            key = _key(e.word)
            if key in table:
                first = table[key]
                raise LexiconError(f"{e.where or 'entry'}: duplicate word {e.word!r} (first at "
                                   f"{first.where or repr(first.word)})")
            table[key] = e
        # the lengths a Latin word can have in a text (casefold may change a length: "Straße", "STRASSE")
        self._latin_lengths = sorted({n for k, e in self._latin.items() for n in (len(k), len(e.word))},
                                     reverse=True)
        self._cjk_lengths = sorted({len(k) for k in self._cjk}, reverse=True)

    # -- making one ---------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path, tokenizer=None, *, name: str | None = None) -> Lexicon:
        """Read a lexicon file: UTF-8 text, one ``word<TAB>tokens`` or ``word tokens`` per line (a
        TAB lets the word hold spaces), ``#`` starts a comment line, blank lines are skipped; or a
        ``.json`` file holding one object ``{"word": "[t][o]..." or ["[t]", ...]}``. Every token is
        checked against CosyVoice3's pronunciation tokens (and the ``tokenizer``'s vocabulary, when
        given). Raises :class:`LexiconError` naming the file, line and entry of the first problem
        (``name``: how messages name the file, instead of ``lexicon PATH``: a voice folder's
        ``lexicon.txt``, whose path is the operator's)."""
        path = Path(path)
        file = str(path) if name is None else name
        at = f"lexicon {file}" if name is None else file
        try:
            size = path.stat().st_size
            if size > MAX_FILE_BYTES:
                raise LexiconError(f"{at}: {size} bytes; at most {MAX_FILE_BYTES}")
            data = path.read_bytes()
        except OSError as e:
            raise LexiconError(f"{at}: cannot read it: {e.strerror or e}") from e
        if data.startswith(b"\xef\xbb\xbf"):
            data = data[3:]
        if path.suffix.lower() == ".json":
            return cls._load_json(path, data, tokenizer, file, at)
        entries = []
        for n, raw in enumerate(data.split(b"\n"), 1):
            try:
                line = raw.decode("utf-8").rstrip("\r")
            except UnicodeDecodeError as e:
                raise LexiconError(f"{at}:{n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                   f"{e.start + 1}); save the file as UTF-8") from None
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if "\t" in line:
                word, _, spec = line.partition("\t")
            else:
                parts = line.strip().split(None, 1)
                word, spec = parts[0], parts[1] if len(parts) > 1 else ""
            if "#" in spec:  # a comment after the tokens (as `cosyllama lexicon suggest` writes them)
                spec = spec[:spec.index("#")]
            where = f"{file}:{n}"
            try:
                entries.append(_entry(word, spec, tokenizer, where, "; write word<TAB>tokens, e.g. 几\t[j][ǐ]"))
            except LexiconError as e:
                raise LexiconError(f"{at}:{n}: {e}") from None
        try:
            return cls(entries)
        except LexiconError as e:
            raise LexiconError(f"lexicon {e}" if name is None else str(e)) from None

    @classmethod
    def _load_json(cls, path: Path, data: bytes, tokenizer, file: str, at: str) -> Lexicon:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[:e.start].count(b"\n") + 1
            raise LexiconError(f"{at}:{line}: not UTF-8; save the file as UTF-8") from None
        seen: list[tuple[str, object]] = []
        try:
            obj = json.loads(text, object_pairs_hook=lambda pairs: seen.extend(pairs) or dict(pairs))
        except json.JSONDecodeError as e:
            raise LexiconError(f"{at}:{e.lineno}: not JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(obj, dict):
            raise LexiconError(f"{at}: a JSON lexicon is one object {{\"word\": \"[t][o]...\"}}")
        entries = []
        for word, spec in seen:
            where = f"{file}: entry {word!r}"
            try:
                if isinstance(spec, list) and all(isinstance(t, str) for t in spec):
                    spec = "".join(spec)
                if not isinstance(spec, str):
                    raise LexiconError("the tokens must be a string or a list of strings")
                entries.append(_entry(word, spec, tokenizer, where))
            except LexiconError as e:
                raise LexiconError(f"{at}: entry {word!r}: {e}") from None
        try:
            return cls(entries)
        except LexiconError as e:
            raise LexiconError(f"lexicon {e}" if at != file else str(e)) from None

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, str | Iterable[str]], tokenizer=None) -> Lexicon:
        """A lexicon from ``{word: "[j][ǐ]"}`` (or a list of tokens), checked like a file's lines."""
        entries = []
        for word, spec in mapping.items():
            if not isinstance(word, str):
                raise LexiconError(f"lexicon word {word!r} is not a string")
            if not isinstance(spec, str):
                spec = "".join(spec)
            try:
                entries.append(Entry(_check_word(word), parse_tokens(spec, tokenizer), f"entry {word!r}"))
            except LexiconError as e:
                raise LexiconError(f"lexicon entry {word!r}: {e}") from None
        return cls(entries)

    def check(self, tokenizer) -> Lexicon:
        """This lexicon, once every entry's tokens are checked against ``tokenizer``'s vocabulary (a
        lexicon loaded before the model, e.g. a server's ``--lexicon``); :class:`LexiconError` naming
        the first entry that has a token the vocabulary lacks."""
        for e in self:
            for t in e.tokens:
                if tokenizer.token_to_id(t) is None:
                    raise LexiconError(f"lexicon {e.where or repr(e.word)}: token {t} is not in this model's "
                                       "vocabulary")
        return self

    def __or__(self, other: Lexicon) -> Lexicon:
        if not isinstance(other, Lexicon):
            return NotImplemented
        if not other:
            return self
        if not self:
            return other
        mine = {(_key(e.word), is_cjk(e.word)): e for e in self}
        mine.update({(_key(e.word), is_cjk(e.word)): e for e in other})
        return Lexicon(mine.values())

    # -- reading one --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._latin) + len(self._cjk)

    def __iter__(self):
        yield from self._latin.values()
        yield from self._cjk.values()

    def __contains__(self, word: str) -> bool:
        return self.lookup(word) is not None

    def lookup(self, word: str) -> Entry | None:
        """The entry of ``word`` (matched as :meth:`apply` would: case-insensitive unless CJK), or None."""
        word = unicodedata.normalize("NFC", " ".join(word.split()))
        return (self._cjk if is_cjk(word) else self._latin).get(_key(word))

    def __repr__(self) -> str:
        return f"Lexicon({len(self)} entries)"

    # -- using one ----------------------------------------------------------------------------------

    def apply(self, text: str) -> str:
        """``text`` with every matching word replaced by its tokens (rules in the module's docstring)."""
        if not self or not text:
            return text
        start = 0
        marker = text.rfind(ENDOFPROMPT)
        if marker >= 0:
            start = marker + len(ENDOFPROMPT)
        out = [text[:start]]
        pos = start
        for m in _PROTECTED_RE.finditer(text, start):
            out.append(self._apply_plain(text[pos:m.start()]))
            out.append(m.group())
            pos = m.end()
        out.append(self._apply_plain(text[pos:]))
        return "".join(out)

    def _apply_plain(self, text: str) -> str:
        out: list[str] = []
        i, n, last = 0, len(text), 0
        while i < n:
            best: tuple[int, Entry] | None = None
            if self._cjk:
                for k in self._cjk_lengths:
                    if i + k <= n and (e := self._cjk.get(text[i:i + k])) is not None:
                        best = (k, e)
                        break
            if self._latin and _word_start(text, i):
                for k in self._latin_lengths:
                    if best is not None and k <= best[0]:
                        break
                    if i + k <= n and _word_end(text, i + k):
                        e = self._latin.get(" ".join(text[i:i + k].split()).casefold())
                        if e is not None and len(" ".join(text[i:i + k].split())) == k:
                            best = (k, e)
                            break
            if best is None:
                i += 1
                continue
            out.append(text[last:i])
            out.append(best[1].spelled)
            i += best[0]
            last = i
        out.append(text[last:])
        return "".join(out)


def _is_word_char(c: str) -> bool:
    return c.isalnum() and not is_cjk(c)


def _word_start(text: str, i: int) -> bool:
    """A Latin word may start at ``i``: a word character not preceded by one (nor by an apostrophe joining it)."""
    if not _is_word_char(text[i]):
        return False
    if i == 0:
        return True
    prev = text[i - 1]
    if _is_word_char(prev):
        return False
    return not (prev in "'’" and i >= 2 and _is_word_char(text[i - 2]))


def _word_end(text: str, j: int) -> bool:
    """A Latin word may end before ``j``."""
    if not _is_word_char(text[j - 1]):
        return False
    if j == len(text):
        return True
    nxt = text[j]
    if _is_word_char(nxt):
        return False
    return not (nxt in "'’" and j + 1 < len(text) and _is_word_char(text[j + 1]))


# -- inline forms --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InlineText:
    """A text with its inline forms ``{word|[tokens]}`` replaced by placeholders (one private-use
    character each) that normalization and splitting leave alone; :meth:`restore` puts the tokens
    in their place."""

    text: str
    tokens: Mapping[str, str]  # placeholder -> the tokens it stands for ("[j][ǐ]")
    words: Mapping[str, str] = field(default_factory=dict)  # placeholder -> the form's word, as written

    def restore(self, segment: str) -> str:
        if not self.tokens:
            return segment
        return "".join(self.tokens.get(c, c) for c in segment)

    def shown(self, segment: str) -> str:
        """``segment`` with each placeholder back as its form's word (what captions show)."""
        if not self.words:
            return segment
        return "".join(self.words.get(c, c) for c in segment)


def take_inline(text: str, tokenizer=None) -> InlineText:
    """Replace each inline form of ``text`` by a placeholder (see :class:`InlineText`). A form whose
    tokens are not CosyVoice3 pronunciation tokens raises :class:`LexiconError` naming it; text
    without forms comes back unchanged."""
    if "{" not in text:
        return InlineText(text, {})
    forms = list(INLINE_RE.finditer(text))
    if not forms:
        return InlineText(text, {})
    if len(forms) > MAX_INLINE:
        raise LexiconError(f"text holds {len(forms)} inline pronunciations {{word|[tokens]}}; at most {MAX_INLINE}")
    used = {c for c in text if _PUA_FIRST <= ord(c) <= _PUA_LAST}
    free = (chr(c) for c in range(_PUA_FIRST, _PUA_LAST + 1) if chr(c) not in used)
    table: dict[str, str] = {}
    words: dict[str, str] = {}
    out, pos = [], 0
    for m in forms:
        try:
            tokens = parse_tokens(m.group(2), tokenizer)
        except LexiconError as e:
            raise LexiconError(f"inline pronunciation {m.group()!r} at character {m.start()}: {e}") from None
        ph = next(free, None)
        if ph is None:
            raise LexiconError("text holds too many private-use characters to mark its inline pronunciations")
        table[ph] = "".join(tokens)
        words[ph] = m.group(1)
        out.append(text[pos:m.start()])
        out.append(ph)
        pos = m.end()
    out.append(text[pos:])
    return InlineText("".join(out), table, words)


def inline_form(word: str, tokens: Iterable[str]) -> str:
    """The inline form of ``word`` spoken as ``tokens`` (characters an inline word cannot hold are dropped)."""
    word = "".join(c for c in word if c not in "{}|")
    return "{" + word + "|" + "".join(tokens) + "}"


__all__ = ["INLINE_RE", "PRONUNCIATION_TOKENS", "Entry", "InlineText", "Lexicon", "LexiconError", "inline_form",
           "is_cjk", "parse_tokens", "take_inline"]
