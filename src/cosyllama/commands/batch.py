"""``cosyllama batch MANIFEST.jsonl --out DIR``: every row of a manifest to an audio file, resumable.

Exit codes: 0 every row is done; 2 bad arguments, an unreadable manifest, or (with ``--dry-run``)
any bad row; 3 the batch ran to the end but some rows failed (``results.jsonl`` says why);
130 interrupted (the rows finished so far are kept; run the same command again to go on).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..batch.engine import DEFAULT_CONCURRENCY, EngineOptions, error_record, voice_files, voice_folders
from ..batch.manifest import Manifest, read_manifest
from ..batch.output import (
    FORMATS,
    RESULTS,
    DirLock,
    ResultsLog,
    compact_results,
    is_done,
    prepare_out_dir,
    read_results,
)
from ..batch.progress import SOME_STAGES, STAGES, BatchProgress
from ..defaults import PRECISION, RETRIES
from ..errors import InputError
from .flags import (
    PRECISION_CHOICES,
    add_gpu_options,
    add_llm_weights_option,
    add_loudness_option,
    add_retries_option,
)
from .options import load_options

EXIT_SOME_FAILED = 3


def add_parser(sub) -> None:
    """The ``batch`` sub-command's arguments (``sub``: the CLI's sub-parsers)."""
    b = sub.add_parser("batch", help="synthesize every row of a JSONL manifest into a directory (resumable; "
                                     "optionally on a Ray cluster)")
    b.add_argument("manifest", metavar="MANIFEST.jsonl",
                   help="one JSON object per line: id, text, mode, voice | prompt_wav [+ prompt_text], "
                        "optional instructions, seed, greedy, speed, captions, loudness, lexicon")
    b.add_argument("--out", required=True, metavar="DIR", help="output directory: <id>.<format> and results.jsonl")
    b.add_argument("--model-dir", required=True, help="official CosyVoice3 model directory")
    b.add_argument("--gguf", help="run the LLM on llama.cpp from this GGUF (default: PyTorch)")
    b.add_argument("--voices", metavar="DIR|FILE", help="registered voices: a voice file (VoiceStore.save) or a "
                                                        "directory of them (*.pt) and of voice folders "
                                                        "(NAME/ref.wav + ref.txt)")
    b.add_argument("--format", choices=FORMATS, default="wav", help="audio file format (16-bit, 24 kHz mono)")
    b.add_argument("--precision", choices=PRECISION_CHOICES, default=PRECISION,
                   help="flow compute precision")
    b.add_argument("--threads", type=int, default=None,
                   help="CPU threads per model (default: all cores; with --ray, --ray-cpus)")
    b.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    b.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                   help=f"rows in flight per model (their LLM steps are batched; default {DEFAULT_CONCURRENCY})")
    b.add_argument("--flow-slots", type=int, default=0,
                   help="rows in the flow + vocoder at once, the others keep decoding (default 0: no limit)")
    b.add_argument("--captions", metavar="FORMATS", default=None,
                   help="caption files beside each row's audio, for rows whose manifest line names none: "
                        "comma-separated srt, vtt, json (e.g. srt,vtt); word times where they align "
                        "(docs/captions.md)")
    add_loudness_option(b, "the loudness target (LUFS, ITU-R BS.1770, e.g. -16) of rows whose manifest line gives "
                           "none: each row's audio brought to it by one gain, never past a -1 dBFS true peak "
                           "(docs/loudness.md; needs the loudness extra); default: off")
    add_retries_option(b)
    b.add_argument("--lexicon", metavar="FILE",
                   help="a pronunciation lexicon every row speaks (word<TAB>tokens lines, or a .json object; "
                        "docs/pronunciation.md); a voice folder's lexicon.txt and a row's lexicon field add to it, "
                        "their entries winning; checked before the model loads")
    b.add_argument("--retry-failed", action="store_true", help="synthesize again the rows that failed before")
    b.add_argument("--dry-run", action="store_true",
                   help="check the manifest and show what would run; synthesize nothing")
    b.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    r = b.add_argument_group("Ray (pip install 'cosyllama[ray]')")
    r.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run on Ray Data: without ADDRESS a running cluster (RAY_ADDRESS) or a local instance; "
                        "with one, that cluster (e.g. auto, ray://head:10001). DIR must be a path every node sees")
    r.add_argument("--ray-actors", type=int, default=1, help="model replicas (Ray actors), each loads the model once")
    r.add_argument("--ray-cpus", type=float, default=1.0, help="CPUs reserved per actor (default 1)")
    r.add_argument("--ray-gpus", type=float, default=0.0, help="GPUs reserved per actor (default 0)")
    r.add_argument("--ray-batch-size", type=int, default=None,
                   help="rows handed to an actor at once (default: 2 x --concurrency)")
    add_llm_weights_option(b)
    add_gpu_options(b)
    b.set_defaults(func=run)


def run(args) -> int:
    return run_batch(args)


def captions_flag(value: str | None) -> tuple[str, ...]:
    """The formats ``--captions`` names (comma-separated), or InputError."""
    from ..batch.manifest import caption_formats

    if value is None:
        return ()
    names = [x.strip() for x in value.split(",") if x.strip()]
    formats, problem = caption_formats(names, "--captions")
    if problem or not names:
        raise InputError(problem or "--captions: name one or more formats: srt, vtt, json (comma-separated)")
    return formats


def check_synthesis_flags(args) -> None:
    """``--loudness`` and ``--retries``, checked as every door checks them (InputError naming the flag)."""
    from ..request import RequestError, SynthesisOptions, check_options

    try:
        check_options(SynthesisOptions(loudness=args.loudness, retries=args.retries))
    except RequestError as e:
        raise e.as_flag() from None


def _check_args(args) -> EngineOptions:
    check_synthesis_flags(args)
    if args.concurrency < 1:
        raise InputError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.flow_slots < 0:
        raise InputError(f"--flow-slots must be >= 0, got {args.flow_slots}")
    model_dir = Path(args.model_dir)
    if not model_dir.is_dir():
        raise InputError(f"model directory {args.model_dir!r} does not exist")
    if args.gguf and not Path(args.gguf).is_file():
        raise InputError(f"GGUF file {args.gguf!r} does not exist")
    if args.ray is not None:
        for flag, v in (("--ray-actors", args.ray_actors), ("--ray-batch-size", args.ray_batch_size)):
            if v is not None and v < 1:
                raise InputError(f"{flag} must be >= 1, got {v}")
        if args.ray_cpus < 0 or args.ray_gpus < 0:
            raise InputError("--ray-cpus and --ray-gpus must be >= 0")
    voices = str(Path(args.voices).resolve()) if args.voices else None
    changes = {}
    if args.threads is None and args.ray is not None:
        changes["threads"] = max(1, int(args.ray_cpus))  # an actor computes on the CPUs it reserved
    # LoadOptions holds the model directory and GGUF absolute, so Ray's actors find them from their own cwd
    load = load_options(args, parallel=args.concurrency, **changes)
    lexicon = None
    if args.lexicon is not None:
        from ..text.lexicon import Lexicon

        lexicon = Lexicon.load(args.lexicon)  # a bad file is one line before any row (the vocabulary: at load)
    return EngineOptions(load, voices=voices, concurrency=args.concurrency, fmt=args.format,
                         flow_slots=args.flow_slots, lexicon=lexicon, retries=args.retries)


def _voice_ids(path: str | None) -> tuple[set[str], dict[str, bool], dict[str, bool]]:
    """Registered voice ids, whether each has a transcript and whether each has its own style
    instruction (read without loading a model)."""
    from ..voice_directory import INSTRUCT_TXT, REF_TXT
    from ..voices import VoiceStore

    if path is None:
        return set(), {}, {}
    store = VoiceStore()
    for f in voice_files(path):
        store.load(f)
    transcripts, instructions = {}, {}
    for v in store.ids():
        voice = store.get(v)
        transcripts[v] = voice.prompt_text is not None
        instructions[v] = voice.instruction is not None
    for vid, folder in voice_folders(path).items():  # made with the model; a file of the same id wins
        transcripts.setdefault(vid, (folder / REF_TXT).is_file())
        instructions.setdefault(vid, (folder / INSTRUCT_TXT).is_file())
    return set(transcripts), transcripts, instructions


def plan(manifest: Manifest, out_dir: Path, fmt: str, retry_failed: bool, retries: int = RETRIES):
    """Split the valid rows into (to run, already done, failed before and not retried); ``retries``: this run's
    ``--retries`` (a row whose takes were caught in a run with another is made again)."""
    latest = read_results(out_dir) if out_dir.is_dir() else {}
    todo, done, failed = [], [], []
    for row in manifest.rows:
        rec = latest.get(row.id)
        if is_done(rec, out_dir, fmt, row.digest, row.captions, retries):
            done.append(row)
        elif (not retry_failed and rec is not None and rec.get("status") == "error"
              and rec.get("stage") == "synthesis" and rec.get("digest") == row.digest):
            failed.append(row)
        else:
            todo.append(row)
    return todo, done, failed


def run_batch(args, out=None, err=None) -> int:
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    opts = _check_args(args)
    captions, loudness = captions_flag(args.captions), args.loudness
    ids, transcripts, instructions = _voice_ids(opts.voices)
    manifest = read_manifest(args.manifest, ids if opts.voices else set(), transcripts, instructions, captions,
                             loudness)
    if loudness is not None or any(r.loudness is not None for r in manifest.rows):
        from ..loudness import require

        require()  # the install hint before any work
    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"--out {args.out!r} is a file; give a directory")
    todo, done, failed = plan(manifest, out_dir, opts.fmt, args.retry_failed, opts.retries)

    for b in manifest.bad:
        print(f"{args.manifest}:{b.line}: " + (f"row {b.id!r}: " if b.id else "") + b.error, file=err)
    counts = (f"{manifest.n_lines} rows: {len(manifest.bad)} invalid, {len(done)} already done, "
              f"{len(failed)} failed before" + ("" if not failed else " (not retried; --retry-failed retries them)")
              + f", {len(todo)} to synthesize")
    if args.dry_run:
        print(counts, file=out)
        return 2 if manifest.bad else 0
    if args.ray is not None:
        from ..batch.ray_runner import import_ray

        import_ray()  # the install hint before any work

    out_dir = prepare_out_dir(out_dir)
    progress = BatchProgress(len(todo), stream=err, enabled=not args.no_progress)
    with DirLock(out_dir):
        log = ResultsLog(out_dir)
        order: dict[int, str | dict] = {r.line: r.id for r in manifest.rows}  # line -> id, or a keyless record
        try:
            for b in manifest.bad:
                rec = error_record(b.id, b.line, b.error, "manifest")
                order[b.line] = rec if b.id is None else b.id
                if b.id is not None:
                    log.append(rec)
            print(counts, file=err)

            def on_result(rec: dict) -> None:
                try:
                    log.append(rec)
                finally:
                    progress.update(rec)

            if todo:
                if args.ray is not None:
                    from ..batch.ray_runner import run_on_ray

                    run_on_ray(args.ray or None, todo, opts, out_dir.resolve(), on_result, actors=args.ray_actors,
                               cpus=args.ray_cpus, gpus=args.ray_gpus,
                               batch_size=args.ray_batch_size or 2 * opts.concurrency, err=err)
                else:
                    _run_local(todo, opts, out_dir, on_result, err, progress.restart_clock)
        except KeyboardInterrupt:
            progress.close()
            print(f"interrupted: {progress.done} row(s) finished in this run are kept; run the same command "
                  "again to continue", file=err)
            return 130
        finally:
            log.close()
            compact_results(out_dir, [order[n] for n in sorted(order)])
        progress.close()

    _summary(out, manifest, progress, len(done), len(failed), out_dir)
    return EXIT_SOME_FAILED if (manifest.bad or failed or progress.failed) else 0


def _run_local(todo, opts: EngineOptions, out_dir: Path, on_result, err, on_loaded) -> None:
    """Load the model here and run the rows ``opts.concurrency`` at a time."""
    from ..batch.engine import BatchEngine

    t0 = time.perf_counter()
    engine = BatchEngine(opts, out_dir)
    print(f"loaded {opts.load.model_dir} (llm: {opts.load.llm}, device {engine.tts.device}, "
          f"flow {engine.tts.token2wav.flow.precision}) in {time.perf_counter() - t0:.1f} s; "
          f"{opts.concurrency} rows at a time", file=err)
    on_loaded()

    def interrupted(n: int) -> None:
        print(f"\ninterrupted: stopping the {n} row(s) in flight (Ctrl-C again quits at once)", file=err, flush=True)

    try:
        engine.run(todo, on_result, on_interrupt=interrupted)
    finally:
        engine.scheduler.close()


def _summary(out, manifest: Manifest, p: BatchProgress, n_done: int, n_failed_before: int, out_dir: Path) -> None:
    """Rates are per wall second of synthesis (locally from the loaded model on; with Ray from the
    start of the job, the actors' model loads included)."""
    wall = p.elapsed
    n_err = len(manifest.bad) + n_failed_before + p.failed
    print(f"{manifest.n_lines} rows: {n_done + p.ok} ok ({p.ok} now, {n_done} before), {n_err} failed "
          f"({len(manifest.bad)} invalid, {p.failed} now, {n_failed_before} before)", file=out)
    if p.ok:
        stages = ", ".join(f"{k} {p.stage_seconds[k]:.1f}" for k in STAGES + SOME_STAGES
                           if k in STAGES or p.stage_seconds[k])
        print(f"{p.audio_seconds:.1f} s of audio ({p.tokens} tokens) in {wall:.1f} s: {p.ok / wall:.2f} rows/s, "
              f"{p.audio_seconds / wall:.2f} audio-s/s; stage seconds summed over rows: {stages}", file=out)
    if p.captioned:
        why = "".join(f"; without them: {r}" for r in sorted(p.words_why))
        print(f"captions for {p.captioned} row(s), word times in {p.word_level}{why}", file=out)
    if p.bad_takes:
        actions = ", ".join(f"{n} {a}" for a, n in sorted(p.take_actions.items()))
        print(f"bad takes: {p.bad_takes} caught in {p.rows_with_bad_takes} row(s) ({actions}); each is in the "
              f"row's retries in {out_dir / RESULTS}", file=out)
    if p.normalized:
        print(f"loudness: {p.normalized} row(s) brought to their target by gains of {p.gain_db[0]:+.2f} to "
              f"{p.gain_db[1]:+.2f} dB" + (f"; {p.held} sample(s) held at the ceiling" if p.held else ""), file=out)
    if n_err:
        print(f"errors are in {out_dir / RESULTS} (status \"error\")", file=out)
