"""Word times by forced alignment: where each word of a known text is in an audio clip.

The aligner is PocketSphinx (``pip install 'cosyllama[align]'``): its wheel ships a US-English acoustic model
and the CMU pronouncing dictionary, so English works offline with nothing else. It was chosen by measurement
(docs/captions.md has the numbers and how they were made): on English that espeak-ng speaks, word onsets are
within a few tens of milliseconds of espeak-ng's own, at about 1 % of real time on 2 cores.

Other languages use an aligner model the user provides, in the same form: a directory per language code under
``aligner_dir`` (or ``$COSYLLAMA_ALIGNERS``), each holding one PocketSphinx acoustic model (a folder with its
``mdef``) and one pronouncing dictionary (``*.dict``). Nothing is ever downloaded.

Alignment runs the decoder over a grammar that is exactly the text's words, with optional silence between
them. When no path through that grammar fits the audio, or the one found is implausible (most of the span
silence, or many words squeezed to the shortest duration the model allows), the text does not match the audio
and :class:`AlignError` says so: word times are never guessed.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .captions import Word
from .errors import InputError

log = logging.getLogger("cosyllama.alignment")

INSTALL_HINT = "word times need PocketSphinx: pip install 'cosyllama[align]'"
ALIGNERS_ENV = "COSYLLAMA_ALIGNERS"
FRAME_S = 0.01  # PocketSphinx's frame step
MIN_AUDIO_S = 0.1
SILENT_PEAK = 1e-4  # below this the clip has no speech to align
# Plausibility of an alignment (module docstring). On espeak-ng's English (scripts/measure_alignment.py, three
# voices, four renditions each: espeak-ng varies a little from call to call) the text's own alignment had at most
# 41 % of its span silent and 2 of 7 words (29 %) at their minimum length; alignments of another sentence's text
# to the same audio, where the decoder found a path at all, mostly exceeded one or the other.
MAX_SILENCE_SHARE = 0.6
MAX_SQUEEZED_SHARE = 0.34  # and at least MIN_SQUEEZED words
MIN_SQUEEZED = 3
MAX_FRAMES_PER_PHONE = 40  # a word held for 0.4 s a phone on average: the text's 18 at most there
# Wide beams first: narrower ones lose the grammar's only path on fast speech. Without silence fillers second:
# on a few clips the filler model swallows a short word and the search ends off the grammar.
_SEARCHES = ({"beam": 1e-200, "wbeam": 1e-150, "pbeam": 1e-200, "maxhmmpf": -1},
             {"beam": 1e-200, "wbeam": 1e-150, "pbeam": 1e-200, "maxhmmpf": -1, "fsgusefiller": False})
_FILLERS = ("<s>", "</s>", "<sil>", "(NULL)")

# English words missing from the dictionary (names, coinages) are spelled with one ARPAbet phone per letter or
# common digraph: a rough pronunciation, but the decoder only needs one to place the word between its
# neighbours.
_DIGRAPHS = {"th": "TH", "sh": "SH", "ch": "CH", "ph": "F", "ng": "NG", "ck": "K", "qu": "K W", "ee": "IY",
             "ea": "IY", "oo": "UW", "ai": "EY", "ay": "EY", "ou": "AW", "ow": "OW", "oi": "OY", "oy": "OY",
             "wh": "W", "gh": "G"}
_LETTERS = {"a": "AE", "b": "B", "c": "K", "d": "D", "e": "EH", "f": "F", "g": "G", "h": "HH", "i": "IH",
            "j": "JH", "k": "K", "l": "L", "m": "M", "n": "N", "o": "AA", "p": "P", "q": "K", "r": "R", "s": "S",
            "t": "T", "u": "AH", "v": "V", "w": "W", "x": "K S", "y": "Y", "z": "Z"}


class AlignError(InputError):
    """Word times cannot be made: no aligner for the language, audio too short or silent, no words in the
    text, or a text that does not match the audio. The message says which."""


@dataclass(frozen=True)
class Alignment:
    """The words of a text with their times in the clip (seconds from its start), the language aligned, and
    what it cost (wall seconds)."""

    words: tuple[Word, ...]
    language: str
    seconds: float


LANGUAGE_CODE = re.compile(r"[a-z]{2,3}(?:[-_][a-z0-9]{2,8})?")


def check_language(code: str) -> None:
    """Refuse what is not a language code (it names a folder of the aligner directory)."""
    if not LANGUAGE_CODE.fullmatch(code):
        raise AlignError(f"{code[:20]!r} is not a language code (like en, de or pt-br)")


def language_of(text: str) -> str:
    """The language code an aligner is looked up by, from the text's script: Han → zh, kana → ja, Hangul → ko,
    Cyrillic → ru, otherwise en (Latin script: pass ``language`` for the other Latin-script languages)."""
    if re.search(r"[\u3040-\u30ff]", text):
        return "ja"
    if re.search(r"[\uac00-\ud7af]", text):
        return "ko"
    if re.search(r"[\u4e00-\u9fff]", text):
        return "zh"
    if re.search(r"[\u0400-\u04ff]", text):
        return "ru"
    return "en"


def _pocketsphinx():
    try:
        import pocketsphinx
    except ImportError:
        raise AlignError(INSTALL_HINT) from None
    return pocketsphinx


@dataclass(frozen=True)
class _Model:
    hmm: str | None  # None: the wheel's en-us model and dictionary
    dict: str | None


def _find_model(language: str, aligner_dir: str | Path | None) -> _Model:
    root = aligner_dir if aligner_dir is not None else os.environ.get(ALIGNERS_ENV)
    if root:
        d = Path(root).expanduser() / language
        if d.is_dir():
            hmms = sorted(p.parent for p in d.glob("*/mdef")) + ([d] if (d / "mdef").exists() else [])
            dicts = sorted(d.glob("*.dict"))
            if len(hmms) != 1 or len(dicts) != 1:
                raise AlignError(f"the aligner model for {language!r} must hold one acoustic model (a folder with "
                                 f"its mdef) and one *.dict file; found {len(hmms)} and {len(dicts)}")
            return _Model(str(hmms[0]), str(dicts[0]))
    if language == "en":
        return _Model(None, None)
    where = f"{ALIGNERS_ENV} or --aligner-dir" if not root else "the aligner directory"
    raise AlignError(f"no word aligner for language {language!r}: English is built in; for another language put "
                     f"a PocketSphinx model in <dir>/{language}/ and name <dir> with {where} (docs/captions.md)")


class _Decoders:
    """One PocketSphinx decoder per (model, search), made on first use; a decoder is not thread-safe, so
    each is used under its lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._made: dict[tuple, tuple[object, threading.Lock]] = {}

    def get(self, model: _Model, search: int):
        key = (model, search)
        with self._lock:
            if key not in self._made:
                ps = _pocketsphinx()
                kw = dict(_SEARCHES[search], lm=None, bestpath=False, loglevel="FATAL", cmn="batch")
                if model.hmm is not None:
                    kw.update(hmm=model.hmm, dict=model.dict)
                try:
                    dec = ps.Decoder(**kw)
                except (RuntimeError, ValueError) as e:
                    raise AlignError(f"the aligner model could not be loaded ({e})") from None
                self._made[key] = (dec, threading.Lock())
            return self._made[key]


