"""Batch manifests: one JSON object per line, checked row by row before any synthesis.

A row names its output (``id``), what to say (``text``), how (``mode``), in which voice (``voice``,
a registered id, or ``prompt_wav`` with an optional ``prompt_text``) and optional ``instructions``,
``seed``, ``greedy`` and ``speed``; ``captions``: the caption files to write beside the audio (a list of
formats of :data:`cosyllama.captions.FORMATS`, or one as a string; a row without it takes ``cosyllama batch
--captions``); ``loudness``: the row's loudness target in LUFS (null: none; a row without it takes
``cosyllama batch --loudness``); ``lexicon``: words the row speaks as pronunciation tokens, a JSON object
``{"word": "[t][o][k]..."}`` as the HTTP request's field (docs/pronunciation.md). Every problem of a row is
reported with its line number; a bad row never stops the others.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection
from dataclasses import dataclass, fields
from pathlib import Path

from ..defaults import RETRIES
from ..errors import read_user_text
from ..request import BATCH_NAMES, RequestError, SynthesisOptions, SynthesisRequest, check_options, resolve_mode

FIELDS = ("id", "text", "mode", "voice", "prompt_wav", "prompt_text", "instructions", "seed", "greedy", "speed",
          "captions", "loudness", "lexicon")
REQUIRED = ("id", "text", "mode")
MISSING_TEXT = "(no text)"  # what a row without text is checked with, so its other problems are said too
# A file name on every filesystem: no separators, no leading dot (temporary files start with one).
_ID_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class Row:
    """One valid manifest row. ``prompt_wav`` is resolved against the manifest's directory."""

    line: int
    id: str
    text: str
    mode: str
    voice: str | None = None
    prompt_wav: str | None = None
    prompt_text: str | None = None
    instructions: str | None = None
    seed: int | None = None
    greedy: bool = False
    speed: float = 1.0
    captions: tuple[str, ...] = ()  # caption formats to write beside the audio (the row's, else --captions)
    loudness: float | None = None  # the loudness target, LUFS (the row's, else --loudness; None: the model's level)
    lexicon: tuple[tuple[str, str], ...] | None = None  # the row's own (word, tokens) entries, checked
    # of the row's JSON as written (with its captions and loudness as they apply): a changed row is not "already done"
    digest: str = ""

    def options(self, tokenizer=None, retries: int = RETRIES) -> SynthesisOptions:
        """The row's synthesis options (word times when it has captions; ``retries``: the run's); its lexicon's
        tokens checked against ``tokenizer`` when given (:class:`~cosyllama.text.lexicon.LexiconError`)."""
        lexicon = None
        if self.lexicon:
            from ..text.lexicon import Lexicon

            lexicon = Lexicon.from_mapping(dict(self.lexicon), tokenizer)
        return SynthesisOptions(speed=self.speed, greedy=self.greedy, seed=self.seed, word_times=bool(self.captions),
                                loudness=self.loudness, lexicon=lexicon, retries=retries)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, ensure_ascii=False)

    @classmethod
    def from_json(cls, s: str) -> Row:
        obj = json.loads(s)
        lexicon = obj.get("lexicon")
        return cls(**{**obj, "captions": tuple(obj.get("captions") or ()),
                      "lexicon": None if lexicon is None else tuple(map(tuple, lexicon))})


@dataclass(frozen=True)
class BadRow:
    """A manifest line that cannot be synthesized, with every reason found."""

    line: int
    id: str | None
    error: str


@dataclass
class Manifest:
    path: Path
    rows: list[Row]
    bad: list[BadRow]

    @property
    def n_lines(self) -> int:
        return len(self.rows) + len(self.bad)


def _digest(obj: dict) -> str:
    canon = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def _row_digest(obj: dict, captions: tuple[str, ...], loudness: float | None = None) -> str:
    """The digest of a row as written, with its captions and loudness target as they apply (its own, or
    ``--captions`` and ``--loudness``) and its lexicon, each only when there is one: a row without them keeps
    the digest it had before they existed, so its finished output stays done."""
    rest = {k: v for k, v in obj.items() if k not in ("captions", "loudness", "lexicon")}
    if obj.get("lexicon"):
        rest["lexicon"] = obj["lexicon"]
    if captions:
        rest["captions"] = list(captions)
    if loudness is not None:
        rest["loudness"] = float(loudness)  # -16 and -16.0 are one target
    return _digest(rest)


