"""Text frontend: the Qwen2 BPE tokenizer with CosyVoice3's special tokens, text normalization,
sentence/segment splitting and the CosyVoice3 prompt conventions (see docs/reference.md#text).

Tokenizer. ``CosyVoice-BlankEN/`` holds a Qwen2 byte-level BPE (``vocab.json`` + ``merges.txt``,
added tokens in ``tokenizer_config.json``). We assemble the same tokenizer with the ``tokenizers``
library alone (NFC, the Qwen2 pre-tokenizer regex, byte-level BPE) and append CosyVoice3's 280
special tokens in the reference order, so ``<|endofprompt|>`` is 151646 and the text vocabulary
has 151924 ids. transformers is not needed.

Normalization follows the reference (wetext 0.1.8, punctuation and length rules) with one
deliberate change: in a sentence that contains Cyrillic letters, numbers are spelled in Russian
(:mod:`cosyllama.text_ru`) instead of the reference's English words. Text containing ``<|``…``|>``
markup is never normalized or split (reference rule).

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

import copy
import json
import re
import threading
import unicodedata
from pathlib import Path

from .errors import InputError, MissingDependencyError, ModelDirError

ENDOFPROMPT = "<|endofprompt|>"
ENDOFPROMPT_ID = 151646  # hard-coded by the reference LLM (an assertion there)
TEXT_VOCAB_SIZE = 151924  # ids 0 .. 151923: Qwen2 BPE + Qwen2 specials + CosyVoice3 specials
SYSTEM_PROMPT = "You are a helpful assistant."  # the reference's system sentence (example.py)
DEFAULT_PROMPT_PREFIX = SYSTEM_PROMPT + ENDOFPROMPT

# The Qwen2 pre-tokenizer: contractions, letter runs (with one leading non-letter), single digits,
# punctuation runs, newlines and whitespace.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CONTROL_TOKENS = (
    "<|im_start|>", "<|im_end|>", ENDOFPROMPT, "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]", "<|endofsystem|>",
)
_ARPABET_TOKENS = tuple("""
[AA] [AA0] [AA1] [AA2] [AE] [AE0] [AE1] [AE2] [AH] [AH0] [AH1] [AH2] [AO] [AO0] [AO1] [AO2] [AW]
[AW0] [AW1] [AW2] [AY] [AY0] [AY1] [AY2] [B] [CH] [D] [DH] [EH] [EH0] [EH1] [EH2] [ER] [ER0] [ER1]
[ER2] [EY] [EY0] [EY1] [EY2] [F] [G] [HH] [IH] [IH0] [IH1] [IH2] [IY] [IY0] [IY1] [IY2] [JH] [K] [L]
[M] [N] [NG] [OW] [OW0] [OW1] [OW2] [OY] [OY0] [OY1] [OY2] [P] [R] [S] [SH] [T] [TH] [UH] [UH0]
[UH1] [UH2] [UW] [UW0] [UW1] [UW2] [V] [W] [Y] [Z] [ZH]
""".split())
# Tone-marked vowels are single precomposed (NFC) code points.
_PINYIN_TOKENS = tuple("""
[a] [ai] [an] [ang] [ao] [b] [c] [ch] [d] [e] [ei] [en] [eng] [f] [g] [h] [i] [ian] [in] [ing] [iu]
[ià] [iàn] [iàng] [iào] [iá] [ián] [iáng] [iáo] [iè] [ié] [iòng] [ióng] [iù] [iú] [iā] [iān] [iāng]
[iāo] [iē] [iě] [iōng] [iū] [iǎ] [iǎn] [iǎng] [iǎo] [iǒng] [iǔ] [j] [k] [l] [m] [n] [o] [ong] [ou]
[p] [q] [r] [s] [sh] [t] [u] [uang] [ue] [un] [uo] [uà] [uài] [uàn] [uàng] [uá] [uái] [uán] [uáng]
[uè] [ué] [uì] [uí] [uò] [uó] [uā] [uāi] [uān] [uāng] [uē] [uě] [uī] [uō] [uǎ] [uǎi] [uǎn] [uǎng]
[uǐ] [uǒ] [vè] [w] [x] [y] [z] [zh] [à] [ài] [àn] [àng] [ào] [á] [ái] [án] [áng] [áo] [è] [èi] [èn]
[èng] [èr] [é] [éi] [én] [éng] [ér] [ì] [ìn] [ìng] [í] [ín] [íng] [ò] [òng] [òu] [ó] [óng] [óu] [ù]
[ùn] [ú] [ún] [ā] [āi] [ān] [āng] [āo] [ē] [ēi] [ēn] [ēng] [ě] [ěi] [ěn] [ěng] [ěr] [ī] [īn] [īng]
[ō] [ōng] [ōu] [ū] [ūn] [ǎ] [ǎi] [ǎn] [ǎng] [ǎo] [ǐ] [ǐn] [ǐng] [ǒ] [ǒng] [ǒu] [ǔ] [ǔn] [ǘ] [ǚ] [ǜ]
""".split())
# eos/pad first, then the reference's `additional_special_tokens`, in this exact order (see
# docs/reference.md#tokenizer).
SPECIAL_TOKENS = ("<|endoftext|>",) + _CONTROL_TOKENS + _ARPABET_TOKENS + _PINYIN_TOKENS


# ----------------------------------------------------------------------------------------------
# Tokenizer


class TextTokenizer:
    """Qwen2 byte-level BPE + CosyVoice3 special tokens. Thread-safe (``tokenizers`` encodes
    without shared mutable state).

    :meth:`encode` returns plain ids, no BOS/EOS; special tokens written literally in the text
    (``<|endofprompt|>``, ``[breath]``, ``[j][ǐ]``) become single ids.
    """

    def __init__(self, qwen_dir: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # a core dependency; only a broken install gets here
            raise MissingDependencyError("the 'tokenizers' package is needed: pip install tokenizers") from e
        qwen_dir = Path(qwen_dir)
        vocab_path, merges_path = qwen_dir / "vocab.json", qwen_dir / "merges.txt"
        try:
            vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
            merges = [line for line in merges_path.read_text(encoding="utf-8").splitlines()
                      if line and not line.startswith("#version")]
        except (OSError, json.JSONDecodeError) as e:
            raise ModelDirError(f"{qwen_dir}: cannot read the Qwen2 tokenizer files vocab.json/merges.txt: {e}") from e

        added = self._read_added_tokens(qwen_dir / "tokenizer_config.json")
        known = {**vocab, **{t["content"]: t["id"] for t in added}}
        next_id = max(known.values()) + 1
        for token in SPECIAL_TOKENS:  # existing tokens keep their id, new ones get consecutive ids
            if token in known:
                if all(t["content"] != token for t in added):
                    added.append(_added_token(token, known[token]))
                continue
            added.append(_added_token(token, next_id))
            known[token] = next_id
            next_id += 1

        spec = {
            "version": "1.0",
            "added_tokens": sorted(added, key=lambda t: t["id"]),
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_PRETOKENIZE_REGEX}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ]},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                      "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                      # The added tokens are listed in the BPE vocabulary as well: `tokenizers`
                      # re-numbers added tokens it cannot find in the model when it loads.
                      "vocab": {**vocab, **{t["content"]: t["id"] for t in added}}, "merges": merges},
        }
        try:
            self._tok = Tokenizer.from_str(json.dumps(spec))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelDirError(f"{qwen_dir}: the Qwen2 tokenizer files do not form a valid BPE: {e}") from e
        self._n_entries = len({**vocab, **{t["content"]: t["id"] for t in added}})

        eop = self._tok.token_to_id(ENDOFPROMPT)
        last = self._tok.token_to_id(SPECIAL_TOKENS[-1])
        if eop != ENDOFPROMPT_ID or last != TEXT_VOCAB_SIZE - 1:
            raise ModelDirError(
                f"{qwen_dir}: this tokenizer gives {ENDOFPROMPT} id {eop} and {SPECIAL_TOKENS[-1]} id {last}; "
                f"CosyVoice3 needs {ENDOFPROMPT_ID} and {TEXT_VOCAB_SIZE - 1} (a Qwen2 vocabulary of 151643 "
                "BPE ids plus <|endoftext|>, <|im_start|>, <|im_end|>)")

    @staticmethod
    def _read_added_tokens(path: Path) -> list[dict]:
        if not path.is_file():
            return []
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ModelDirError(f"{path}: cannot read tokenizer_config.json: {e}") from e
        out = []
        for tid, t in (cfg.get("added_tokens_decoder") or {}).items():
            tok = _added_token(t["content"], int(tid), special=bool(t.get("special", True)))
            tok.update({k: bool(t.get(k, False)) for k in ("lstrip", "rstrip", "single_word")})
            tok["normalized"] = bool(t.get("normalized", False))
            out.append(tok)
        return out

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __len__(self) -> int:
        """Number of entries (BPE + added tokens), as ``len()`` of an HF tokenizer."""
        return self._n_entries


def _added_token(content: str, tid: int, special: bool = True) -> dict:
    return {"id": tid, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


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


def take_sentences(text: str) -> tuple[list[str], str]:
    """The complete sentences at the front of ``text`` (which grows as pieces arrive, e.g. an LLM's
    answer), and the rest, which waits for more text.

    A sentence ends at the splitter's end punctuation (``.?!;:``) once whitespace follows it (so
    ``3.5`` or a piece ending in ``.`` waits for the next character), with any closing quotes; at
    full-width ``。？！；：`` at once; and at a line break. The sentences are stripped and never
    empty; they are then normalized and split one by one, like any text.
    """
    out: list[str] = []
    start = i = 0
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
            sentence = text[start:end].strip()
            if sentence:
                out.append(sentence)
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

    def __init__(self, tokenizer: TextTokenizer):
        from .text_worker import make_wetext_normalizers

        self.tokenizer = tokenizer
        try:
            self._wetext_normalizers = make_wetext_normalizers()
        except ImportError as e:
            raise MissingDependencyError("text normalization needs wetext>=0.1.8: pip install 'wetext>=0.1.8'") from e
        self._lock = threading.Lock()
        self._worker = None

    def with_worker_process(self, min_chars: int | None = None) -> TextNormalizer:
        """A copy of this normalizer (same wetext objects) that normalizes texts of at least
        ``min_chars`` characters (default :data:`~cosyllama.text_worker.WORKER_MIN_CHARS`) in a
        helper process, started now, so that they do not stop this process's other threads; its
        :meth:`close_worker` ends the process."""
        from .text_worker import WORKER_MIN_CHARS, WetextWorker

        twin = copy.copy(self)
        twin._worker = WetextWorker(WORKER_MIN_CHARS if min_chars is None else min_chars)
        return twin

    def close_worker(self) -> None:
        """Stop the helper process of :meth:`with_worker_process` (if any); normalize in place again."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    def _wetext(self, kind: str, text: str) -> str:
        """wetext's ``kind`` (``"en"``/``"zh"``) normalization of ``text``. Its grammars fail on a
        few inputs (``"10¢"``: an AssertionError in wetext 0.1.8), which is an input error naming
        the text, not a crash."""
        try:
            worker = self._worker
            out = worker.normalize(kind, text) if worker is not None else None
            if out is None:
                with self._lock:
                    out = self._wetext_normalizers[kind].normalize(text)
            return out
        except Exception as e:
            shown = text if len(text) <= 80 else text[:77] + "..."
            raise InputError(f"the text normalizer (wetext) fails on {shown!r} ({type(e).__name__}); "
                             "write out the symbols next to numbers (e.g. '10¢' as '10 cents')") from e

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
        text = text.strip()
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
    from .text_ru import expand_numbers_ru

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