_DECODERS = _Decoders()


def _letters_to_phones(word: str) -> str:
    phones, i = [], 0
    while i < len(word):
        if word[i:i + 2] in _DIGRAPHS:
            p, i = _DIGRAPHS[word[i:i + 2]], i + 2
        else:
            p, i = _LETTERS.get(word[i]), i + 1
        if p and (not phones or phones[-1] != p):
            phones.append(p)
    return " ".join(phones)


def _number_words(digits: str) -> str:
    """An English number as words: ``21`` → twenty one, ``21st`` → twenty first; a long run digit by digit."""
    from num2words import num2words

    n, ordinal = re.fullmatch(r"(\d+)(st|nd|rd|th)?", digits).groups()
    if len(n) > 15:
        return " ".join(num2words(int(c), lang="en") for c in n)
    return num2words(int(n), lang="en", to="ordinal" if ordinal else "cardinal").replace("-", " ").replace(",", "")


def _units(token: str, language: str, dec, english_rules: bool) -> list[str]:
    """The dictionary words that ``token`` (one whitespace-separated piece of the text) is spoken as."""
    core = token.lower().replace("\u2019", "'").strip(".,;:!?\"'()[]{}<>«»“”‘’…-–—*_/\\")
    if not core:
        return []
    if dec.lookup_word(core) is not None:
        return [core]
    units = []
    pieces = [q for part in re.split(r"[^\w']+", core) for q in re.findall(r"\d+(?:st|nd|rd|th)?|[^\d]+", part)]
    for part in pieces:
        part = part.strip("'_")
        if not part:
            continue
        if language == "en" and re.fullmatch(r"\d+(?:st|nd|rd|th)?", part):
            units += _units(_number_words(part), language, dec, english_rules)
        elif dec.lookup_word(part) is not None:
            units.append(part)
        elif english_rules:  # spelled by its letters; a piece with none (a symbol: ², ™) takes no time of its own
            letters = re.sub(r"[^a-z]", "", part)
            if letters and dec.lookup_word(letters) is None:
                try:
                    dec.add_word(letters, _letters_to_phones(letters), True)
                except RuntimeError:
                    raise AlignError(f"the word {part!r} could not be given a pronunciation") from None
            if letters:
                units.append(letters)
        else:
            raise AlignError(f"the word {part!r} is not in the {language!r} aligner's dictionary")
    return units


