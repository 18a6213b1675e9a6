"""``cosyllama synth``: one text to a WAV file, with per-stage timings and the RTF."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..audio_out import WAV_SUBTYPES, write_wav
from ..defaults import FIRST_CHUNK_RANGE, LLM_CHOICES, SPEED_RANGE
from ..errors import InputError
from ..progress import to_stderr
from ..request import MODES, RequestError, SynthesisOptions, SynthesisRequest
from .flags import (
    add_gpu_options,
    add_llm_weights_option,
    add_loudness_option,
    add_precision_option,
    add_retries_option,
    add_threads_option,
)


def add_parser(sub) -> None:
    """The ``synth`` command's arguments (``sub``: the CLI's sub-parsers)."""
    s = sub.add_parser("synth", help="synthesize speech to a WAV file")
    s.add_argument("--model-dir", required=True, help="official CosyVoice3 model directory")
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", help="text to speak")
    what.add_argument("--script", help="a dialogue: a file of 'name: text' lines or JSON turns, each turn in its "
                                       "voice (docs/dialogue.md)")
    s.add_argument("--out", required=True, help="output .wav (24 kHz mono)")
    s.add_argument("--out-format", choices=tuple(WAV_SUBTYPES), default="pcm16",
                   help="16-bit PCM (default) or 32-bit float WAV")
    s.add_argument("--prompt-wav", help="prompt audio (wav/flac/ogg/mp3), up to 30 s")
    s.add_argument("--prompt-text", help="transcript of the prompt audio")
    s.add_argument("--instruct", help="instruction for instruct mode (e.g. 'Speak slowly.')")
    s.add_argument("--mode", choices=MODES, default=None,
                   help="default: instruct if --instruct, zero-shot if --prompt-text, else cross-lingual")
    s.add_argument("--llm", choices=LLM_CHOICES, default=None,
                   help="LLM backend (default: llamacpp when --gguf is given, else torch)")
    s.add_argument("--gguf", help="GGUF file for --llm llamacpp")
    s.add_argument("--stream", action="store_true", help="synthesize in streaming chunks")
    s.add_argument("--first-chunk-tokens", type=int, default=None, metavar="N",
                   help=f"with --stream, outside the reference's schedule: each segment's first chunk covers N "
                        f"speech tokens ({FIRST_CHUNK_RANGE[0]}-{FIRST_CHUNK_RANGE[1]}) instead of 25 or more, so "
                        "its first audio comes sooner; later chunks are the reference's (docs/streaming.md)")
    s.add_argument("--greedy", action="store_true", help="argmax decoding (deterministic)")
    s.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    add_retries_option(s)
    s.add_argument("--speed", type=float, default=1.0,
                   help=f"speaking-rate factor, {SPEED_RANGE[0]}-{SPEED_RANGE[1]} (non-streaming)")
    add_loudness_option(s, "bring the output to this integrated loudness (LUFS, ITU-R BS.1770, e.g. -16) with one "
                           "gain, never past a -1 dBFS true peak; a stream's gain comes from the voice's last "
                           "output or its first sentence "
                           "(docs/loudness.md; needs the loudness extra)")
    s.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    add_gpu_options(s)
    add_threads_option(s)
    add_precision_option(s, "flow compute: auto = bf16 where the CPU/GPU has it natively, int8 on other x86 CPUs, "
                            "each kept only if a fidelity check on the loaded weights passes, else fp32 (the "
                            "reference)")
    add_llm_weights_option(s)
    s.add_argument("--ssml", action="store_true", help="--text is an SSML <speak> document (the subset of "
                                                       "docs/pronunciation.md), spoken in the --prompt-wav voice")
    s.add_argument("--voices", help="with --script or --ssml: the voices its turns (or <voice name>) name, a voice "
                                    "file (*.pt) or a directory of them and of voice folders (NAME/ref.wav), as batch "
                                    "takes")
    s.add_argument("--pause", type=float, default=None, help="with --script: seconds of silence between turns "
                                                             "(default: the script's pause_between_turns, else 0)")
    s.add_argument("--lexicon", metavar="FILE",
                   help="pronunciation lexicon: word<TAB>tokens per line, e.g. 几<TAB>[j][ǐ] (docs/pronunciation.md)")
    s.add_argument("--tokens-out", help="write the speech tokens per text segment as JSON")
    s.add_argument("--captions", help="write captions: FILE.srt, FILE.vtt or FILE.json (the suffix names the "
                                      "format); word times where they can be aligned, else sentence times "
                                      "(docs/captions.md)")
    s.set_defaults(func=run)


def check_captions_path(path: str | Path, flag: str = "--captions") -> Path:
    """Refuse a caption path whose format is unknown or whose directory is missing, before any work."""
    from ..captions import CaptionError, caption_format

    path = Path(path)
    try:
        caption_format(path)
    except CaptionError as e:
        raise InputError(f"{flag}: {e}") from None
    if not path.parent.is_dir():
        raise InputError(f"{flag}: cannot write {str(path)!r}: directory {str(path.parent)!r} does not exist")
    return path


def _caption_summary(segments) -> str:
    """What a caption file holds: its sentences, and their word times or why they have none."""
    timed = sum(1 for s in segments if s.words is not None)
    line = f"{len(segments)} sentence(s), word times for {timed}"
    reasons = sorted({s.words_why for s in segments if s.words is None and s.words_why})
    return line + "".join(f"; without them: {r}" for r in reasons)


def check_out_path(path: str | Path) -> Path:
    """Refuse an output path that cannot be written, before any synthesis work."""
    path = Path(path)
    if path.suffix.lower() != ".wav":
        raise InputError(f"--out must be a .wav file, got {str(path)!r}")
    if not path.parent.is_dir():
        raise InputError(f"cannot write {str(path)!r}: directory {str(path.parent)!r} does not exist")
    return path


def loudness_line(t) -> str:
    """What ``--loudness`` did, from a synthesis' timings (a dialogue's turns each have their own gain)."""
    if t.loudness_gain_db is None:
        held = f"; {t.loudness_held} sample(s) held at the ceiling" if t.loudness_held else ""
        return f"loudness: each turn brought to the target on its own{held}"
    measured = "too short to measure" if t.loudness_measured is None else f"{t.loudness_measured:.1f} LUFS"
    held = f"; {t.loudness_held} sample(s) held at the ceiling" if t.loudness_held else ""
    return f"loudness gain {t.loudness_gain_db:+.2f} dB ({t.loudness_why}; measured {measured}){held}"


def run(args, progress: Callable[[str], None] = to_stderr) -> int:
    """One synthesis: check every argument (the request's rules, said with the flags), load, synthesize,
    write ``--out``, report timings."""
    from ..tts import TTS
    from .options import load_options

    lexicon = None
    if getattr(args, "lexicon", None):
        from ..text.lexicon import Lexicon

        lexicon = Lexicon.load(args.lexicon)
    synthesis_options = SynthesisOptions(stream=args.stream, speed=args.speed, greedy=args.greedy, seed=args.seed,
                                         word_times=bool(args.captions), loudness=args.loudness,
                                         retries=args.retries, lexicon=lexicon,
                                         first_chunk_tokens=args.first_chunk_tokens)
    script = None
    if args.script is not None and args.ssml:
        raise InputError("--ssml goes with --text; a --script's turns are plain text")
    if args.script is not None:
        from .dialogue_flags import read_script

        script = read_script(args, synthesis_options)
    elif args.ssml:
        from ..text.ssml import parse_ssml

        if args.pause is not None:
            raise InputError("--pause goes with --script; SSML says its pauses with <break>")
        if args.mode is not None or args.instruct is not None:
            raise InputError("--mode and --instruct do not go with --ssml: its spans take the voice's own mode")
        parse_ssml(args.text)  # its syntax, before any model loads (its phoneme tokens once the tokenizer is)
        if args.voices is not None:
            from ..batch.engine import voice_files

            voice_files(args.voices)
    else:
        if args.voices is not None or args.pause is not None:
            raise InputError("--voices and --pause go with --script (or --voices with --ssml)")
        try:
            request = SynthesisRequest(args.text, args.mode, prompt_wav=args.prompt_wav, prompt_text=args.prompt_text,
                                       instruction=args.instruct, options=synthesis_options)
        except RequestError as e:
            raise e.as_flag() from None
    if args.loudness is not None:
        from ..loudness import require

        require()  # the install hint before loading a model
    options = load_options(args)
    llm = options.llm
    if script is None and (args.prompt_wav is None or not Path(args.prompt_wav).is_file()):
        raise InputError(f"prompt audio {args.prompt_wav!r} does not exist" if args.prompt_wav else
                         "--prompt-wav is needed with --text (the voice to speak in)")
    if args.gguf and not Path(args.gguf).is_file():
        raise InputError(f"GGUF file {args.gguf!r} does not exist")
    check_out_path(args.out)
    if args.captions:
        check_captions_path(args.captions)

    t0 = time.perf_counter()
    tts = TTS(options)
    load_s = time.perf_counter() - t0
    progress(f"loaded {args.model_dir} (llm: {llm}{', ' + Path(args.gguf).name if args.gguf else ''}, "
             f"device: {tts.device}) in {load_s:.1f} s")
    from ..cpu import tts_path

    for line in tts_path(tts, args.precision, args.threads).lines():
        progress(line)
    if args.stream:
        from ..engine import schedule_line

        progress(schedule_line(args.first_chunk_tokens))

    try:
        if script is not None:
            from .dialogue_flags import run_script

            syn = run_script(tts, script, args, synthesis_options, progress)
        elif args.ssml:
            from ..batch.engine import load_voices
            from ..voice_directory import ClipEncoder

            load_voices(tts.voices, args.voices, ClipEncoder.of(tts))
            syn = tts.ssml(args.text, tts.make_voice(args.prompt_wav, args.prompt_text), options=synthesis_options)
        else:
            syn = tts.run(request)
    except RequestError as e:
        raise e.as_flag() from None

    t1 = time.perf_counter()
    parts = []
    for chunk in syn:
        parts.append(chunk.samples)
        if args.stream and chunk.samples.size:
            progress(f"  chunk {len(parts)} (segment {chunk.segment}): {chunk.samples.size / tts.sample_rate:.2f} s "
                     f"of audio at {time.perf_counter() - t1:.2f} s")
    wall = time.perf_counter() - t1 + syn.timings.frontend
    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    write_wav(check_out_path(args.out), audio, tts.sample_rate, args.out_format)
    if args.tokens_out:
        Path(args.tokens_out).write_text(json.dumps(syn.timings.tokens), encoding="utf-8")
    if args.captions:
        from ..captions import CaptionError, write_captions

        try:
            write_captions(args.captions, syn.segments)
        except CaptionError as e:
            raise InputError(f"--captions: {e}") from None
        print(f"wrote {args.captions}: {_caption_summary(syn.segments)}")

    t = syn.timings
    for r in t.retries:
        progress(f"bad take: {r.describe()}")
    secs = audio.size / tts.sample_rate
    rtf = wall / secs if secs else float("nan")
    n_tok = sum(len(x) for x in t.tokens)
    progress(f"frontend {t.frontend:.2f} s | llm {t.llm:.2f} s ({n_tok} tokens, "
             f"{n_tok / t.llm if t.llm else 0:.1f} tok/s) | flow+vocoder {t.token2wav:.2f} s"
             + (f" | word times {t.align:.2f} s" if args.captions else ""))
    first = f" | first audio after {t.first_chunk:.2f} s" if args.stream and t.first_chunk is not None else ""
    progress(f"{secs:.2f} s of audio in {wall:.2f} s: RTF {rtf:.3f}{first}")
    if args.loudness is not None:
        progress(loudness_line(t))
    print(f"wrote {args.out}")
    return 0
