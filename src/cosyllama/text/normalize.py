"""Text normalization, segmentation and the CosyVoice3 prompt conventions (see docs/reference.md#text).

Normalization follows the reference (wetext 0.1.8, punctuation and length rules) with one
deliberate change: in a sentence that contains Cyrillic letters, numbers are spelled in Russian
(:mod:`cosyllama.text.russian`) instead of the reference's English words. Text containing ``<|``…``|>``
markup is never normalized or split (reference rule). Lengths are counted in tokens of
:class:`~cosyllama.text.tokenizer.TextTokenizer`.

Prompt conventions (our choice, documented here and in the engine): the LLM needs
``<|endofprompt|>`` (id 151646) in ``prompt text + target text``.

* zero-shot: a prompt text that lacks ``<|endofprompt|>`` is a plain transcript; we prepend the
  reference's system prefix ``"You are a helpful assistant.<|endofprompt|>"``. A prompt text that
  contains the marker is used verbatim. Prompt text is not normalized (the reference's never is,
  because it always carries the marker).
* cross-lingual: a target text containing the marker is used verbatim as one segment (reference
  behaviour). Otherwise it is normalized and split like any target text and every segment gets
  the system prefix (each segment is a separate LLM call and each needs the marker).
* instruct2: an instruction without the marker becomes
  ``"You are a helpful assistant. " + instruction + "<|endofprompt|>"``; with the marker it is used
  verbatim. Instructions are never normalized (reference rule).
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata

from ..errors import InputError, MissingDependencyError
from .tokenizer import ENDOFPROMPT, TextTokenizer

SYSTEM_PROMPT = "You are a helpful assistant."  # the reference's system sentence (example.py)
DEFAULT_PROMPT_PREFIX = SYSTEM_PROMPT + ENDOFPROMPT

# ----------------------------------------------------------------------------------------------
# Normalization (see docs/reference.md#normalization)

_CJK_RE = re.compile(r"[\u4e00-\u9fff]")
_CYRILLIC_RE = re.compile(r"[\u0400-\u04ff]")
# Sentence boundaries for choosing the number language: end punctuation followed by whitespace.
_SENTENCE_BOUNDARY_RE = re.compile(r"(?<=[.!?;…])(\s+)")

ZH_PUNCT = "。？！；：、.?!;"
EN_PUNCT = ".?!;:"
SPLIT_MAX_TOKENS = 80  # a segment is flushed before it would exceed this length ...
SPLIT_MIN_TOKENS = 60  # ... if it already holds more than this
SPLIT_MERGE_LEN = 20  # a last segment shorter than this joins the previous one
_CLOSING_QUOTES = ('"', "”")
# control characters other than tab, newline and carriage return; lone surrogates (not Unicode text)
_BAD_CHAR_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")

log = logging.getLogger("cosyllama.text")


def text_problem(text: str) -> str | None:
    """Why ``text`` is no text to speak, for a message that starts with the field's name, or None:
    a control character (tab, newline and carriage return are fine) or a lone surrogate (half of
    a UTF-16 pair, not Unicode text), each named with its code point and position (0-based)."""
    m = _BAD_CHAR_RE.search(text)
    if m is None:
        return None
    c, i = m.group(), m.start()
    if "\ud800" <= c <= "\udfff":
        return (f"holds a lone surrogate (U+{ord(c):04X}) at character {i}, which is not Unicode text; send the "
                "text as valid UTF-8 (a character outside the BMP is one code point, not a broken pair)")
    return f"holds a control character (U+{ord(c):04X}) at character {i}; remove it (tab and newline are fine)"


def has_markup(text: str) -> bool:
    """True if the text carries ``<|…|>`` markup; such text is never normalized (reference rule)."""
    return "<|" in text and "|>" in text


def contains_chinese(text: str) -> bool:
    return bool(_CJK_RE.search(text))


def is_only_punctuation(text: str) -> bool:
    """True for text made only of Unicode punctuation/symbol characters (or empty)."""
    return all(unicodedata.category(c)[0] in "PS" for c in text)


def replace_blank(text: str) -> str:
    """Drop every space unless both neighbours are non-space ASCII (keeps spaces between English words)."""
    out = []
    for i, c in enumerate(text):
        if c == " ":
            prev = text[i - 1] if i > 0 else ""
            nxt = text[i + 1] if i + 1 < len(text) else ""
            if not (prev.isascii() and prev not in ("", " ") and nxt.isascii() and nxt not in ("", " ")):
                continue
        out.append(c)
    return "".join(out)


def spell_out_number(text: str) -> str:
    """Replace each run of digits with English words (the reference's last English-path step).

    The reference uses inflect's ``number_to_words``, which is not installed here; ``num2words``
    (lang "en") gives the same words for whole numbers ("twelve thousand, three hundred and
    forty-five"). After wetext almost no digits are left, so this rarely fires.
    """
    from num2words import num2words

    def words(run: str) -> str:
        value = int("".join(str(unicodedata.digit(c)) for c in run))
        return num2words(value, lang="en")

    return re.sub(r"\d+", lambda m: words(m.group(0)), text)


def split_paragraph(text: str, length, lang: str, max_len: int = SPLIT_MAX_TOKENS,
                    min_len: int = SPLIT_MIN_TOKENS, merge_len: int = SPLIT_MERGE_LEN) -> list[str]:
    """Cut ``text`` into sentences at end punctuation, then greedily merge them into segments.

    ``length(s)`` measures a string (characters for Chinese, Qwen tokens otherwise). A sentence is
    added to the current segment unless the sum would exceed ``max_len`` while the segment already
    exceeds ``min_len``; a last segment shorter than ``merge_len`` joins the previous one.
    """
    punct = ZH_PUNCT if lang == "zh" else EN_PUNCT
    if text[-1] not in punct:
        text += "。" if lang == "zh" else "."
    sentences: list[str] = []
    start = 0
    i = 0
    while i < len(text):
        if text[i] in punct:
            if i > start:
                sentences.append(text[start:i + 1])
            if i + 1 < len(text) and text[i + 1] in _CLOSING_QUOTES and sentences:
                sentences[-1] += text[i + 1]
                i += 1
            start = i + 1
        i += 1

    segments: list[str] = []
    cur = ""
    for s in sentences:
        if length(cur + s) > max_len and length(cur) > min_len:
            segments.append(cur)
            cur = ""
        cur += s
    if cur:
        if segments and length(cur) < merge_len:
            segments[-1] += cur
        else:
            segments.append(cur)
    return segments


# Where a sentence of text that arrives piece by piece is complete: end punctuation (the splitter's)
# followed by whitespace; full-width end punctuation at once; a line break.
_FULLWIDTH_ENDS = "。？！；："


def take_sentences(text: str, known: int = 0) -> tuple[list[str], str]:
    """The complete sentences at the front of ``text`` and the rest (:func:`take_sentence_slices`), each
    sentence stripped, none empty."""
    slices, rest = take_sentence_slices(text, known)
    return [s.strip() for s in slices if s.strip()], rest


def take_sentence_slices(text: str, known: int = 0) -> tuple[list[str], str]:
    """The complete sentences at the front of ``text`` (which grows as pieces arrive, e.g. an LLM's
    answer), and the rest, which waits for more text.

    A sentence ends at the splitter's end punctuation (``.?!;:``) once whitespace follows it (so
    ``3.5`` or a piece ending in ``.`` waits for the next character), with any closing quotes; at
    full-width ``。？！；：`` at once; and at a line break. The sentences are ``text``'s slices as they
    stand, the whitespace before each included (some are only whitespace): together with the rest they are
    ``text``. :func:`take_sentences` strips them; each is then normalized and split, like any text.

    ``known``: the length of a prefix of ``text`` that was the rest of an earlier call (text + the
    next piece): it holds no sentence end but perhaps at its very end, so the scan resumes there
    and text fed piece by piece is scanned once, not once per piece. The result is the same as
    with ``known=0``.
    """
    out: list[str] = []
    start = 0
    i = min(known, len(text))
    while i > 0 and (text[i - 1] in EN_PUNCT or text[i - 1] in _CLOSING_QUOTES):
        i -= 1  # end punctuation at the end of the known part waited for this text: look at it again
    n = len(text)
    while i < n:
        c = text[i]
        end = None
        if c == "\n" or c in _FULLWIDTH_ENDS:
            end = i + 1
        elif c in EN_PUNCT:
            j = i + 1
            while j < n and text[j] in _CLOSING_QUOTES:
                j += 1
            if j < n and text[j].isspace():
                end = j
            elif j >= n:
                break  # the next piece decides
            i = j - 1
        if end is not None:
            while end < n and text[end] in _CLOSING_QUOTES:
                end += 1
            out.append(text[start:end])
            start = i = end
            continue
        i += 1
    return out, text[start:]


class TextNormalizer:
    """The reference's ``text_normalize`` (wetext backend) with Russian numbers spelled in Russian.

    Safe to share between threads: wetext calls are serialized by a lock (its FST objects are
    shared native objects with no documented thread-safety). A wetext call holds the GIL for its
    whole length (about 1 s for 4,000 characters), so a server moves long texts to a helper
    process (:meth:`with_worker_process`; same output).
    """

    def __init__(self, tokenizer: TextTokenizer, *, shares: TextNormalizer | None = None, worker=None):
        """``shares``: a normalizer whose wetext objects (and their lock) this one uses instead of making
        its own; ``worker``: a :class:`~cosyllama.text.worker.WetextWorker` for long texts (see
        :meth:`with_worker_process`)."""
        from .worker import make_wetext_normalizers

        self.tokenizer = tokenizer
        if shares is not None:
            self._wetext_normalizers, self._lock = shares._wetext_normalizers, shares._lock
        else:
            try:
                self._wetext_normalizers = make_wetext_normalizers()
            except ImportError as e:
                raise MissingDependencyError("text normalization needs wetext>=0.1.8: "
                                             "pip install 'wetext>=0.1.8'") from e
            self._lock = threading.Lock()
        self._worker = worker

    def with_worker_process(self, min_chars: int | None = None) -> TextNormalizer:
        """A new normalizer sharing this one's wetext objects that normalizes texts of at least
        ``min_chars`` characters (default :data:`~cosyllama.text.worker.WORKER_MIN_CHARS`) in a
        helper process, started now, so that they do not stop this process's other threads; its
        :meth:`close_worker` ends the process."""
        from .worker import WORKER_MIN_CHARS, WetextWorker

        worker = WetextWorker(WORKER_MIN_CHARS if min_chars is None else min_chars)
        return TextNormalizer(self.tokenizer, shares=self, worker=worker)

    def close_worker(self) -> None:
        """Stop the helper process of :meth:`with_worker_process` (if any); normalize in place again."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    def _wetext(self, kind: str, text: str) -> str:
        """wetext's ``kind`` (``"en"``/``"zh"``) normalization of ``text``. Its grammars fail on a
        few inputs (``"10¢"``: an AssertionError in wetext 0.1.8), which is an input error naming
        the text, not a crash.

        wetext 0.1.8's English grammar also fails on a line break followed by other whitespace: a
        blank line between paragraphs, an indented line. The reference (which calls it unguarded)
        makes no audio of such a text, so nothing of its behaviour is at stake: such a text is
        normalized line by line, its non-blank lines joined by one space in English (the paragraph
        break a pause between sentences) and by nothing in Chinese (whose path drops line breaks
        and the spaces between CJK characters anyway). A text wetext reads whole is unchanged."""
        try:
            return self._wetext_whole(kind, text)
        except InputError:
            lines = [line for line in text.split("\n") if line.strip()]
            if len(lines) < 2:
                raise
        return (" " if kind == "en" else "").join(self._wetext_whole(kind, line) for line in lines)

    def _wetext_whole(self, kind: str, text: str) -> str:
        try:
            worker = self._worker
            out = worker.normalize(kind, text) if worker is not None else None
            if out is None:
                with self._lock:
                    out = self._wetext_normalizers[kind].normalize(text)
            return out
        except Exception as e:  # the library and its exception go to the log, not to the user
            shown = text if len(text) <= 80 else text[:77] + "..."
            log.warning("wetext (%s) failed on %r: %s: %s", kind, shown, type(e).__name__, e)
            raise InputError(f"the text normalizer cannot read {shown!r}; write out the symbols next to numbers "
                             "(e.g. '10¢' as '10 cents')") from e

    def normalize(self, text: str, split: bool = True, text_frontend: bool = True,
                  russian_numbers: bool = True) -> list[str] | str:
        """Normalize ``text``; return its segments (``split=True``) or one string.

        ``text_frontend=False`` or ``<|…|>`` markup in the text: returned unchanged (one segment).
        ``russian_numbers``: spell numbers of Cyrillic sentences in Russian (our deviation, on by
        default); off gives the reference's English words.
        """
        if not isinstance(text, str):
            raise InputError(f"text must be a str, got {type(text).__name__}")
        if not text_frontend or has_markup(text) or text == "":
            return [text] if split else text
        text = text.strip().replace("\r\n", "\n").replace("\r", "\n")  # wetext fails on a carriage return
        if contains_chinese(text):
            text = self._normalize_zh(text)
            segments = split_paragraph(text, len, "zh") if split else []
        else:
            if russian_numbers and _CYRILLIC_RE.search(text):
                text = expand_russian_sentences(text)
            text = spell_out_number(self._wetext("en", text))
            segments = split_paragraph(text, lambda s: len(self.tokenizer.encode(s)), "en") if split else []
        if not split:
            return text
        return [s for s in segments if not is_only_punctuation(s)]

    def _normalize_zh(self, text: str) -> str:
        text = self._wetext("zh", text).replace("\n", "")
        text = replace_blank(text)
        text = text.replace("²", "平方").replace("³", "立方")
        text = text.replace(".", "。").replace(" - ", "，")
        for c in ("（", "）", "【", "】", "`"):
            text = text.replace(c, "")
        text = text.replace("——", " ")
        return re.sub(r"[，,、]+$", "。", text)


def expand_russian_sentences(text: str) -> str:
    """Spell the numbers of every sentence that contains Cyrillic letters in Russian words."""
    from .russian import expand_numbers_ru

    parts = _SENTENCE_BOUNDARY_RE.split(text)  # sentences at even indices, the whitespace between at odd
    return "".join(expand_numbers_ru(p) if i % 2 == 0 and _CYRILLIC_RE.search(p) else p
                   for i, p in enumerate(parts))


# ----------------------------------------------------------------------------------------------
# Prompt conventions (see docs/reference.md#prompt-conventions); see the module docstring for the rules we chose.


def zero_shot_prompt_text(prompt_text: str) -> str:
    """The LLM prompt text for a transcript: verbatim if it has ``<|endofprompt|>``, else prefixed."""
    _check_text(prompt_text, "prompt text")
    return prompt_text if ENDOFPROMPT in prompt_text else DEFAULT_PROMPT_PREFIX + prompt_text


def instruct_prompt_text(instruction: str) -> str:
    """The LLM prompt text of instruct2 mode (never normalized)."""
    _check_text(instruction, "instruction")
    if ENDOFPROMPT in instruction:
        return instruction
    if not instruction.strip():
        raise InputError("instruction is empty; give what the voice should do, e.g. 'Please speak fast.'")
    return f"{SYSTEM_PROMPT} {instruction}{ENDOFPROMPT}"


def _check_text(text, what: str) -> None:
    if not isinstance(text, str):
        raise InputError(f"{what} must be a str, got {type(text).__name__}")