def caption_formats(value, name: str = "captions") -> tuple[tuple[str, ...], str | None]:
    """A ``captions`` value (a list of formats or one format as a string) as the formats in
    :data:`~cosyllama.captions.FORMATS` order, each once; or ``((), problem)``."""
    from ..captions import FORMATS as CAPTION_FORMATS

    allowed = ", ".join(CAPTION_FORMATS)
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        return (), f"{name} must be a format or a list of them ({allowed}), got {value!r}"
    unknown = [x for x in items if x not in CAPTION_FORMATS]
    if unknown:
        return (), f"{name}: unknown caption format(s) {', '.join(map(repr, unknown))}; use {allowed}"
    return tuple(f for f in CAPTION_FORMATS if f in items), None


def lexicon_entries(value) -> tuple[tuple[tuple[str, str], ...] | None, str | None]:
    """A row's ``lexicon`` (an object ``{"word": "[t][o][k]..."}``, as the HTTP request's field) as its entries,
    each checked as a lexicon file's line is (its tokens against CosyVoice3's pronunciation tokens; the model's
    vocabulary when the row runs); ``(None, None)`` for none, or ``(None, problem)``."""
    from ..text.lexicon import Lexicon, LexiconError

    if value is None:
        return None, None
    if not isinstance(value, dict):
        return None, (f"lexicon must be an object {{\"word\": \"[t][o][k]...\"}} (docs/pronunciation.md), got "
                      f"{type(value).__name__}")
    for word, tokens in value.items():
        if not isinstance(tokens, str):
            return None, (f"lexicon entry {word!r}: its tokens must be a string, e.g. \"[T][AH0][M]\", not "
                          f"{type(tokens).__name__}")
    try:
        Lexicon.from_mapping(value)
    except LexiconError as e:
        return None, str(e) if str(e).startswith("lexicon") else f"lexicon {e}"  # a duplicate word names its entries
    return (tuple(value.items()) or None), None


