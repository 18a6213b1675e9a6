"""The add-on's health check: a Wyoming `describe` to its own server, healthy when an `info` event with a TTS
program comes back. Plain sockets (a Wyoming event is a JSON header line, then its data and payload bytes)."""

from __future__ import annotations

import json
import socket
import sys


def describe(host: str = "127.0.0.1", port: int = 10200, timeout: float = 8.0) -> dict:
    """The ``info`` event's data the server at ``host``:``port`` answers a ``describe`` with."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(b'{"type": "describe"}\n')
        f = s.makefile("rb")
        while True:
            header = json.loads(f.readline() or b"null")
            if header is None:
                raise ConnectionError("closed before answering describe")
            data = header.get("data") or {}
            if header.get("data_length"):
                data.update(json.loads(f.read(header["data_length"])))
            if header.get("payload_length"):
                f.read(header["payload_length"])
            if header.get("type") == "info":
                return data


def main() -> int:
    try:
        info = describe()
    except (OSError, ValueError) as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    if not info.get("tts"):
        print("unhealthy: describe answered without a TTS program", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
