"""Load test for `cosyllama serve` on loopback: requests/s, latency and time to first audio chunk
at several numbers of concurrent streams.

Either targets a running local server (--url) or starts one (--model-dir [--gguf]) on a free
127.0.0.1 port and stops it at the end. Every level is bounded by --requests and --time-limit, so
the script always ends by itself.

    python scripts/load_test.py --model-dir tests/fixtures/cosyvoice3-tiny/model --gguf /tmp/tiny-f32.gguf
    python scripts/load_test.py --url http://127.0.0.1:8000 --voice en --concurrency 1,4,16

``--beside-chars N`` runs each level beside one streamed request of N characters (started just
before the level, dropped after it): the latency of short requests beside a long input, against the
same level without it (the number tests/test_server_limits.py used to bound, a benchmark now):

    python scripts/load_test.py --model-dir tests/fixtures/cosyvoice3-tiny/model --gguf /tmp/tiny-f32.gguf \
        --concurrency 1 --requests 3 --beside-chars 4000
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPT = ROOT / "tests" / "fixtures" / "cosyvoice3-tiny" / "wavs" / "prompt_en_16k.wav"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
SAMPLE_RATE = 24_000  # Hz, the server's pcm format
PCM_BYTES = 2
TEXTS = ["Hello there, how are you today?", "The weather is lovely this morning.",
         "Please leave a message after the tone.", "Thank you for calling, goodbye."]
PROSE = ("The quick brown fox jumps over the lazy dog near the river bank, and then it runs away into the "
         "forest. ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a server :func:`start_server` started (SIGTERM, then SIGKILL after 30 s)."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def launch_server(flags: list[str], start_timeout: float) -> tuple[subprocess.Popen, str]:
    """``cosyllama serve`` on a free 127.0.0.1 port with ``flags``, once ``/health`` answers: the
    process and its URL (SystemExit with its log's tail when it exits or does not answer in time)."""
    port = free_port()
    cmd = [sys.executable, "-m", "cosyllama.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with code {proc.returncode}:\n{proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # another process coming up: nothing to block on
    proc.kill()
    raise SystemExit(f"server did not answer within {start_timeout} s")


def start_server(args) -> tuple[subprocess.Popen, str]:
    flags = ["--model-dir", args.model_dir, "--parallel", str(args.parallel)]
    if args.gguf:
        flags += ["--gguf", args.gguf]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    if args.device:
        flags += ["--device", args.device]
    if args.llm_precision:
        flags += ["--llm-precision", args.llm_precision]
    return launch_server(flags, args.start_timeout)


def one_request(url: str, body: dict, timeout: float) -> dict:
    t0 = time.perf_counter()
    first = None
    n = 0
    with httpx.Client(timeout=timeout) as c, c.stream("POST", f"{url}/v1/audio/speech", json=body) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "latency": time.perf_counter() - t0}
        for part in r.iter_bytes():
            if part and first is None:
                first = time.perf_counter() - t0
            n += len(part)
    return {"status": 200, "latency": time.perf_counter() - t0, "first_chunk": first,
            "audio_s": n / PCM_BYTES / SAMPLE_RATE}


def long_request(url: str, voice: str, chars: int, stop: threading.Event, timeout: float) -> None:
    """Stream ``chars`` characters of prose until ``stop`` is set (then drop the connection: the server
    cancels it) or the audio ends."""
    body = {"input": (PROSE * (chars // len(PROSE) + 1))[:chars], "voice": voice, "stream": True,
            "response_format": "pcm"}
    with httpx.Client(timeout=timeout) as c, c.stream("POST", f"{url}/v1/audio/speech", json=body) as r:
        if r.status_code != 200:
            print(f"the long request beside the level got {r.status_code}: {r.read()[:300]!r}", file=sys.stderr)
            return
        for _ in r.iter_bytes():
            if stop.is_set():
                return


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def run_level(url: str, voice: str, concurrency: int, n_requests: int, time_limit: float, timeout: float) -> dict:
    """``n_requests`` streamed requests by ``concurrency`` workers; none starts after ``time_limit``."""
    deadline = time.monotonic() + time_limit
    lock = threading.Lock()
    issued = [0]
    results: list[dict] = []

    def worker():
        while True:
            with lock:
                if issued[0] >= n_requests or time.monotonic() > deadline:
                    return
                i = issued[0]
                issued[0] += 1
            body = {"input": TEXTS[i % len(TEXTS)], "voice": voice, "stream": True, "response_format": "pcm",
                    "seed": i}
            res = one_request(url, body, timeout)
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(worker)
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200]
    lat = [r["latency"] for r in ok]
    ttfc = [r["first_chunk"] for r in ok if r.get("first_chunk") is not None]
    audio = sum(r["audio_s"] for r in ok)
    return {"concurrency": concurrency, "requests": len(results), "ok": len(ok),
            "errors": {str(s): sum(r["status"] == s for r in results) for s in {r["status"] for r in results} - {200}},
            "wall_s": wall, "requests_per_s": len(ok) / wall, "audio_s_per_s": audio / wall,
            "latency_p50": percentile(lat, 50), "latency_p95": percentile(lat, 95),
            "first_chunk_p50": percentile(ttfc, 50), "first_chunk_p95": percentile(ttfc, 95)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running server on loopback, e.g. http://127.0.0.1:8000")
    src.add_argument("--model-dir", help="start `cosyllama serve` on this model directory")
    p.add_argument("--gguf", help="with --model-dir: serve the LLM from this GGUF (llama.cpp)")
    p.add_argument("--parallel", type=int, default=16, help="with --model-dir: llama.cpp sequences (default 16)")
    p.add_argument("--threads", type=int, help="with --model-dir: server CPU threads")
    p.add_argument("--device", help="with --model-dir: serve --device (cpu|cuda)")
    p.add_argument("--llm-precision", help="with --model-dir: serve --llm-precision (torch LLM)")
    p.add_argument("--voice", help="registered voice id to use (default: register --prompt-wav)")
    p.add_argument("--prompt-wav", default=str(DEFAULT_PROMPT))
    p.add_argument("--prompt-text", default="Hello, this is my voice.")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated stream counts (default 1,4,16)")
    p.add_argument("--requests", type=int, default=32, help="requests per level (default 32)")
    p.add_argument("--time-limit", type=float, default=60.0, help="no new request after this many s per level")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, s")
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--beside-chars", type=int, default=0,
                   help="run each level beside one streamed request of this many characters (default 0: none)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    if args.requests < 1 or args.requests > 10_000 or min(levels) < 1 or max(levels) > 256:
        p.error("--requests must be 1..10000 and each concurrency 1..256")

    proc = None
    if args.url:
        host = urlparse(args.url).hostname
        if host not in LOOPBACK:
            p.error(f"--url must be on loopback ({', '.join(sorted(LOOPBACK))}), got {host!r}")
        url = args.url.rstrip("/")
    else:
        proc, url = start_server(args)
    try:
        voice = args.voice
        if voice is None:
            with open(args.prompt_wav, "rb") as f:
                r = httpx.post(f"{url}/v1/voices", files={"audio": ("prompt.wav", f.read(), "audio/wav")},
                               data={"text": args.prompt_text, "id": "load-test"}, timeout=args.timeout)
            r.raise_for_status()
            voice = r.json()["id"]
        one_request(url, {"input": TEXTS[0], "voice": voice, "stream": True, "response_format": "pcm"},
                    args.timeout)  # warm-up
        rows = []
        print(f"{'streams':>7} {'reqs':>5} {'err':>4} {'req/s':>7} {'audio s/s':>9} {'p50 s':>7} {'p95 s':>7} "
              f"{'ttfc p50':>8} {'ttfc p95':>8}")
        for c in levels:
            stop = threading.Event()
            beside = threading.Thread(target=long_request, args=(url, voice, args.beside_chars, stop, args.timeout),
                                      daemon=True)
            if args.beside_chars:
                beside.start()
            try:
                row = run_level(url, voice, c, args.requests, args.time_limit, args.timeout)
            finally:
                stop.set()
                if args.beside_chars:
                    beside.join(args.timeout)
            row["beside_chars"] = args.beside_chars
            rows.append(row)
            print(f"{c:>7} {row['requests']:>5} {row['requests'] - row['ok']:>4} {row['requests_per_s']:>7.2f} "
                  f"{row['audio_s_per_s']:>9.2f} {row['latency_p50'] or 0:>7.3f} {row['latency_p95'] or 0:>7.3f} "
                  f"{row['first_chunk_p50'] or 0:>8.3f} {row['first_chunk_p95'] or 0:>8.3f}", flush=True)
        health = httpx.get(f"{url}/health", timeout=10).json()
        print(f"server: max batch {health.get('max_batch')}, {health.get('decode_steps')} steps for "
              f"{health.get('decoded_tokens')} tokens")
        if args.json:
            Path(args.json).write_text(json.dumps({"url": url, "levels": rows, "health": health}, indent=1))
    finally:
        if proc is not None:
            stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
