"""What the container tests share (tests/test_container.py: the image; tests/test_addon.py: the Home Assistant
add-on): podman run rootful with runc and explicit ulimits, the machine's pip configuration mounted into builds,
a Debian root file system made with mmdebstrap (no image registry is reachable from these machines), the
llama.cpp wheel kept per version and flags, a Wyoming client, and the lines written to the terminal."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PODMAN = ["podman", "--runtime", "runc"]  # crun fails on this kernel's cgroup layout
# podman's default rlimits exceed what this sandbox lets a container set
ULIMITS = ["--ulimit", "nofile=16384:16384", "--ulimit", "nproc=16384:16384"]
# the disk a run needs free: its peak measured 14.5 GB over the start (df every 3 s through
# `pytest -m container tests/test_container.py tests/test_addon.py`; two bases, two build stages and their images,
# the layers being written, the pip caches and the test folders), with margin; the images are removed at the end
NEEDS_FREE_GB = 20
HEALTHY_WITHIN_S = 120  # the tiny model: the image's Python, torch and llama.cpp load, then the model
TEXT = "Hello from the container."
# the machine's pip configuration and package directories, mounted into the builds where they exist
PIP_MOUNTS = ["/etc/pip.conf", "/etc/xdg/pip", "/root/.config/pip", "/opt/wheels", "/opt/pypi", "/opt/pypi-more",
              "/etc/ssl/certs/ca-certificates.crt"]


def missing_tools() -> str | None:
    """Why the container tests cannot run here, or None."""
    for tool in ("podman", "runc", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install podman runc mmdebstrap)"
    if os.geteuid() != 0:
        return "the container tests run podman rootful (as root)"
    return None


def report(config, line: str) -> None:
    """A line on the terminal whatever pytest captures (build times, size, the CPU line)."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if tr is not None:
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            tr.write_line(f"[container] {line}")


def podman(*args: str, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])} ... exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                             f"{r.stderr[-3000:]}")
    return r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_or_skip(pytest) -> str:
    """podman's OCI runtime; skips where podman cannot run, fails where its storage lacks the space to build."""
    r = subprocess.run([*PODMAN, "info", "--format", "{{.Host.OCIRuntime.Name}}\n{{.Store.GraphRoot}}"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"podman cannot run here: {r.stderr.strip()[:300]}")
    runtime, root = r.stdout.strip().splitlines()
    free = shutil.disk_usage(root).free / 1e9
    if free < NEEDS_FREE_GB:
        pytest.fail(f"podman's storage ({root}) has {free:.1f} GB free; building and running the images needs "
                    f"{NEEDS_FREE_GB} GB (`podman image prune` removes the untagged images earlier builds left)",
                    pytrace=False)
    return runtime


def dangling_images() -> set[str]:
    """The untagged images podman holds (build stages, images a new build's tag was moved from)."""
    r = podman("images", "--quiet", "--no-trunc", "--filter", "dangling=true", check=False)
    return set(r.stdout.split())


@contextlib.contextmanager
def removed_after(tag: str):
    """Removes, on leaving, the image ``tag`` and every untagged image made meanwhile (a build's stages, the image
    the tag pointed at before), so that runs do not pile images up until the disk is full."""
    before = dangling_images()
    try:
        yield
    finally:
        podman("rmi", "--force", tag, check=False)
        made = sorted(dangling_images() - before)
        if made:
            podman("rmi", "--force", *made, check=False)


def debian_image(tag: str, packages: str, *changes: str, timeout: float = 900) -> float:
    """Debian 12 (bookworm, minbase) with ``packages`` from Debian's own mirror, imported as ``tag`` with the
    image settings ``changes`` (``--change`` lines); the seconds it took."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cosyllama-rootfs-") as tmp:
        tar = Path(tmp) / "rootfs.tar"
        r = subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={packages}", "bookworm",
                            str(tar), "http://deb.debian.org/debian"], capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, r.stderr[-3000:]
        podman("import", *[a for c in changes for a in ("--change", c)], str(tar), tag)
    return time.monotonic() - t0


def kept_llama_wheel() -> tuple[Path, bool]:
    """The llama-cpp-python wheel with every CPU variant, built once per version and flags (deploy/llama-wheel.sh):
    (its directory, whether it was built now)."""
    r = subprocess.run(["sh", str(DEPLOY / "llama-wheel.sh")], capture_output=True, text=True, timeout=5400)
    assert r.returncode == 0, r.stderr[-3000:]
    return Path(r.stdout.strip().splitlines()[-1]), "building" in r.stderr


def pip_mounts() -> list[str]:
    return [f"--volume={p}:{p}:ro" for p in PIP_MOUNTS if os.path.exists(p)]


async def wyoming_session(port: int, *events) -> list:
    from wyoming.client import AsyncTcpClient

    async with AsyncTcpClient("127.0.0.1", port) as client:
        got = []
        for e in events:
            await client.write_event(e.event())
        while True:
            event = await asyncio.wait_for(client.read_event(), 300)
            assert event is not None, f"closed after {[g.type for g in got]}"
            got.append(event)
            if event.type in ("info", "audio-stop", "error"):
                return got


def describe(port: int) -> dict:
    from wyoming.info import Describe

    info = (asyncio.run(wyoming_session(port, Describe())))[-1]
    assert info.type == "info", info
    return info.data


# In an image: whether the flow's bf16 attention kernel was built into it, and why it would not run (None: it runs)
KERNEL_CHECK = ("from cosyllama.flow import native_attention as n; "
                "print((n.PREBUILT / n.library_name()).is_file()); print(n.library()[1])")


def kernel_in_image(image: str) -> tuple[bool, str]:
    """Run :data:`KERNEL_CHECK` in ``image`` (no network, its own entry point bypassed)."""
    r = podman("run", "--rm", *ULIMITS, "--network", "none", "--entrypoint", "python3", image, "-c", KERNEL_CHECK)
    built, why = r.stdout.strip().splitlines()[-2:]
    return built == "True", why


def expected_kernel_problem() -> str:
    """What :data:`KERNEL_CHECK` prints as its second line on this host: the CPU's reason, or None."""
    from cosyllama.flow import native_attention

    return str(native_attention.cpu_problem())
