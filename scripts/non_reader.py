"""Clients that stop reading, per door: the seconds from the last byte a client read until the server
frees its running slot (``/health``'s ``requests_running`` back to what it was), for HTTP
(``POST /v1/audio/speech``, streamed pcm), the WebSocket (``/v1/audio/speech/stream``) and Wyoming
(``synthesize``). Each client uses the socket buffers the kernel gives it, reads until its first
audio has come, then reads nothing more; it holds its connection open until the slot is free or
``--limit`` seconds pass. The server frees it ``--write-timeout`` after its writes stall, and they
stall once its bounded send buffer (docs/architecture.md, "Slow clients") and the client's receive
window are full.

Either targets a running server (--url, and --wyoming HOST:PORT for that door) or starts one
(--model-dir) with ``--write-timeout`` and Wyoming on free 127.0.0.1 ports, and stops it at the end:

    python scripts/non_reader.py --model-dir tests/fixtures/cosyvoice3-tiny/model --write-timeout 10
    python scripts/non_reader.py --url http://127.0.0.1:8000 --wyoming 127.0.0.1:10200 --voice en
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, also when run through runpy
from load_test import free_port, launch_server, stop_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPT = ROOT / "tests" / "fixtures" / "cosyvoice3-tiny" / "wavs" / "prompt_en_16k.wav"
SENTENCE = "This is a long sentence that keeps the model busy for a good while, word after word after word."
DOORS = ("http", "websocket", "wyoming")
FINISHED = {"http": b"\r\n0\r\n\r\n", "websocket": b"session.done", "wyoming": b"audio-stop"}  # a whole answer


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    wyoming_port = free_port()
    proc, url = launch_server(["--model-dir", args.model_dir, "--write-timeout", str(args.write_timeout),
                               "--wyoming", f"tcp://127.0.0.1:{wyoming_port}"], args.start_timeout)
    return proc, url, f"127.0.0.1:{wyoming_port}"


def ensure_voice(url: str, voice: str) -> None:
    ids = [v["id"] for v in httpx.get(f"{url}/v1/voices", timeout=60).json()["voices"]]
    if voice not in ids:
        with open(DEFAULT_PROMPT, "rb") as f:
            r = httpx.post(f"{url}/v1/voices", files={"audio": ("prompt.wav", f.read(), "audio/wav")},
                           data={"id": voice, "text": "Hello, this is my voice."}, timeout=300)
        r.raise_for_status()


def running(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=30).json()["requests_running"]


# -- the three doors: connect, ask for speech, return the socket and what it must read first -------


def http_client(url: str, voice: str, text: str, greedy: bool) -> tuple[socket.socket, bytes]:
    u = urlparse(url)
    body = json.dumps({"input": text, "voice": voice, "stream_format": "audio", "response_format": "pcm",
                       "greedy": greedy}).encode()
    s = socket.create_connection((u.hostname, u.port))
    s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return s, b"\r\n\r\n"  # the headers, then some body


def websocket_client(url: str, voice: str, text: str, greedy: bool) -> tuple[socket.socket, bytes]:
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port))
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall((f"GET /v1/audio/speech/stream HTTP/1.1\r\nHost: {u.hostname}\r\nUpgrade: websocket\r\n"
               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:  # the server's answer, before any frame (byte by byte: nothing more)
        data = s.recv(1)
        if not data:
            raise SystemExit(f"the WebSocket handshake failed: {head!r}")
        head += data
    if not head.startswith(b"HTTP/1.1 101"):
        raise SystemExit(f"the WebSocket handshake failed: {head[:200]!r}")
    for message in ({"type": "session.config", "voice": voice, "response_format": "pcm", "stream_audio": True,
                     "split_granularity": "none", "greedy": greedy}, {"type": "input.text", "text": text},
                    {"type": "input.done"}):
        data = json.dumps(message).encode()
        n = len(data)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n))
        mask = os.urandom(4)
        s.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))
    return s, b"audio.start"  # the handshake, then the first sentence's start and some audio


def wyoming_client(address: str, voice: str, text: str) -> tuple[socket.socket, bytes]:
    host, _, port = address.rpartition(":")
    s = socket.create_connection((host, int(port)))
    data = json.dumps({"text": text, "voice": {"name": voice}}).encode()
    s.sendall(json.dumps({"type": "synthesize", "data_length": len(data)}).encode() + b"\n" + data)
    return s, b"audio-chunk"


def measure(door: str, args, url: str, wyoming: str | None) -> dict:
    """One client of ``door`` that reads its first audio, then nothing: the seconds from its last
    read until the slot is free (None: still held after ``--limit`` s). Starts once no request runs
    (e.g. the warm-up of a voice just registered)."""
    deadline = time.monotonic() + args.limit
    while running(url):
        if time.monotonic() > deadline:
            raise SystemExit(f"the server still runs requests after {args.limit} s; measure on an idle server")
        time.sleep(0.1)
    text = " ".join([SENTENCE] * args.sentences)
    if door == "http":
        s, first = http_client(url, args.voice, text, args.greedy)
    elif door == "websocket":
        s, first = websocket_client(url, args.voice, text, args.greedy)
    else:
        s, first = wyoming_client(wyoming, args.voice, text)
    got = b""
    try:
        s.settimeout(args.limit)
        while first not in got or len(got) < got.find(first) + 4096:  # some audio after the marker
            data = s.recv(4096)
            if not data:
                return {"door": door, "seconds": None, "read": len(got),
                        "note": f"closed before audio: {got[-200:]!r}"}
            got += data
        last_read = time.monotonic()
        deadline = last_read + args.limit
        while running(url):
            if time.monotonic() > deadline:
                return {"door": door, "seconds": None, "read": len(got), "note": f"held past {args.limit} s"}
            time.sleep(0.1)
        seconds = round(time.monotonic() - last_read, 1)
        return {"door": door, "seconds": seconds, "read": len(got), "answer": _rest(s, got, FINISHED[door])}
    finally:
        s.close()


def _rest(s: socket.socket, got: bytes, end: bytes) -> str:
    """Read what is left once the slot is free: "finished" when the whole answer came (the kernel
    had taken it all: the slot was held for the whole synthesis), else "cut"."""
    s.settimeout(5)
    try:
        while data := s.recv(1 << 16):
            got = got[-64:] + data
            if end in got:
                return "finished"
    except OSError:  # reset (the server aborted the connection), or nothing more came
        pass
    return "finished" if end in got else "cut"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (else --model-dir starts one)")
    p.add_argument("--wyoming", help="HOST:PORT of the running server's Wyoming door (with --url)")
    p.add_argument("--model-dir", help="start a server of this model on free loopback ports")
    p.add_argument("--write-timeout", type=float, default=10.0, help="the started server's --write-timeout")
    p.add_argument("--voice", default="en", help="registered from the test prompt when missing")
    p.add_argument("--sentences", type=int, default=3, help="sentences of text per request")
    p.add_argument("--greedy", action="store_true", help="HTTP and WebSocket requests decode greedily (the "
                   "tiny test model's sampled speech ends anywhere; Wyoming cannot ask)")
    p.add_argument("--doors", default=",".join(DOORS), help=f"some of {', '.join(DOORS)}")
    p.add_argument("--limit", type=float, default=300.0, help="seconds to wait for anything")
    p.add_argument("--start-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if bool(args.url) == bool(args.model_dir):
        p.error("give --url or --model-dir")
    proc = None
    url, wyoming = args.url, args.wyoming
    try:
        if proc is None and args.model_dir:
            proc, url, wyoming = start_server(args)
        ensure_voice(url, args.voice)
        doors = [d.strip() for d in args.doors.split(",") if d.strip()]
        if "wyoming" in doors and not wyoming:
            p.error("the wyoming door needs --wyoming HOST:PORT")
        label = f"{args.write_timeout:g}" if args.model_dir else "(the server's)"
        print(f"{'door':<10} {'--write-timeout':>15} {'read (bytes)':>13} {'last read -> slot free (s)':>27} "
              f"{'answer':>8}")
        for door in doors:
            r = measure(door, args, url, wyoming)
            shown = r["seconds"] if r["seconds"] is not None else r["note"]
            print(f"{door:<10} {label:>15} {r['read']:>13} {shown!s:>27} {r.get('answer', '-'):>8}", flush=True)
    finally:
        if proc is not None:
            stop_server(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
