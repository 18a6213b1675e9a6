"""Time from the first text piece to the first audio chunk over the Wyoming protocol, as Home
Assistant streams an LLM's answer: ``synthesize-start``, three sentence pieces, and the clock runs
from the first piece to the first ``audio-chunk``.

Starts the Wyoming server in this process on a free loopback port (the same code as
``cosyllama wyoming``: scheduler, admission, threads; one server per setting, kept across its
requests), registers one voice from the bench's prompt clip (cross-lingual, no transcript), warms it
(``TTS.warm_voice``) and runs one request untimed on each server, then ``--requests`` timed ones,
each disconnecting after its first audio chunk. Every sentence
decodes a forced ``--max-tokens`` (random weights have no natural stop), as
``bench_first_audio.py`` does, so the rows compare with its "first audio of a warmed voice":

    python scripts/bench_wyoming.py --threads 2                 # full-size random model, Q8_0 GGUF
    python scripts/bench_wyoming.py --model-dir DIR --llm torch --json out.jsonl
    python scripts/bench_wyoming.py --threads 2 --interleave off,first,all   # the scheduler's modes, in turns
    python scripts/bench_wyoming.py --threads 2 --first-chunk-tokens none,10 # the low-latency first chunk, in turns
    python scripts/bench_wyoming.py --threads 2 --concurrent 2 --max-tokens 50 # 2 sessions at once, to their ends
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace

PIECES = ("The quick brown fox jumps over the lazy dog. ", "The evening sun sets slowly behind the quiet hills. ",
          "The old town falls asleep.")
VOICE = "bench"


async def session_s(port: int, timeout: float, to_end: bool = False) -> tuple[float, float | None]:
    """Seconds from sending the first text piece to the first audio chunk, and (``to_end``: the client
    sends ``synthesize-stop`` and reads on) to ``synthesize-stopped``, the end of the session's audio."""
    from wyoming.client import AsyncTcpClient
    from wyoming.tts import SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice

    client = AsyncTcpClient("127.0.0.1", port, read_timeout=timeout)
    await client.connect()
    try:
        await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name=VOICE)).event())
        t0 = time.perf_counter()
        for piece in PIECES:  # an LLM writes faster than speech is made: all of it at once
            await client.write_event(SynthesizeChunk(text=piece).event())
        if to_end:
            await client.write_event(SynthesizeStop().event())
        first = None
        while (event := await client.read_event()) is not None:
            if event.type == "audio-chunk" and event.payload and first is None:
                first = time.perf_counter() - t0
                if not to_end:
                    return first, None
            if event.type == "synthesize-stopped" and first is not None:
                return first, time.perf_counter() - t0
            if event.type == "error":
                raise RuntimeError(f"the server answered {event.data}")
        raise RuntimeError("the server closed the connection before the end of the audio")
    finally:
        await client.disconnect()  # cancels the rest of the session


async def first_audio_s(port: int, timeout: float) -> float:
    """Seconds from sending the first text piece to receiving the first audio chunk."""
    return (await session_s(port, timeout))[0]