def _pcm16(audio: np.ndarray, sample_rate: int, rate: int) -> bytes:
    import torch

    from .audio import resample

    x = resample(torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32)), sample_rate, rate).numpy()
    return (np.clip(x, -1.0, 1.0) * 32767).astype(np.int16).tobytes()


def align(audio, sample_rate: int, text: str, language: str | None = None, *,
          aligner_dir: str | Path | None = None) -> Alignment:
    """Each whitespace-separated word of ``text`` with its start and end in ``audio`` (mono float samples at
    ``sample_rate``), in seconds from the clip's start. ``language``: an aligner's code (None: from the text's
    script, :func:`language_of`). Raises :class:`AlignError` with the reason when it cannot."""
    t0 = time.perf_counter()
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 1:
        raise AlignError("align takes mono audio (one channel)")
    if audio.size < MIN_AUDIO_S * sample_rate:
        raise AlignError(f"the audio is too short to align ({audio.size / sample_rate:.3f} s)")
    if not np.isfinite(audio).all() or float(np.abs(audio).max()) < SILENT_PEAK:
        raise AlignError("the audio is silent: there is no speech to align")
    language = (language or language_of(text)).strip().lower()
    check_language(language)
    tokens = [m.group() for m in re.finditer(r"\S+", text)]
    model = _find_model(language, aligner_dir)
    for search in range(len(_SEARCHES)):
        dec, lock = _DECODERS.get(model, search)
        with lock:
            units = [_units(tok, language, dec, model.hmm is None) for tok in tokens]
            flat = [u for us in units for u in us]
            if not flat:
                raise AlignError("the text has no words to align")
            rate = int(float(dec.config["samprate"]))
            dec.set_align_text(" ".join(flat))
            dec.start_utt()
            dec.process_raw(_pcm16(audio, sample_rate, rate), full_utt=True)
            dec.end_utt()
            segs = dec.seg()
            segs = None if segs is None else [(s.word, s.start_frame, s.end_frame + 1) for s in segs]
        if segs is not None:
            break
    else:
        raise AlignError("the text does not match the audio (the aligner found no way to say it in this audio)")
    spoken = [s for s in segs if s[0] not in _FILLERS and not s[0].startswith("[")]
    if len(spoken) != len(flat):
        raise AlignError("the text does not match the audio (the aligner lost words)")
    _check_plausible(segs, spoken, dec)
    words, k = [], 0
    for tok, us in zip(tokens, units):
        if not us:  # a token of punctuation only: it takes no time of its own
            continue
        first, last = spoken[k], spoken[k + len(us) - 1]
        k += len(us)
        words.append(Word(tok, round(first[1] * FRAME_S, 3), round(last[2] * FRAME_S, 3)))
    return Alignment(tuple(words), language, time.perf_counter() - t0)


