"""Several voices in one piece: a script of turns, each spoken in its own voice, with an exact pause between
turns, as one output (:meth:`cosyllama.tts.TTS.dialogue`).

Each turn is one synthesis of its own (its voice, its text, its instruction or speed where it asks), run
when the turn before it has ended, so a dialogue of N turns costs the N turns spoken one by one plus the
pauses, and holds one LLM sequence at a time. A voice's prompt is prepared once (a registered voice already
is). The seed rule: turn ``k`` is synthesized with ``seed + 1000·k`` (its segment ``i`` with
``seed + 1000·k + i``, as any request's), wrapped into the seed range (:func:`cosyllama.seeds.offset_seed`), so
a turn sounds the same wherever it stands as long as it keeps its place. The output's segments name their
speaker (``Segment.voice``), so captions say who speaks.

Scripts come as a plain text (:func:`parse_script`): ``name: text`` lines, a line without a name continuing
the turn before it; or as JSON: a list of turns ``{"voice", "text", "instructions"?, "speed"?}``, or an object
with ``turns`` (Kokoro-FastAPI's shape) or ``inputs`` (``{"text", "voice_id"}``, ElevenLabs' shape) and
``pause_between_turns``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from .captions import Segment, Word
from .errors import InputError
from .request import SynthesisOptions, SynthesisRequest
from .seeds import offset_seed

MAX_TURNS = 500
MAX_PAUSE_S = 10.0
TURN_SEED_STEP = 1000
PAUSE_SEGMENT = -1  # AudioChunk.segment of a pause between turns: it belongs to no text segment
_NAME_LINE = re.compile(r"^\s*([^\s:][^:]{0,63}?)\s*:\s?(.*)$")


class ScriptError(InputError):
    """A script that cannot be spoken: its format, an empty or unknown turn, a pause out of range."""


@dataclass(frozen=True)
class Turn:
    """One turn: ``voice`` (a registered voice id, or :class:`~cosyllama.frontend.PromptFeatures`) says
    ``text``; ``instruction`` makes it an instruct turn, ``speed`` its speaking rate; ``name`` is the speaker's
    name in captions (default: the voice id)."""

    voice: object
    text: str
    instruction: str | None = None
    speed: float | None = None
    name: str | None = None

    @property
    def speaker(self) -> str | None:
        return self.name if self.name is not None else (self.voice if isinstance(self.voice, str) else None)


@dataclass(frozen=True)
class Script:
    turns: tuple[Turn, ...]
    pause: float = 0.0  # seconds between turns


def check_turns(turns: Sequence[Turn], pause: float) -> None:
    """The rules of a script as a whole: 1 to :data:`MAX_TURNS` turns, each with text, and a pause from 0 to
    :data:`MAX_PAUSE_S` seconds."""
    if not turns:
        raise ScriptError("the script has no turns; give at least one (voice and text)")
    if len(turns) > MAX_TURNS:
        raise ScriptError(f"the script has {len(turns)} turns; at most {MAX_TURNS} are allowed in one request")
    if isinstance(pause, bool) or not isinstance(pause, (int, float)) or not 0 <= pause <= MAX_PAUSE_S:
        raise ScriptError(f"the pause between turns must be 0 to {MAX_PAUSE_S:g} seconds, got {pause!r}")
    for k, t in enumerate(turns, 1):
        if not isinstance(t.text, str) or not t.text.strip():
            raise ScriptError(f"turn {k} ({_who(t)}) has no text")
        if t.voice is None or (isinstance(t.voice, str) and not t.voice.strip()):
            raise ScriptError(f"turn {k} has no voice")


def _who(t: Turn) -> str:
    return f"voice {t.speaker!r}" if t.speaker else "its voice"


def parse_script(text: str, *, source: str = "the script") -> Script:
    """A script from a plain text (``name: text`` lines; ``#`` starts a comment line; a line without a name
    continues the turn before it) or JSON (the module docstring's shapes). Voices stay names here."""
    stripped = text.lstrip("\ufeff").strip()
    if stripped.startswith(("[", "{")):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise ScriptError(f"{source} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        return script_from_json(data, source=source)
    turns: list[Turn] = []
    for n, line in enumerate(stripped.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _NAME_LINE.match(line)
        if m and not m.group(1).strip().startswith(("http", "https")):
            turns.append(Turn(m.group(1).strip(), m.group(2).strip()))
        elif turns:
            turns[-1] = replace(turns[-1], text=f"{turns[-1].text} {line.strip()}".strip())
        else:
            raise ScriptError(f"{source} line {n}: a script line is 'name: text' (the first line names its voice)")
    script = Script(tuple(turns))
    check_turns(script.turns, script.pause)
    return script


def _field(obj: dict, names: tuple[str, ...], k: int, source: str, kind=str, required: bool = True):
    for name in names:
        if name in obj:
            value = obj[name]
            if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
                raise ScriptError(f"{source}: turn {k}'s {name} must be a {kind.__name__ if kind is str else 'number'}")
            return value
    if required:
        raise ScriptError(f"{source}: turn {k} needs {' or '.join(names)}")
    return None


def script_from_json(data, *, source: str = "the script") -> Script:
    """A script from parsed JSON: a list of turns, or ``{"turns" | "inputs": [...], "pause_between_turns"}``."""
    pause = 0.0
    if isinstance(data, dict):
        items = data.get("turns", data.get("inputs"))
        pause = data.get("pause_between_turns", 0.0)
        if items is None:
            raise ScriptError(f"{source}: a JSON script is a list of turns, or an object with turns or inputs")
    else:
        items = data
    if not isinstance(items, list):
        raise ScriptError(f"{source}: the turns must be a list")
    turns = []
    for k, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise ScriptError(f"{source}: turn {k} must be an object with voice and text")
        speed = _field(item, ("speed",), k, source, (int, float), required=False)
        turns.append(Turn(_field(item, ("voice", "voice_id"), k, source), _field(item, ("text", "input"), k, source),
                          _field(item, ("instructions", "instruction"), k, source, required=False),
                          None if speed is None else float(speed)))
    check_turns(turns, pause)
    return Script(tuple(turns), float(pause))


def turn_seed(seed: int | None, k: int) -> int | None:
    """The seed of turn ``k`` (the module docstring's rule)."""
    return offset_seed(seed, TURN_SEED_STEP * k)


def turn_requests(turns: Sequence[Turn], options: SynthesisOptions, limits=None,
                  voices=None) -> list[SynthesisRequest]:
    """Each turn's checked :class:`SynthesisRequest` (its seed by :func:`turn_seed`, its own speed when it asks),
    before any audio: a bad turn is an error naming it. ``voices``: a store whose ``get`` resolves voice ids."""
    if limits is not None:  # the script as a whole is bounded as one request's input is
        limits.check_chars("input", "\n".join(t.text for t in turns))
    out = []
    for k, t in enumerate(turns):
        opts = replace(options, seed=turn_seed(options.seed, k), **({} if t.speed is None else {"speed": t.speed}))
        voice = t.voice
        try:
            if voices is not None and isinstance(voice, str):
                voice = voices.get(voice)
            request = SynthesisRequest(t.text, "instruct" if t.instruction else None, voice=voice,
                                       instruction=t.instruction, options=opts, limits=limits)
            out.append(request.with_voice(voice) if not isinstance(voice, str) else request)
        except (InputError, KeyError) as e:
            raise ScriptError(f"turn {k + 1} ({_who(t)}): {e}") from None
    return out


def _shifted(seg: Segment, index: int, offset: int, speaker: str | None) -> Segment:
    words = None if seg.words is None else tuple(
        Word(w.word, round(w.start + offset / seg.sample_rate, 3), round(w.end + offset / seg.sample_rate, 3))
        for w in seg.words)
    return replace(seg, index=index, start_sample=seg.start_sample + offset, end_sample=seg.end_sample + offset,
                   words=words, voice=speaker)


def gaps(pause: float | Sequence[float], n_turns: int) -> list[float]:
    """The silences of a script: before each turn and after the last (``n_turns + 1`` of them). A number is the
    pause between turns (none before the first or after the last); a sequence gives every gap."""
    if isinstance(pause, (int, float)):
        return [0.0] + [float(pause)] * (n_turns - 1) + [0.0]
    out = [float(x) for x in pause]
    if len(out) != n_turns + 1:
        raise ValueError(f"{n_turns} turns have {n_turns + 1} gaps, got {len(out)}")
    return out


def dialogue_chunks(tts, speakers: Sequence[str | None], requests: Sequence[SynthesisRequest],
                    pause: float | Sequence[float], timings, segments: list, current: list, cancel=None) -> Iterator:
    """The chunks of every turn in order, a pause chunk (segment :data:`PAUSE_SEGMENT`) of exactly
    ``round(seconds * sample_rate)`` samples for each gap (:func:`gaps`); ``segments`` gets each turn's
    segments, placed in the whole output and naming the speaker; ``current`` holds the running turn's synthesis
    and the function that places its segments again (for ``finish_words``). ``timings`` sums the turns'."""
    from .engine import AudioChunk

    offset, base = 0, 0
    rate = tts.sample_rate
    silences = gaps(pause, len(requests))

    def silence(seconds: float):
        n = int(round(seconds * rate))
        return AudioChunk(np.zeros(n, np.float32), rate, PAUSE_SEGMENT, False, start=offset), n

    for k, (speaker, request) in enumerate(zip(speakers, requests)):
        if silences[k] > 0:
            chunk, n = silence(silences[k])
            yield chunk
            offset += n
        syn = tts.run(request, cancel=cancel)
        start, first = len(segments), True

        def sync(syn=syn, start=start, base=base, offset=offset, speaker=speaker):
            segments[start:] = [_shifted(s, base + s.index, offset, speaker) for s in syn.segments]

        current[:] = [(syn, sync)]
        try:
            for chunk in syn:
                if first and timings.first_chunk is None and syn.timings.first_chunk is not None:
                    timings.first_chunk = syn.timings.first_chunk
                first = False
                sync()
                yield replace(chunk, segment=base + chunk.segment, start=offset + chunk.start)
            sync()
        finally:
            syn.close()
            current[:] = []
            t = syn.timings
            timings.frontend += t.frontend
            timings.llm += t.llm
            timings.token2wav += t.token2wav
            timings.align += t.align
            timings.audio_seconds += t.audio_seconds
            timings.tokens.extend(t.tokens)
            timings.loudness_held += t.loudness_held  # each turn has its own gain (docs/dialogue.md)
            timings.retries.extend(replace(b, segment=base + b.segment) for b in t.retries)
        base += len(syn.segments)
        offset += syn.segments[-1].end_sample if syn.segments else 0
    if silences[-1] > 0:
        yield silence(silences[-1])[0]


def ssml_turns(document, voice) -> tuple[list[Turn], list[float]]:
    """The turns and gaps (:func:`gaps`) of a parsed SSML document (:class:`cosyllama.text.ssml.SsmlDocument`):
    a span is a turn in its ``<voice>`` (``voice``, the request's, where none is named) at its speed; a span
    after a ``<p>``/``<s>`` boundary or in another voice or speed is a turn of its own (so a segment of its
    own); each ``<break>`` adds its seconds to the gap where it stands. Spans with nothing to say are dropped."""
    turns: list[Turn] = []
    silences = [0.0]
    for part in document.parts:
        if part.kind == "break":
            silences[-1] += part.seconds
        elif part.kind == "text" and part.text.strip():
            turns.append(Turn(part.voice if part.voice is not None else voice, part.text.strip(),
                              speed=None if part.speed == 1.0 else part.speed,
                              name=part.voice))
            silences.append(0.0)
    if not turns:
        raise ScriptError("the SSML document says nothing (no text outside its markup)")
    return turns, silences
