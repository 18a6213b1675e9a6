"""An SSML subset: a ``<speak>`` document -> a list of parts to synthesize (docs/pronunciation.md#ssml-subset).

:func:`parse_ssml` returns data and synthesizes nothing: an :class:`SsmlDocument` whose ``parts`` are

* :class:`Span`: text to speak with its voice name (``<voice name>``, None: the request's) and speed
  (``<prosody rate>``, a multiplier in 0.25-4.0). The text is ready for the frontend: ``<sub alias>``
  is its alias, ``<phoneme>`` an inline pronunciation ``{word|[tokens]}`` (:mod:`.lexicon`),
  ``<emphasis>`` CosyVoice3's ``<strong>…</strong>``;
* :class:`Break`: a silence of exactly ``seconds`` (``<break time|strength>``, at most 10 s);
* :class:`Boundary`: a segment boundary (where a ``<p>`` or ``<s>`` starts or ends): the text before
  and after it are separate segments.

Adjacent text with the same voice and speed is one span. An element outside the subset is reported
once in ``warnings`` and its text is spoken. The document is parsed by the standard library's expat
with every DTD refused (so no entity can be declared: no billion laughs, no external entities),
within bounds on size, depth and element count; malformed XML is an :class:`SsmlError` naming the
line and column.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from xml.parsers import expat

from ..defaults import SPEED_RANGE
from ..errors import InputError
from .lexicon import LexiconError, inline_form, parse_tokens
from .spellings import arpabet_tokens, pinyin_tokens

MAX_SSML_CHARS = 200_000  # a longer document is refused before parsing
MAX_DEPTH = 32  # elements nested deeper are refused
MAX_ELEMENTS = 10_000  # and documents with more elements
MAX_BREAK_SECONDS = 10.0  # a longer <break> is cut to this (with a warning)

# <prosody rate> keywords -> speed multiplier (the engine's speed, SynthesisOptions.speed)
RATE_KEYWORDS = {"x-slow": 0.5, "slow": 0.75, "medium": 1.0, "default": 1.0, "fast": 1.5, "x-fast": 2.0}
# <break strength> -> seconds (SSML's default strength is medium)
BREAK_STRENGTHS = {"none": 0.0, "x-weak": 0.1, "weak": 0.25, "medium": 0.5, "strong": 0.75, "x-strong": 1.0}
# <phoneme alphabet> values understood
ALPHABETS = ("x-pinyin", "x-arpabet", "x-cosyvoice")

_TIME_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*(ms|s)\s*$", re.IGNORECASE)
_RATE_RE = re.compile(r"^\s*([+-]?)(\d+(?:\.\d+)?|\.\d+)\s*(%?)\s*$")
_KNOWN = {"speak", "voice", "prosody", "phoneme", "sub", "emphasis", "break", "p", "s"}
_IGNORED_ATTRS = {"xmlns", "version", "xml:lang", "xml:base", "xmlns:xsi", "xsi:schemaLocation"}


class SsmlError(InputError):
    """An SSML document that cannot be used (malformed, refused, a bad attribute); the message says
    where (line and column)."""


@dataclass(frozen=True)
class Span:
    """Text to speak: ``text`` (for the frontend, markup included), the ``voice`` name from the
    nearest ``<voice name>`` (None: the request's voice) and the ``speed`` multiplier (1.0: normal)."""

    text: str
    voice: str | None = None
    speed: float = 1.0
    kind: str = field(default="text", init=False)


@dataclass(frozen=True)
class Break:
    """A silence of ``seconds`` (0 < seconds <= :data:`MAX_BREAK_SECONDS`)."""

    seconds: float
    kind: str = field(default="break", init=False)


@dataclass(frozen=True)
class Boundary:
    """A segment boundary (``<p>``, ``<s>``): the spans on either side are synthesized separately."""

    kind: str = field(default="boundary", init=False)


Part = Span | Break | Boundary


@dataclass(frozen=True)
class SsmlDocument:
    """What :func:`parse_ssml` returns: the ``parts`` in order, the ``warnings`` (each unknown element
    or ignored feature once) and the ``<speak>``'s ``xml:lang`` (None if absent)."""

    parts: tuple[Part, ...]
    warnings: tuple[str, ...] = ()
    lang: str | None = None

    @property
    def spans(self) -> tuple[Span, ...]:
        return tuple(p for p in self.parts if isinstance(p, Span))

    def text(self) -> str:
        """The spoken text of every span, joined by spaces (voices, speeds and breaks dropped)."""
        return " ".join(p.text for p in self.spans)


def looks_like_ssml(text: str) -> bool:
    """True if ``text`` starts (after whitespace and an XML declaration) with a ``<speak`` element."""
    t = text.lstrip()
    if t.startswith("<?xml"):
        end = t.find("?>")
        t = t[end + 2:].lstrip() if end >= 0 else t
    return t.startswith("<speak") and (len(t) == 6 or not (t[6].isalnum() or t[6] in "-_.:"))


@dataclass
class _Frame:
    name: str
    voice: str | None
    speed: float
    emphasis: bool = False  # this element opened a <strong>
    phoneme: tuple[str, ...] | None = None  # the tokens a <phoneme> speaks its text as
    word: list[str] = field(default_factory=list)  # a <phoneme>'s text
    silent: bool = False  # text inside is not spoken (a <sub>'s, replaced by its alias)


class _Parser:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.raw: list[Part | tuple[str, str | None, float]] = []  # text pieces as (text, voice, speed)
        self.stack: list[_Frame] = []
        self.warnings: list[str] = []
        self._warned: set[str] = set()
        self.elements = 0
        self.lang: str | None = None
        self.p = expat.ParserCreate()
        self.p.StartElementHandler = self.start
        self.p.EndElementHandler = self.end
        self.p.CharacterDataHandler = self.chars
        self.p.StartDoctypeDeclHandler = self._refuse_dtd
        self.p.EntityDeclHandler = self._refuse_entity
        self.p.ExternalEntityRefHandler = self._refuse_external
        self.p.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)

    # -- refusals and messages ----------------------------------------------------------------------

    def where(self) -> str:
        return f"line {self.p.CurrentLineNumber}, column {self.p.CurrentColumnNumber + 1}"

    def error(self, message: str) -> SsmlError:
        return SsmlError(f"SSML {self.where()}: {message}")

    def _refuse_dtd(self, *args):
        raise self.error("a DOCTYPE (DTD) is not allowed in SSML here; remove it (entities are refused)")

    def _refuse_entity(self, *args):
        raise self.error("an entity declaration is not allowed")

    def _refuse_external(self, *args):
        raise self.error("an external entity is not allowed")

    def warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.warnings.append(message)

    # -- handlers -----------------------------------------------------------------------------------

    def emit(self, text: str) -> None:
        top = self.stack[-1]
        self.raw.append((text, top.voice, top.speed))

    def start(self, tag: str, attrs: dict) -> None:
        self.elements += 1
        if self.elements > MAX_ELEMENTS:
            raise self.error(f"more than {MAX_ELEMENTS} elements")
        if len(self.stack) >= MAX_DEPTH:
            raise self.error(f"elements nested deeper than {MAX_DEPTH}")
        name = tag.rsplit(":", 1)[-1]
        if not self.stack:
            if name != "speak":
                raise self.error(f"the root element must be <speak>, not <{tag}>")
            self.lang = attrs.get("xml:lang")
            self.stack.append(_Frame("speak", None, 1.0))
            return
        top = self.stack[-1]
        frame = _Frame(name, top.voice, top.speed, silent=top.silent)
        if top.phoneme is not None:  # markup inside <phoneme>: its text is the word
            frame.phoneme, frame.word = top.phoneme, top.word
        if name == "speak":
            raise self.error("<speak> inside <speak>")
        if name == "voice":
            voice = attrs.get("name")
            if voice is None or not voice.strip():
                raise self.error("<voice> needs a name attribute (a voice id)")
            frame.voice = voice.strip()
            self._ignore_attrs(name, attrs, {"name"})
        elif name == "prosody":
            if "rate" in attrs:
                frame.speed = self._rate(attrs["rate"], top.speed)
            self._ignore_attrs(name, attrs, {"rate"})
        elif name == "phoneme":
            frame.phoneme, frame.word = self._phoneme(attrs), []
        elif name == "sub":
            alias = attrs.get("alias")
            if alias is None:
                self.warn("sub-alias", "<sub> without an alias attribute: its text is spoken")
            else:
                self.emit(alias)
                frame.silent = True
        elif name == "emphasis":
            level = attrs.get("level", "moderate")
            if level not in ("strong", "moderate", "none", "reduced"):
                raise self.error(f"emphasis level {level!r}: give strong, moderate, none or reduced")
            if level in ("strong", "moderate") and not any(f.emphasis for f in self.stack) and not frame.silent:
                self.emit("<strong>")
                frame.emphasis = True
            elif level == "reduced":
                self.warn("emphasis-reduced", "<emphasis level=\"reduced\"> is spoken without emphasis")
        elif name == "break":
            if not frame.silent:
                seconds = self._break(attrs)
                if seconds > 0:
                    self.raw.append(Break(seconds))
        elif name in ("p", "s"):
            self.raw.append(Boundary())
        else:
            self.warn(f"element:{name}", f"unknown element <{name}>: not in cosyllama's SSML subset; its text is "
                                         "spoken")
        self.stack.append(frame)

    def end(self, tag: str) -> None:
        frame = self.stack.pop()
        if frame.name == "phoneme" and frame.phoneme is not None and not frame.silent:
            if self.stack and self.stack[-1].phoneme is frame.phoneme:
                return  # a nested <phoneme> inside another: the outer one speaks
            self.emit(inline_form("".join(frame.word).strip(), frame.phoneme))
        elif frame.emphasis:
            self.emit("</strong>")
        elif frame.name in ("p", "s"):
            self.raw.append(Boundary())

    def chars(self, data: str) -> None:
        if not self.stack:
            return
        top = self.stack[-1]
        if top.silent:
            return
        if top.phoneme is not None:
            top.word.append(data)
            return
        self.emit(data)

    # -- attribute values ---------------------------------------------------------------------------

    def _ignore_attrs(self, name: str, attrs: dict, used: set[str]) -> None:
        for a in sorted(set(attrs) - used - _IGNORED_ATTRS):
            self.warn(f"attr:{name}:{a}", f"<{name} {a}> is not supported; ignored")

    def _rate(self, value: str, parent: float) -> float:
        v = value.strip().lower()
        if v in RATE_KEYWORDS:
            speed = RATE_KEYWORDS[v]
        else:
            m = _RATE_RE.match(v)
            if m is None:
                raise self.error(f"prosody rate {value!r}: give x-slow, slow, medium, fast, x-fast, a percentage "
                                 "(150%, +20%, -10%) or a multiplier (1.5)")
            sign, number, pct = m.groups()
            x = float(number) / 100 if pct else float(number)
            if sign:  # a relative change of the enclosing rate
                speed = parent * (1 + x if sign == "+" else 1 - x) if pct else parent + (x if sign == "+" else -x)
            else:
                speed = x
        lo, hi = SPEED_RANGE
        if not lo <= speed <= hi:
            clamped = min(max(speed, lo), hi)
            self.warn(f"rate:{value}", f"prosody rate {value!r} is speed {speed:g}, outside {lo}-{hi}; "
                                       f"spoken at {clamped:g}")
            speed = clamped
        return speed

    def _break(self, attrs: dict) -> float:
        self._ignore_attrs("break", attrs, {"time", "strength"})
        if "time" in attrs:
            m = _TIME_RE.match(attrs["time"])
            if m is None:
                raise self.error(f"break time {attrs['time']!r}: give milliseconds or seconds, e.g. 500ms or 2s")
            seconds = float(m.group(1)) / (1000 if m.group(2).lower() == "ms" else 1)
            if seconds > MAX_BREAK_SECONDS:
                self.warn(f"break:{attrs['time']}", f"break time {attrs['time']!r} is longer than "
                                                    f"{MAX_BREAK_SECONDS:g} s; cut to {MAX_BREAK_SECONDS:g} s")
                seconds = MAX_BREAK_SECONDS
            return seconds
        strength = attrs.get("strength", "medium")
        if strength not in BREAK_STRENGTHS:
            raise self.error(f"break strength {strength!r}: give one of {', '.join(BREAK_STRENGTHS)}")
        return BREAK_STRENGTHS[strength]

    def _phoneme(self, attrs: dict) -> tuple[str, ...] | None:
        alphabet = attrs.get("alphabet", "").strip().lower()
        ph = attrs.get("ph")
        if ph is None or not ph.strip():
            raise self.error("<phoneme> needs a ph attribute (its pronunciation)")
        if alphabet not in ALPHABETS:
            self.warn(f"alphabet:{alphabet}", f"<phoneme alphabet={alphabet!r}> is not supported (use x-pinyin or "
                                              "x-arpabet); its text is spoken")
            return None
        try:
            if "[" in ph or alphabet == "x-cosyvoice":
                return parse_tokens(ph, self.tokenizer)
            if alphabet == "x-arpabet":
                return arpabet_tokens(ph)
            return tuple(t for syllable in ph.split() for t in pinyin_tokens(syllable))
        except LexiconError as e:
            raise self.error(f"<phoneme ph={ph!r}>: {e}") from None


