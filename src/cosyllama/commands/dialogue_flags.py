"""``synth --script``: a dialogue read from a file, its voices found, spoken by :meth:`TTS.dialogue`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import InputError, read_user_text

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")


@dataclass(frozen=True)
class ReadScript:
    turns: tuple
    pause: float
    folder: Path  # a turn's voice that names an audio file is relative to the script's folder


def read_script(args, options) -> ReadScript:
    """The script of ``--script`` with ``--pause``, checked before any model loads; ``--voices`` must exist."""
    from ..batch.engine import voice_files
    from ..dialogue import check_turns, parse_script

    given = [flag for flag, value in (("--prompt-wav", args.prompt_wav), ("--prompt-text", args.prompt_text),
                                      ("--instruct", args.instruct), ("--mode", args.mode)) if value is not None]
    if given:
        raise InputError(f"{', '.join(given)} belong with --text; a script's turns name their voices")
    path = Path(args.script)
    text = read_user_text(path, f"--script {args.script!r}")
    from ..request import RequestError, check_options

    try:
        check_options(options)
    except RequestError as e:
        raise e.as_flag() from None
    script = parse_script(text, source=f"--script {args.script!r}")
    pause = script.pause if args.pause is None else args.pause
    check_turns(script.turns, pause)
    if options.stream and any(t.speed not in (None, 1.0) for t in script.turns):
        raise InputError("a turn's speed other than 1 needs non-streaming synthesis; drop --stream")
    if args.voices is not None:
        voice_files(args.voices)
    for k, t in enumerate(script.turns, 1):
        if Path(t.voice).suffix.lower() in AUDIO_SUFFIXES and not (path.parent / t.voice).is_file():
            raise InputError(f"turn {k}: voice {t.voice!r} names an audio file that does not exist "
                             f"(beside the script: {str(path.parent / t.voice)!r})")
    return ReadScript(script.turns, pause, path.parent)


def run_script(tts, script: ReadScript, args, options, progress):
    """The dialogue's synthesis: ``--voices`` registered, a voice naming an audio file made into a voice once
    (named by the file's stem in captions), every other voice a registered id."""
    from ..batch.engine import load_voices
    from ..voice_directory import ClipEncoder

    load_voices(tts.voices, args.voices, ClipEncoder.of(tts))
    made: dict[str, object] = {}
    turns = []
    for t in script.turns:
        if Path(t.voice).suffix.lower() in AUDIO_SUFFIXES:
            if t.voice not in made:
                made[t.voice] = tts.make_voice(script.folder / t.voice)
            t = replace(t, voice=made[t.voice], name=Path(t.voice).stem)
        turns.append(t)
    progress(f"dialogue: {len(turns)} turn(s), {len({t.speaker for t in turns})} voice(s), "
             f"{script.pause:g} s between turns")
    return tts.dialogue(turns, pause=script.pause, options=options)
