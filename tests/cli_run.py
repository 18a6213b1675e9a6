"""Running ``cosyllama`` as users do, in its own process: the environment that makes the child import
this checkout, a free loopback port, a server started in the background, waited for and stopped.
Imported by the tests that run commands (``from cli_run import ...``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
COSYLLAMA = [sys.executable, "-m", "cosyllama.cli"]
START_TIMEOUT = 180  # seconds for a server to load the tiny model and listen: generous, only a hang reaches it


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a child ``cosyllama``: this checkout first on ``PYTHONPATH``, no API key."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)}
    env.pop("COSYLLAMA_API_KEY", None)
    env.setdefault("COSYLLAMA_AUTO", "rule")  # `--precision auto` by the class rule, not minutes of timing
    return {**env, **extra}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``cosyllama ARGS`` in ``cwd``, to the end; stdout and stderr captured."""
    return subprocess.run([*COSYLLAMA, *args], cwd=cwd, env=cli_env(), capture_output=True, text=True,
                          timeout=timeout)


class Background:
    """A command started in the background (its own process group), its output in ``log``."""

    def __init__(self, argv: list[str], *, cwd: Path, log: Path, env: dict | None = None):
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env or cli_env(), stdout=self._out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def output(self, tail: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-tail:]

    def wait_until(self, ready, what: str, timeout: float = START_TIMEOUT) -> None:
        """Poll ``ready()`` until true; fails (with the output) if the process ends or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"{what}: the process ended with rc {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not ready after {timeout} s:\n{self.output()}")
            time.sleep(0.2)

    def wait_http(self, port: int, path: str = "/health") -> None:
        import httpx

        def ok() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        self.wait_until(ok, f"GET {path} on port {port}")

    def wait_tcp(self, port: int) -> None:
        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                return True
            except OSError:
                return False

        self.wait_until(listening, f"a listener on port {port}")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM to the process group, then SIGKILL if it does not end within ``timeout``."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)
        self._out.close()
        return self.proc.returncode