def parse_ssml(document: str, tokenizer=None) -> SsmlDocument:
    """Parse a ``<speak>`` document into parts (see the module docstring). ``tokenizer``: check
    phoneme tokens against its vocabulary too. Raises :class:`SsmlError` for a document that is
    malformed, too large or too deep, holds a DTD or entity, or has a bad attribute value."""
    if not isinstance(document, str):
        raise SsmlError(f"SSML must be a str, got {type(document).__name__}")
    if len(document) > MAX_SSML_CHARS:
        raise SsmlError(f"SSML of {len(document)} characters; at most {MAX_SSML_CHARS}")
    parser = _Parser(tokenizer)
    try:
        parser.p.Parse(document, True)
    except expat.ExpatError as e:
        raise SsmlError(f"SSML line {e.lineno}, column {e.offset + 1}: malformed XML "
                        f"({expat.ErrorString(e.code)})") from None
    except RecursionError:
        raise SsmlError("SSML nested too deeply") from None
    return SsmlDocument(_merge(parser.raw), tuple(parser.warnings), parser.lang)


def _balance(text: str) -> str:
    """Close a ``<strong>`` the span leaves open and open one it closes (an emphasis cut by a break,
    a boundary or a voice): each span's markup stands alone."""
    depth = opened = 0
    for m in re.finditer(r"</?strong>", text):
        if m.group() == "<strong>":
            depth += 1
        elif depth:
            depth -= 1
        else:
            opened += 1
    return "<strong>" * opened + text + "</strong>" * depth