def check_row(obj, line: int, base_dir: Path, voices: Collection[str] | None = None,
              voice_transcripts: dict[str, bool] | None = None,
              voice_instructions: dict[str, bool] | None = None, captions: tuple[str, ...] = (),
              loudness: float | None = None) -> Row | BadRow:
    """Check one parsed line: its JSON shape here, the synthesis rules by building its
    :class:`~cosyllama.request.SynthesisRequest` (each problem in the row's field names). ``voices``:
    the registered voice ids (None: not checked); ``voice_transcripts``: which of them have a
    transcript (zero-shot needs one); ``voice_instructions``: which of them have their own style
    instruction (instruct without ``instructions`` needs one; None: not known, checked at synthesis).
    ``captions``, ``loudness``: the caption formats and the loudness target of a row that gives none
    (``--captions``, ``--loudness``)."""
    if not isinstance(obj, dict):
        return BadRow(line, None, f"a row must be a JSON object, got {type(obj).__name__}")
    problems: list[str] = []
    rid = obj.get("id")
    if "id" not in obj:
        rid = None
        problems.append("missing field 'id'")
    elif not isinstance(rid, str) or not _ID_RE.match(rid):
        problems.append(f"id {rid!r} is not allowed: use 1-128 letters, digits, '_', '-' or '.', "
                        "not starting with '.' (it names the output file)")
        rid = None
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        problems.append(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(FIELDS)}")
    for f in REQUIRED[1:]:
        if f not in obj:
            problems.append(f"missing field {f!r}")

    text, mode = obj.get("text"), obj.get("mode")

    def opt_str(name: str, non_empty: bool = True) -> str | None:
        v = obj.get(name)
        if v is not None and (not isinstance(v, str) or (non_empty and not v.strip())):
            problems.append(f"{name} must be a {'non-empty ' if non_empty else ''}string")
            return None
        return v

    voice, prompt_wav = opt_str("voice"), opt_str("prompt_wav")
    prompt_text, instructions = opt_str("prompt_text", False), opt_str("instructions", False)
    if voice is not None and voices is not None and voice not in voices:
        problems.append(f"unknown voice {voice!r}; " + (f"registered voices: {', '.join(sorted(voices))}"
                                                        if voices else "no voices were given (use --voices)"))
    if prompt_wav is not None:
        p = Path(prompt_wav).expanduser()
        p = p if p.is_absolute() else base_dir / p
        if not p.is_file():
            problems.append(f"prompt_wav {prompt_wav!r} does not exist" +
                            ("" if Path(prompt_wav).is_absolute() else f" (relative to {base_dir})"))
        prompt_wav = str(p)
    greedy = obj.get("greedy", False)
    if greedy is None:
        greedy = False
    if not isinstance(greedy, bool):
        problems.append(f"greedy must be true or false, got {greedy!r}")
    # the synthesis rules are the request's (cosyllama.request); the options' each on their own, so that a
    # row hears of all of them, then the rest
    seed, speed = obj.get("seed"), obj.get("speed", 1.0)
    speed = 1.0 if speed is None else speed
    if obj.get("captions") is not None:  # a row's own list, [] included, wins over --captions
        captions, problem = caption_formats(obj["captions"])
        if problem:
            problems.append(problem)
    if "loudness" in obj:  # a row's own target, null included (none), wins over --loudness
        loudness = obj["loudness"]
    lexicon, problem = lexicon_entries(obj.get("lexicon"))
    if problem:
        problems.append(problem)
    for one in (SynthesisOptions(seed=seed), SynthesisOptions(speed=speed), SynthesisOptions(loudness=loudness)):
        try:
            check_options(one)
        except RequestError as e:
            problems.append(e.render(BATCH_NAMES))
    try:
        # a missing text is said above; the rest of the row is still checked
        request = SynthesisRequest(text if "text" in obj else MISSING_TEXT, mode, voice=voice, prompt_wav=prompt_wav,
                                   prompt_text=prompt_text, instruction=instructions)
        if voice is not None and voice_transcripts is not None and voice in voice_transcripts:
            known = voice_instructions is not None and voice in voice_instructions
            resolve_mode(request.mode, request.instruction, prompt_text=bool(prompt_text), clip=False,
                         voice_transcript=voice_transcripts[voice],
                         voice_instruction="(the voice's own)" if known and voice_instructions[voice] else None,
                         instruction_known=known)
    except RequestError as e:
        problems.append(e.render(BATCH_NAMES))

    if problems:
        return BadRow(line, rid, "; ".join(problems))
    return Row(line=line, id=rid, text=text, mode=mode, voice=voice, prompt_wav=prompt_wav,
               prompt_text=prompt_text, instructions=instructions, seed=seed, greedy=greedy,
               speed=float(speed), captions=captions, loudness=None if loudness is None else float(loudness),
               lexicon=lexicon, digest=_row_digest(obj, captions, loudness))


def read_manifest(path: str | Path, voices: Collection[str] | None = None,
                  voice_transcripts: dict[str, bool] | None = None,
                  voice_instructions: dict[str, bool] | None = None,
                  captions: tuple[str, ...] = (), loudness: float | None = None) -> Manifest:
    """Parse and check every line (blank lines and lines starting with ``#`` are skipped); ``captions``,
    ``loudness``: the caption formats and the loudness target of rows that give none (``--captions``,
    ``--loudness``).

    Raises :class:`InputError` only when the file itself cannot be read; row problems are
    returned in ``Manifest.bad``. A repeated id is an error from its second occurrence on.
    """
    path = Path(path)
    text = read_user_text(path, f"manifest {str(path)!r}", "give a .jsonl file")
    base = path.resolve().parent
    rows: list[Row] = []
    bad: list[BadRow] = []
    first_line: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            bad.append(BadRow(n, None, f"not valid JSON ({e.msg} at column {e.colno})"))
            continue
        r = check_row(obj, n, base, voices, voice_transcripts, voice_instructions, captions, loudness)
        if r.id is not None:
            if r.id in first_line:
                msg = f"id {r.id!r} is used again (first on line {first_line[r.id]})"
                bad.append(BadRow(n, None, msg if isinstance(r, Row) else f"{msg}; {r.error}"))
                continue
            first_line[r.id] = n
        (rows if isinstance(r, Row) else bad).append(r)
    return Manifest(path, rows, bad)
