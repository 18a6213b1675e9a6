"""Time to first audio of ``/v1/audio/speech/stream`` (text pieces over a WebSocket, as an LLM agent
sends them) against the same text through ``POST /v1/audio/speech`` with a streamed body.

Starts ``cosyllama serve``'s app in this process on a free loopback port (uvicorn, the same
scheduler, admission and threads), registers one voice from the bench's prompt clip
(cross-lingual, no transcript), warms it (``TTS.warm_voice``), runs one untimed request of each
kind, then ``--requests`` timed ones of each in alternating rounds. WebSocket: the clock runs from
sending the first text piece (all pieces go at once, as an LLM writes faster than speech is made)
to the first binary audio frame; HTTP: from sending the request to the first body byte. Both ask
for 16-bit pcm, seed 0, and disconnect after their first audio (the server cancels the rest):

    python scripts/bench_speech_stream.py --threads 2               # full-size random model, Q8_0 GGUF
    python scripts/bench_speech_stream.py --model-dir DIR --llm torch --json out.jsonl
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time

SECOND = "The evening sun sets slowly behind the quiet hills."
VOICE = "bench"


def pieces(text: str, words: int = 3) -> list[str]:
    """``text`` as an LLM streams it: a few words per piece, each with its trailing space."""
    w = text.split(" ")
    return [" ".join(w[i:i + words]) + (" " if i + words < len(w) else "") for i in range(0, len(w), words)]


def ws_first_audio_s(port: int, text: str, timeout: float) -> float:
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream", open_timeout=timeout, max_size=None) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": VOICE, "seed": 0, "response_format": "pcm",
                            "stream_audio": True}))
        t0 = time.perf_counter()
        for p in pieces(text):
            ws.send(json.dumps({"type": "input.text", "text": p}))
        ws.send(json.dumps({"type": "input.done"}))
        while True:
            m = ws.recv(timeout=timeout)
            if isinstance(m, bytes) and m:
                return time.perf_counter() - t0
            if isinstance(m, str) and json.loads(m)["type"] == "error":
                raise RuntimeError(f"the server answered {m}")


def http_first_audio_s(port: int, text: str, timeout: float) -> float:
    import httpx

    body = {"input": text, "voice": VOICE, "seed": 0, "response_format": "pcm", "stream_format": "audio"}
    with httpx.Client(timeout=timeout) as c:
        t0 = time.perf_counter()
        with c.stream("POST", f"http://127.0.0.1:{port}/v1/audio/speech", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"the server answered {r.status_code}: {r.read()[:500]!r}")
            for part in r.iter_bytes():
                if part:
                    return time.perf_counter() - t0
    raise RuntimeError("the server sent no audio")


class Server:
    """uvicorn serving ``app`` on a free 127.0.0.1 port in a thread (its own event loop)."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)  # another thread comes up: nothing to block on

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


def main(argv=None) -> int:
    import cosyllama
    from cosyllama.defaults import MAX_SEQ_TOKENS, SERVE_PARALLEL
    from cosyllama.options import LoadOptions
    from cosyllama.precision import precision_name
    from cosyllama.server.app import create_app
    from cosyllama.server.startup import load_models
    from cosyllama.timing import rounds
    from cosyllama.tools.bench_setup import BENCH_TEXT, ensure_full_model, ensure_gguf, machine_info, prompt_wav

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="model directory (default: the cached full-size random model)")
    p.add_argument("--llm", choices=["llamacpp", "torch"], default="llamacpp")
    p.add_argument("--type", default="Q8_0", help="GGUF type of the speech-layout LLM (default Q8_0)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="auto", help="flow precision")
    p.add_argument("--prompt-seconds", type=float, default=3.0)
    p.add_argument("--requests", type=int, default=3, help="timed requests of each kind")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for one message")
    p.add_argument("--json", help="append one JSON line with the result here")
    args = p.parse_args(argv)
    model = args.model_dir or ensure_full_model(print)
    gguf = ensure_gguf(model, "speech", args.type, print) if args.llm == "llamacpp" else None
    models = load_models(LoadOptions(model, llm=None, gguf=gguf, threads=args.threads, precision=args.precision,
                                     parallel=SERVE_PARALLEL, max_seq_tokens=MAX_SEQ_TOKENS))
    tts = cosyllama.TTS.from_models(models)
    tts.add_voice(VOICE, prompt_wav(args.prompt_seconds))
    kept = tts.warm_voice(VOICE)
    text = f"{BENCH_TEXT} {SECOND}"
    machine = machine_info(args.threads, llm=gguf is not None)
    print(f"CPU: {machine['cpu']}, class {machine['cpu_class']}, {args.threads} threads", flush=True)
    kinds = {"websocket": ws_first_audio_s, "http": http_first_audio_s}
    server = Server(create_app(tts))
    try:
        for measure in kinds.values():  # untimed: first-call costs
            measure(server.port, text, args.timeout)
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for kind in rounds(list(kinds), args.requests):
            t = kinds[kind](server.port, text, args.timeout)
            times[kind].append(t)
            print(f"  {kind}: first audio {t:.2f} s", flush=True)
    finally:
        server.stop()
    flow = precision_name(tts.token2wav.flow.precision)
    what = f"{args.llm} {args.type if gguf else 'fp32'}, flow {flow}, {machine['cpu_class']}, {args.threads} threads"
    for kind, label in (("websocket", "/v1/audio/speech/stream (pieces)"), ("http", "/v1/audio/speech (streamed)")):
        print(f"first audio, {label} ({what}): " + ", ".join(f"{t:.2f}" for t in times[kind]) + " s", flush=True)
    if args.json:
        row = {"llm": args.llm, "type": args.type if gguf else "fp32", "flow": flow, "threads": args.threads,
               "warm_kept": kept, "text": text, "first_audio_s": times, "machine": machine,
               "version": cosyllama.__version__}
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