def _merge(raw: list) -> tuple[Part, ...]:
    """Join adjacent text of one voice and speed, collapse whitespace, drop empty spans and
    boundaries that separate nothing."""
    parts: list[Part] = []
    buf: list[str] = []
    attrs: tuple[str | None, float] | None = None

    def flush():
        nonlocal buf, attrs
        if attrs is not None:
            text = " ".join("".join(buf).split())
            text = _balance(text.replace("<strong> ", "<strong>").replace(" </strong>", "</strong>"))
            if text and text not in ("<strong></strong>",):
                parts.append(Span(text, attrs[0], attrs[1]))
        buf, attrs = [], None

    for piece in raw:
        if isinstance(piece, tuple):
            text, voice, speed = piece
            if attrs is not None and attrs != (voice, speed):
                if not "".join(buf).strip():
                    buf = []  # only whitespace so far: it goes with the new attributes
                else:
                    flush()
            attrs = (voice, speed)
            buf.append(text)
        else:
            flush()
            parts.append(piece)
    flush()
    out: list[Part] = []
    for p in parts:
        if isinstance(p, Boundary) and (not out or isinstance(out[-1], Boundary)):
            continue
        out.append(p)
    while out and isinstance(out[-1], Boundary):
        out.pop()
    return tuple(out)


__all__ = ["ALPHABETS", "BREAK_STRENGTHS", "MAX_BREAK_SECONDS", "MAX_DEPTH", "MAX_ELEMENTS", "MAX_SSML_CHARS",
           "RATE_KEYWORDS", "Boundary", "Break", "Part", "Span", "SsmlDocument", "SsmlError", "looks_like_ssml",
           "parse_ssml"]
