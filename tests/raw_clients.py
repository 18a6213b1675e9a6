"""Raw clients for the server tests: a WebSocket client on a plain socket (it reads only when told,
so it can stop reading altogether) and a Wyoming exchange of raw bytes. Not a test module."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct

from server_helpers import WAIT_S

WS_PATH = "/v1/audio/speech/stream"


class RawWebSocket:
    """A WebSocket client on a plain socket (RFC 6455 frames, masked): nothing is read unless asked,
    so it can stop reading altogether."""

    def __init__(self, port: int, path: str = WS_PATH, rcvbuf: int | None = None):
        self.sock = socket.socket()
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(WAIT_S)
        self.sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            data = self.sock.recv(1)  # byte by byte: nothing after the handshake is read
            assert data, "the server closed the connection during the handshake"
            self.buf += data
        assert self.buf.startswith(b"HTTP/1.1 101"), self.buf
        self.buf = b""

    def send_text(self, text: str) -> None:
        data = text.encode()
        n = len(data)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
                                if n < 1 << 16 else bytes([0x80 | 127]) + struct.pack(">Q", n))
        mask = os.urandom(4)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self.buf += data
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def recv(self) -> tuple[int, bytes]:
        """The next frame: (opcode, payload)."""
        b0, b1 = self._exactly(2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack(">H", self._exactly(2))[0]
        elif n == 127:
            n = struct.unpack(">Q", self._exactly(8))[0]
        return b0 & 0x0F, self._exactly(n)

    def refused(self) -> tuple[dict, int]:
        """The ``error`` message the server answers with, and the close code after it."""
        op, payload = self.recv()
        assert op == 1, (op, payload[:200])
        message = json.loads(payload)
        assert message["type"] == "error", message
        op, payload = self.recv()
        assert op == 8, (op, payload[:200])
        return message, struct.unpack(">H", payload[:2])[0]

    def close(self) -> None:
        self.sock.close()


def wyoming_exchange(port: int, raw: bytes) -> list[tuple[str, dict]]:
    """Send ``raw``; the events the server answers until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(WAIT_S)
        s.sendall(raw)
        return read_wyoming_events(s)


def read_wyoming_events(s: socket.socket) -> list[tuple[str, dict]]:
    """What the server sends on ``s`` until it closes the connection (or resets it): (type, data) of each event."""
    got = b""
    try:
        while data := s.recv(65536):
            got += data
    except ConnectionResetError:
        pass
    events = []
    while got:
        line, _, got = got.partition(b"\n")
        header = json.loads(line)
        n = header.get("data_length", 0)
        data, got = (json.loads(got[:n]) if n else {}), got[n + header.get("payload_length", 0):]
        events.append((header["type"], data))
    return events


def wyoming_event(kind: str, data: dict) -> bytes:
    body = json.dumps(data).encode()
    return json.dumps({"type": kind, "data_length": len(body)}).encode() + b"\n" + body
