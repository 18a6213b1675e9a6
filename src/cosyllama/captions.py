"""Where each sentence is in the audio, and captions made from it (SRT, WebVTT, JSON).

Each segment the frontend cuts is synthesized on its own and its audio is appended to the output, so a
synthesis knows, to the sample, where each segment starts and ends: :class:`Segment` records it (the
``start_sample``/``end_sample`` of the concatenated output; ``start``/``end`` in seconds), streamed or not, at
any speed. ``Synthesis.segments`` lists them as they finish. Word times (``words``) come from forced alignment
when it ran; None otherwise.

The caption writers follow common subtitle practice: at most 2 lines of at most :data:`MAX_LINE` characters and
at most :data:`MAX_CUE_S` seconds per cue. A segment longer than that becomes several cues, cut at word
boundaries, when its word times are known; without them one cue carries the whole segment (wrapped onto more
lines), because cutting it would have to guess where the words fall.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .text.tokenizer import ENDOFPROMPT, MARKUP_TOKENS

FORMATS = ("srt", "vtt", "json")
MAX_LINE = 42  # characters per caption line
MAX_LINES = 2
MAX_CUE_S = 7.0  # seconds per cue


@dataclass(frozen=True)
class Word:
    """One word's time in the output, in seconds."""

    word: str
    start: float
    end: float


@dataclass(frozen=True)
class Segment:
    """One synthesized segment (a sentence, or the part of one the frontend cut) and where it is in the
    output: samples ``[start_sample, end_sample)`` of the concatenated audio at ``sample_rate``. ``text`` is the
    segment as the model spoke it (after text normalization). ``words``: aligned word times, or None when
    no alignment ran or it failed (``words_why`` says which). ``voice``: the speaker's name, where a script
    names one."""

    index: int
    text: str
    start_sample: int
    end_sample: int
    sample_rate: int
    words: tuple[Word, ...] | None = None
    words_why: str | None = None
    voice: str | None = None

    @property
    def start(self) -> float:
        return self.start_sample / self.sample_rate

    @property
    def end(self) -> float:
        return self.end_sample / self.sample_rate

    def as_dict(self) -> dict:
        d = {"text": self.text, "start": round(self.start, 6), "end": round(self.end, 6),
             "start_sample": self.start_sample, "end_sample": self.end_sample,
             "words": None if self.words is None else
             [{"word": w.word, "start": round(w.start, 6), "end": round(w.end, 6)} for w in self.words]}
        if self.voice is not None:
            d["voice"] = self.voice
        if self.words is None and self.words_why:
            d["words_why"] = self.words_why
        return d


_MARKUP = re.compile("|".join(re.escape(t) for t in MARKUP_TOKENS))


def spoken_text(segment_text: str) -> str:
    """The part of a segment's LLM text that is spoken, as captions show it: what follows its last
    ``<|endofprompt|>`` (cross-lingual segments carry the system prefix before it), without the model's
    markup (``<strong>``, ``[breath]``, ...)."""
    text = _MARKUP.sub("", segment_text.rsplit(ENDOFPROMPT, 1)[-1])
    return " ".join(text.split())


class CaptionError(ValueError):
    """A caption file that cannot be written (its format, its place)."""


def caption_format(path: str | Path) -> str:
    """The format of a caption file by its suffix (``srt``, ``vtt``, ``json``), or CaptionError."""
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise CaptionError(f"captions {str(path)!r}: the file name must end in "
                           f"{', '.join('.' + f for f in FORMATS)} (it names the format)")
    return fmt


@dataclass(frozen=True)
class Cue:
    start: float
    end: float
    text: str
    voice: str | None = None


def _lines(text: str) -> str:
    return "\n".join(textwrap.wrap(" ".join(text.split()), MAX_LINE)) or text.strip()


def _fits(text: str, seconds: float) -> bool:
    return seconds <= MAX_CUE_S and len(textwrap.wrap(text, MAX_LINE)) <= MAX_LINES


def cues(segments: Iterable[Segment]) -> list[Cue]:
    """The caption cues of ``segments``: one per segment, or several per long segment cut at word boundaries
    where its word times are known."""
    out: list[Cue] = []
    for seg in segments:
        text = " ".join(seg.text.split())
        if not text or seg.end_sample <= seg.start_sample:
            continue
        if seg.words and not _fits(text, seg.end - seg.start):
            out.extend(_word_cues(seg))
        else:
            out.append(Cue(seg.start, seg.end, _lines(text), seg.voice))
    return out


def _word_cues(seg: Segment) -> list[Cue]:
    """Cut a long segment into cues at word boundaries: each cue takes words while its text fits the line
    limits and its span :data:`MAX_CUE_S`; the first starts at the segment's start, the last ends at its end."""
    words = list(seg.words or ())
    groups: list[list[Word]] = [[]]
    for w in words:
        g = groups[-1]
        if g and not _fits(" ".join(x.word for x in g + [w]), w.end - g[0].start):
            groups.append([w])
        else:
            g.append(w)
    out = []
    for i, g in enumerate(groups):
        start = seg.start if i == 0 else g[0].start
        end = seg.end if i == len(groups) - 1 else groups[i + 1][0].start
        out.append(Cue(start, max(end, start), _lines(" ".join(w.word for w in g)), seg.voice))
    return out


def _stamp(seconds: float, sep: str) -> str:
    ms = int(round(max(0.0, seconds) * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def to_srt(segments: Iterable[Segment]) -> str:
    """SubRip: numbered cues, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``; a named voice as ``[name]`` before the text."""
    blocks = []
    for i, c in enumerate(cues(segments), 1):
        text = f"[{c.voice}] {c.text}" if c.voice else c.text
        blocks.append(f"{i}\n{_stamp(c.start, ',')} --> {_stamp(c.end, ',')}\n{text}\n")
    return "\n".join(blocks)


def _vtt_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_vtt(segments: Iterable[Segment]) -> str:
    """WebVTT: ``WEBVTT``, then cues ``HH:MM:SS.mmm --> HH:MM:SS.mmm``; a named voice as ``<v name>``."""
    blocks = ["WEBVTT\n"]
    for c in cues(segments):
        text = _vtt_escape(c.text)
        if c.voice:
            text = f"<v {_vtt_escape(c.voice)}>{text}"
        blocks.append(f"{_stamp(c.start, '.')} --> {_stamp(c.end, '.')}\n{text}\n")
    return "\n".join(blocks)


def to_json(segments: Iterable[Segment]) -> str:
    """The JSON schema of docs/captions.md: ``{"level", "sample_rate", "segments": [{text, start, end,
    start_sample, end_sample, words}]}``, seconds; ``level`` is ``word`` when every segment has word times."""
    segs = list(segments)
    level = "word" if segs and all(s.words is not None for s in segs) else "segment"
    rate = segs[0].sample_rate if segs else None
    return json.dumps({"level": level, "sample_rate": rate, "segments": [s.as_dict() for s in segs]},
                      ensure_ascii=False, indent=1) + "\n"


WRITERS = {"srt": to_srt, "vtt": to_vtt, "json": to_json}  # one per name in FORMATS


def write_captions(path: str | Path, segments: Sequence[Segment]) -> Path:
    """Write ``segments`` as captions to ``path`` in the format its suffix names; CaptionError (naming the
    path) when the format is unknown or the file cannot be written."""
    path = Path(path)
    text = WRITERS[caption_format(path)](segments)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise CaptionError(f"captions {str(path)!r} cannot be written: {e.strerror or e}") from None
    return path