def main(argv=None) -> int:
    import cosyllama
    from cosyllama.defaults import MAX_SEQ_TOKENS, SERVE_PARALLEL
    from cosyllama.options import LoadOptions
    from cosyllama.precision import precision_name
    from cosyllama.server.options import ServingOptions
    from cosyllama.server.serving import prepare
    from cosyllama.server.startup import load_models
    from cosyllama.server.wyoming_server import start_wyoming
    from cosyllama.timing import rounds
    from cosyllama.tools.bench_setup import ensure_full_model, ensure_gguf, prompt_wav
    from cosyllama.tts import SynthesisOptions

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="model directory (default: the cached full-size random model)")
    p.add_argument("--llm", choices=["llamacpp", "torch"], default="llamacpp")
    p.add_argument("--type", default="Q8_0", help="GGUF type of the speech-layout LLM (default Q8_0)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--precision", default="auto", help="flow precision")
    p.add_argument("--prompt-seconds", type=float, default=3.0)
    p.add_argument("--max-tokens", type=int, default=250, help="speech tokens each sentence decodes (forced)")
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for one event")
    p.add_argument("--interleave", default="auto",
                   help="comma list of the server's --interleave settings (auto, off, first, all), timed in turns")
    p.add_argument("--first-chunk-tokens", default="none",
                   help="comma list of the server's --first-chunk-tokens (none: the reference's schedule), in turns")
    p.add_argument("--concurrent", type=int, default=1,
                   help="sessions at once per timed round, each read to the end of its audio (default 1: one "
                        "session, closed after its first audio chunk)")
    p.add_argument("--json", help="append one JSON line with the result here")
    args = p.parse_args(argv)
    model = args.model_dir or ensure_full_model(print)
    gguf = ensure_gguf(model, "speech", args.type, print) if args.llm == "llamacpp" else None
    models = load_models(LoadOptions(model, llm=None, gguf=gguf, threads=args.threads, precision=args.precision,
                                     parallel=SERVE_PARALLEL, max_seq_tokens=MAX_SEQ_TOKENS))
    tts = cosyllama.TTS.from_models(models)
    tts.add_voice(VOICE, prompt_wav(args.prompt_seconds))
    options = SynthesisOptions(ignore_stop=True, max_tokens=args.max_tokens)
    interleaves = [x.strip() for x in args.interleave.split(",") if x.strip()]
    modes = {"auto": None, "off": "off", "first": "first", "all": "all"}
    if not interleaves or any(x not in modes for x in interleaves):
        p.error(f"--interleave {args.interleave!r}: a comma list of auto, off, first, all")
    try:
        firsts = [None if x.strip() == "none" else int(x) for x in args.first_chunk_tokens.split(",") if x.strip()]
    except ValueError:
        p.error(f"--first-chunk-tokens {args.first_chunk_tokens!r}: a comma list of none and numbers of tokens")
    t0 = time.perf_counter()
    kept = tts.warm_voice(VOICE, low_latency=any(firsts))  # as a server started with such a setting warms it
    warm_s = time.perf_counter() - t0
    settings = [f"{i}/{f or 'ref'}" for i in interleaves for f in firsts]  # "interleave/first chunk"
    if args.concurrent < 1:
        p.error("--concurrent: 1 or more sessions")
    ends: dict[str, list[float]] = {x: [] for x in settings}  # --concurrent: each session's end of audio

    async def run() -> dict[str, list[float]]:
        # one server per setting, each with a scheduler of its own, kept across its requests as a running
        # server is (its model threads too)
        servers = {}
        try:
            for setting in settings:
                interleave, first = setting.split("/")
                defaults = replace(options, first_chunk_tokens=None if first == "ref" else int(first))
                serving = prepare(models, ServingOptions(models.options, interleave=modes[interleave],
                                                         defaults=defaults), voices=tts.voices)
                servers[setting] = (serving, await start_wyoming("tcp://127.0.0.1:0", serving))
                await first_audio_s(servers[setting][1].address[1], args.timeout)  # untimed: first-call costs
            out: dict[str, list[float]] = {x: [] for x in settings}
            for setting in rounds(settings, args.requests):
                serving, server = servers[setting]
                if args.concurrent == 1:
                    t = await first_audio_s(server.address[1], args.timeout)
                    out[setting].append(t)
                    print(f"  --interleave/--first-chunk-tokens {setting} ({serving.scheduler.interleave}): "
                          f"first audio {t:.2f} s", flush=True)
                    continue
                times = await asyncio.gather(*(session_s(server.address[1], args.timeout, to_end=True)
                                               for _ in range(args.concurrent)))
                out[setting].extend(first for first, _ in times)
                ends[setting].extend(end for _, end in times)
                print(f"  --interleave/--first-chunk-tokens {setting} ({serving.scheduler.interleave}), "
                      f"{args.concurrent} sessions at once: first audio / end "
                      + ", ".join(f"{a:.2f} / {b:.2f}" for a, b in times) + " s", flush=True)
            return out
        finally:
            for serving, server in servers.values():
                await server.stop()
                serving.close()

    results = asyncio.run(run())
    flow = precision_name(tts.token2wav.flow.precision)
    for setting, times in results.items():
        print(f"wyoming first audio ({args.llm} {args.type if gguf else 'fp32'}, flow {flow}, --interleave/"
              f"--first-chunk-tokens {setting}, "
              f"voice warmed in {warm_s:.2f} s, {'kept' if kept else 'nothing kept'}): "
              + ", ".join(f"{t:.2f}" for t in times) + " s", flush=True)
        if args.json:
            row = {"llm": args.llm, "type": args.type if gguf else "fp32", "flow": flow, "threads": args.threads,
                   "interleave": setting.split("/")[0], "first_chunk_tokens": setting.split("/")[1],
                   "warm_kept": kept, "max_tokens": args.max_tokens, "first_audio_s": times,
                   "concurrent": args.concurrent, **({"end_s": ends[setting]} if args.concurrent > 1 else {}),
                   "version": cosyllama.__version__}
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
