"""``cosyllama align``: the word times of a known text in any audio file, written as captions."""

from __future__ import annotations

from ..errors import InputError, read_user_text
from ..progress import to_stderr

MAX_AUDIO_S = 3600.0  # one decode holds the whole clip; longer recordings are aligned in parts by the caller


def add_parser(sub) -> None:
    """The ``align`` command's arguments (``sub``: the CLI's sub-parsers)."""
    s = sub.add_parser("align", help="word times of a known text in an audio file, as SRT, WebVTT or JSON")
    s.add_argument("--audio", required=True, help="the speech (wav, flac, ogg or mp3; channels are mixed)")
    text = s.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="what the audio says")
    text.add_argument("--text-file", help="a UTF-8 file holding what the audio says")
    s.add_argument("--language", help="the aligner's language code (default: from the text's script; English is "
                                      "built in, others need --aligner-dir)")
    s.add_argument("--aligner-dir", help="directory of aligner models, one folder per language code "
                                         "(default: $COSYLLAMA_ALIGNERS; docs/captions.md)")
    s.add_argument("--out", required=True, help="FILE.json, FILE.srt or FILE.vtt (the suffix names the format)")
    s.set_defaults(func=run)


def run(args, progress=to_stderr) -> int:
    from .synth import check_captions_path

    out = check_captions_path(args.out, "--out")
    if args.text_file is not None:
        text = read_user_text(args.text_file, f"--text-file {args.text_file!r}")
    else:
        text = args.text
    if not text.strip():
        raise InputError("the text is empty: give what the audio says")

    from ..alignment import align, sentences
    from ..audio import read_audio
    from ..captions import CaptionError, write_captions

    wav, sr = read_audio(args.audio, "--audio", max_seconds=MAX_AUDIO_S)
    found = align(wav[0].numpy(), sr, text, args.language, aligner_dir=args.aligner_dir)
    segs = sentences(found, sr)
    try:
        write_captions(out, segs)
    except CaptionError as e:
        raise InputError(f"--out: {e}") from None
    secs = wav.shape[-1] / sr
    print(f"wrote {args.out}: {len(found.words)} words in {len(segs)} sentence(s), language {found.language}; "
          f"aligned {secs:.1f} s of audio in {found.seconds:.2f} s ({found.seconds / max(secs, 1e-9):.3f} s per "
          f"audio second)")
    return 0