def _check_plausible(segs, spoken, dec) -> None:
    start, end = spoken[0][1], spoken[-1][2]
    silent = sum(b - a for w, a, b in segs if (w in _FILLERS or w.startswith("[")) and a >= start and b <= end)
    if end > start and silent / (end - start) > MAX_SILENCE_SHARE:
        raise AlignError("the text does not match the audio (most of its words' span aligned to silence)")
    squeezed = 0
    for w, a, b in spoken:
        phones = dec.lookup_word(w)
        n = len(phones.split()) if phones else 1
        if b - a <= 3 * n + 1:
            squeezed += 1
        if n > 1 and b - a > MAX_FRAMES_PER_PHONE * n:
            raise AlignError(f"the text does not match the audio (one word held for {(b - a) * FRAME_S:.1f} s)")
    if squeezed >= MIN_SQUEEZED and squeezed / len(spoken) > MAX_SQUEEZED_SHARE:
        raise AlignError("the text does not match the audio (many words aligned to the shortest time they allow)")


class WordTimer:
    """The word times of a synthesis (``SynthesisOptions.word_times``): each finished segment's audio is
    handed over with :meth:`add` and aligned by :meth:`finish`, which the synthesis calls once that segment's
    final chunk has been yielded, so alignment never delays the audio. A segment that cannot be aligned keeps
    ``words`` None and says why in ``words_why``; a segment with no words to speak gets ``()``. ``timings``: an
    object whose ``align`` attribute sums the seconds spent. Language: from each segment's script, or
    ``$COSYLLAMA_ALIGNERS`` for the models of other languages (:func:`align`)."""

    def __init__(self, segments: list, timings=None, language: str | None = None):
        self._segments, self._timings, self._language = segments, timings, language
        self._pending: list[tuple[int, np.ndarray]] = []
        self._lock = threading.Lock()

    def add(self, index: int, audio: np.ndarray) -> None:
        with self._lock:
            self._pending.append((index, audio))

    def finish(self) -> None:
        with self._lock:
            while self._pending:
                index, audio = self._pending.pop(0)
                self._segments[index] = self._aligned(self._segments[index], audio)

    def _aligned(self, seg, audio: np.ndarray):
        from dataclasses import replace

        if not re.search(r"\w", seg.text):
            return replace(seg, words=())
        t0 = time.perf_counter()
        try:
            found = align(audio, seg.sample_rate, seg.text, self._language)
        except AlignError as e:
            return replace(seg, words_why=str(e))
        except Exception:  # word times are an extra: a fault in them never ends a synthesis
            log.exception("word alignment failed")
            return replace(seg, words_why="word alignment failed (an internal error; the server's log has it)")
        finally:
            if self._timings is not None:
                self._timings.align += time.perf_counter() - t0
        words = tuple(Word(w.word, round(seg.start + w.start, 3), round(min(seg.start + w.end, seg.end), 3))
                      for w in found.words)
        return replace(seg, words=words)


_SENTENCE_END = re.compile(r"[.!?。！？…]+[\"'”’»)\]]*$")


def sentences(alignment: Alignment, sample_rate: int):
    """The aligned words grouped into sentences (a word ending in ``.``, ``!``, ``?`` or their CJK forms ends
    one), each a :class:`~cosyllama.captions.Segment` from its first word's start to its last word's end, for
    caption files of any audio (``cosyllama align``)."""
    from .captions import Segment

    groups, current = [], []
    for w in alignment.words:
        current.append(w)
        if _SENTENCE_END.search(w.word):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return [Segment(i, " ".join(w.word for w in g), round(g[0].start * sample_rate), round(g[-1].end * sample_rate),
                    sample_rate, words=tuple(g)) for i, g in enumerate(groups)]
