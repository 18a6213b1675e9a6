"""The container image (deploy/Containerfile), built and run here with podman (rootful, runc): the tiny model
mounted, the HTTP API, Wyoming, volumes, a read-only root, no network, SIGTERM. Marked ``container`` (``.ci/run``
runs them with the Home Assistant add-on's, tests/test_addon.py, in a step of their own); skipped with the reason
where podman, runc or mmdebstrap is missing or podman cannot run a container.

No image registry is reachable from these machines, so the base image is made from Debian's packages
(mmdebstrap, then ``podman import``) and passed as the build's BASE_IMAGE; pip inside the build reaches the
package indexes this machine has (its pip configuration, wheel directories and CA bundle are mounted for the
build). llama-cpp-python with every ggml CPU variant is built once per version and flags
(deploy/llama-wheel.sh) and mounted at /wheels.

Build and run times, the image's size and the CPU line the image prints are written to the terminal."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from container_helpers import (
    DEPLOY,
    HEALTHY_WITHIN_S,
    PODMAN,
    ROOT,
    TEXT,
    ULIMITS,
    debian_image,
    describe,
    engine_or_skip,
    expected_kernel_problem,
    free_port,
    kept_llama_wheel,
    kernel_in_image,
    missing_tools,
    pip_mounts,
    podman,
    removed_after,
    report,
    wyoming_session,
)
from cosyllama.cpu import ggml_cpu_variant, kernel_flags
from helpers import MODEL_DIR
from server_helpers import PROMPT_TEXT, PROMPT_WAV

pytestmark = pytest.mark.container

TAG = "localhost/cosyllama:test"
BASE_TAG = "localhost/cosyllama-base:bookworm"
BASE_PACKAGES = "python3,python3-venv,ca-certificates,tini"
STOP_WITHIN_S = 10
API_KEY = "test-key-" + uuid.uuid4().hex[:8]
SEED = 5

if (_why := missing_tools()) is not None:
    pytest.skip(_why, allow_module_level=True)


# -- building --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def engine():
    return engine_or_skip(pytest)


@pytest.fixture(scope="session")
def base_image(engine, pytestconfig):
    """A Debian 12 base (what debian:bookworm-slim is, plus Python and tini) from Debian's packages."""
    with removed_after(BASE_TAG):
        took = debian_image(BASE_TAG, BASE_PACKAGES)
        report(pytestconfig, f"base image {BASE_TAG} (mmdebstrap bookworm minbase + {BASE_PACKAGES}): {took:.0f} s")
        yield BASE_TAG


@pytest.fixture(scope="session")
def llama_wheel(pytestconfig) -> Path:
    """The llama-cpp-python wheel with every CPU variant, built once per version and flags."""
    t0 = time.monotonic()
    wheels, built = kept_llama_wheel()
    report(pytestconfig, f"llama-cpp-python wheel {wheels.name}: "
                         + (f"built in {time.monotonic() - t0:.0f} s" if built else "cached"))
    return wheels


def build_mounts(wheels: Path) -> list[str]:
    return [f"--volume={wheels}:/wheels:ro", *pip_mounts()]


@pytest.fixture(scope="session")
def image(base_image, llama_wheel, pytestconfig, tmp_path_factory):
    with removed_after(TAG):
        yield build_image(llama_wheel, base_image, pytestconfig, tmp_path_factory.mktemp("build") / "image-build.log")


def build_image(llama_wheel: Path, base_image: str, pytestconfig, log: Path) -> str:
    t0 = time.monotonic()
    # --format docker: OCI images carry no HEALTHCHECK; --network host: the machine's indexes, as pip has them
    r = subprocess.run([*PODMAN, "build", "--format", "docker", "--network", "host", *ULIMITS,
                        *build_mounts(llama_wheel), "--build-arg", f"BASE_IMAGE={base_image}",
                        "--build-arg", "TORCH_INDEX=", "-f", str(DEPLOY / "Containerfile"), "-t", TAG, str(ROOT)],
                       stdout=log.open("w"), stderr=subprocess.STDOUT, timeout=3600)
    build_s = time.monotonic() - t0
    assert r.returncode == 0, log.read_text()[-5000:]
    assert "the wheel in /wheels" in log.read_text()  # the kept wheel, not a second build of llama.cpp
    size = int(podman("image", "inspect", "--format", "{{.Size}}", TAG).stdout.strip())
    report(pytestconfig, f"image {TAG}: built in {build_s:.0f} s (base and wheel ready), {size / 1e6:.0f} MB")
    pytestconfig.cache.set("cosyllama/container_image", {"size": size, "build_s": round(build_s)})
    return TAG


@pytest.fixture(scope="session")
def models(tmp_path_factory, tiny_gguf) -> Path:
    """The tiny model directory with its GGUF (F32), as a user mounts the official one at /models."""
    d = tmp_path_factory.mktemp("models") / "model"
    shutil.copytree(MODEL_DIR, d)
    shutil.copy(tiny_gguf("speech", "F32"), d / "cv3-tiny-f32.gguf")
    for p in [d, *d.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    d.parent.chmod(0o755)
    return d


# -- running -----------------------------------------------------------------------------------------------------


class Container:
    """A started container of the image and its published ports."""

    def __init__(self, name: str, http: int | None, wyoming: int | None):
        self.name, self.http, self.wyoming = name, http, wyoming

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def logs(self) -> str:
        r = podman("logs", self.name, check=False)
        return r.stdout + r.stderr

    def state(self) -> dict:
        return json.loads(podman("inspect", "--format", "{{json .State}}", self.name).stdout)

    def wait_healthy(self, timeout: float = HEALTHY_WITHIN_S) -> float:
        """Seconds until GET /health answers 200 through the published port."""
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - t0
            assert self.state()["Running"], f"the container stopped:\n{self.logs()[-4000:]}"
            time.sleep(1)
        raise AssertionError(f"/health not healthy within {timeout} s:\n{self.logs()[-4000:]}")

    def exec(self, *cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return podman("exec", self.name, *cmd, timeout=timeout)

    def remove(self) -> None:
        podman("rm", "--force", "--time", "0", self.name, check=False)


@pytest.fixture(scope="session")
def start(image, models):
    """``start(*run_args, env=..., network=..., publish=True, command=()) -> Container``; removed at the end."""
    started: list[Container] = []

    def run(*args: str, env: dict | None = None, network: str | None = None, publish: bool = True,
            command: tuple = (), model_mount: bool = True, wait: bool = True, img: str = image) -> Container:
        name = f"cosyllama-test-{uuid.uuid4().hex[:8]}"
        http, wyoming = (free_port(), free_port()) if publish else (None, None)
        argv = ["run", "--detach", "--name", name, *ULIMITS]
        argv += ["--network", network] if network else []
        argv += ["-p", f"127.0.0.1:{http}:8000", "-p", f"127.0.0.1:{wyoming}:10200"] if publish else []
        argv += ["--volume", f"{models}:/models:ro"] if model_mount else []
        for k, v in {"COSYLLAMA_AUTO": "rule", **(env or {})}.items():
            argv += ["--env", f"{k}={v}"]
        # one thread and fp32: the audio does not depend on which CPU path auto would pick
        serve_flags = ("--threads", "1", "--precision", "fp32", "--parallel", "2")
        podman(*argv, *args, img, *(command or ("serve", *serve_flags)))
        c = Container(name, http, wyoming)
        started.append(c)
        if wait and publish:
            c.wait_healthy()
        return c

    yield run
    for c in started:
        c.remove()


@pytest.fixture(scope="session")
def volumes():
    """``volumes(*names) -> [podman volume names]``, removed at the end."""
    made: list[str] = []

    def make(*names: str) -> list[str]:
        out = [f"cosyllama-test-{n}-{uuid.uuid4().hex[:6]}" for n in names]
        for v in out:
            podman("volume", "create", v)
        made.extend(out)
        return out

    yield make
    for v in made:
        podman("volume", "rm", "--force", v, check=False)


def key_file(tmp_path: Path) -> Path:
    f = tmp_path / "api_key"
    f.write_text(API_KEY + "\n")
    f.chmod(0o644)
    return f


@pytest.fixture(scope="session")
def server(start, volumes, tmp_path_factory):
    """The image served as a user runs it: the model on /models, voices and cache on volumes, the API key from a
    secret file, both ports published; the voice ``en`` registered over HTTP."""
    import httpx

    voices, cache = volumes("voices", "cache")
    kf = key_file(tmp_path_factory.mktemp("secret"))
    c = start("--volume", f"{voices}:/voices", "--volume", f"{cache}:/cache",
              "--volume", f"{kf}:/run/secrets/cosyllama_api_key:ro")
    c.voices, c.cache, c.key_file = voices, cache, kf
    r = httpx.post(f"{c.url}/v1/voices", files={"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")},
                   data={"text": PROMPT_TEXT, "id": "en"}, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=120)
    assert r.status_code == 200, r.text
    return c


def speech_pcm(url: str, key: str | None = API_KEY, **body) -> bytes:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(f"{url}/v1/audio/speech", headers=headers, timeout=300,
                   json={"input": TEXT, "voice": "en", "seed": SEED, "response_format": "pcm", **body})
    assert r.status_code == 200, r.text
    return r.content


# -- the tests ---------------------------------------------------------------------------------------------------


def test_image_size_and_build_time(image, pytestconfig):
    got = pytestconfig.cache.get("cosyllama/container_image", None)
    assert got is not None
    assert got["size"] < 2_500_000_000, f"image of {got['size'] / 1e6:.0f} MB"
    history = podman("history", "--format", "{{.CreatedBy}}", image).stdout
    assert "g++" not in podman("run", "--rm", *ULIMITS, "--entrypoint", "sh", image, "-c",
                               "command -v g++ cc gcc || true").stdout, "a compiler in the final image"
    assert "llama" in history


def test_the_bf16_attention_kernel_is_built_into_the_image(image):
    """Compiled at build time (the final image has no compiler): it loads on a CPU with AVX512-BF16, and on any
    other it is never loaded, for the CPU's reason (cosyllama.flow.native_attention)."""
    built, why = kernel_in_image(image)
    assert built and why == expected_kernel_problem()


def test_health_is_healthy_in_time_and_the_healthcheck_agrees(start, pytestconfig):
    c = start(wait=False)
    took = c.wait_healthy(HEALTHY_WITHIN_S)
    report(pytestconfig, f"/health healthy {took:.0f} s after start (bound {HEALTHY_WITHIN_S} s)")
    r = podman("healthcheck", "run", c.name, check=False)
    assert r.returncode == 0, (r.stdout, r.stderr, c.logs()[-2000:])


def test_cpu_line_names_the_ggml_variant_this_cpu_gets(server, pytestconfig):
    """The server prints the CPU line at start; its llama.cpp part names the CPU variant ggml loaded, the best
    this CPU runs: haswell on an AVX2 CPU without AVX-512, sapphirerapids on an AMX one, and so on."""
    logs = server.logs()
    lines = [ln for ln in logs.splitlines() if ln.lstrip().startswith(("cpu:", "llama.cpp build:"))]
    for ln in lines:
        report(pytestconfig, "CPU line: " + ln.strip())
    found = re.search(r"ggml CPU variant (\w+)", logs)
    assert found, logs[-3000:]
    variant = found.group(1)
    # the container runs natively: its CPUID is this process's (cosyllama.cpu.ggml_cpu_variant, ggml's score)
    assert variant == ggml_cpu_variant(), (variant, sorted(kernel_flags()))
    assert variant not in ("x64", "sse42"), "a baseline variant on an x86-64 CPU with AVX"


def test_openai_sdk_through_the_published_port_equals_a_direct_call(server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300) as client:
        r = client.audio.speech.with_raw_response.create(model="cosyvoice3", voice="en", input=TEXT,
                                                         response_format="pcm", extra_body={"seed": SEED})
        sdk = r.content
    direct = speech_pcm(server.url)
    assert len(sdk) > 24_000 // 4 * 2
    np.testing.assert_array_equal(np.frombuffer(sdk, "<i2"), np.frombuffer(direct, "<i2"))


def test_api_key_comes_from_the_secret_file(server):
    import httpx

    assert httpx.get(f"{server.url}/v1/voices", timeout=30).status_code == 401
    r = httpx.get(f"{server.url}/v1/voices", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # no key for the health check


def test_wyoming_answers_describe_and_synthesizes(server):
    from wyoming.tts import Synthesize, SynthesizeVoice

    info = describe(server.wyoming)
    names = [v["name"] for v in info["tts"][0]["voices"]]
    assert "en" in names, names
    events = asyncio.run(wyoming_session(server.wyoming, Synthesize(text=TEXT, voice=SynthesizeVoice(name="en"))))
    assert [e.type for e in events][0] == "audio-start" and events[-1].type == "audio-stop", [e.type for e in events]
    audio = b"".join(e.payload or b"" for e in events if e.type == "audio-chunk")
    assert len(audio) > 24_000 // 4 * 2


def test_the_server_runs_as_uid_1000(server):
    c = server
    assert c.exec("id", "-u").stdout.strip() == "1000"
    pid = int(podman("inspect", "--format", "{{.State.Pid}}", c.name).stdout)  # tini, PID 1 inside
    procs = [pid] + [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in procs:
        status = Path(f"/proc/{p}/status").read_text()
        uids = re.search(r"^Uid:\s+(.*)$", status, re.M).group(1).split()
        assert set(uids) == {"1000"}, (p, Path(f"/proc/{p}/cmdline").read_text(), uids)
    assert any("cosyllama" in Path(f"/proc/{p}/cmdline").read_text() for p in procs[1:])


def test_a_voice_registered_over_http_survives_recreating_the_container(server, start):
    import httpx

    server.remove()
    again = start("--volume", f"{server.voices}:/voices", "--volume", f"{server.cache}:/cache",
                  env={"COSYLLAMA_API_KEY": API_KEY})
    r = httpx.get(f"{again.url}/v1/voices", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200 and "en" in r.text, r.text
    assert len(speech_pcm(again.url)) > 0


CLIENT_INSIDE = """
import json, socket, urllib.request
h = json.load(urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=30))
req = urllib.request.Request("http://127.0.0.1:8000/v1/audio/speech", method="POST",
    data=json.dumps({"input": "No network here.", "voice": "alloy", "response_format": "pcm", "seed": 1}).encode(),
    headers={"Content-Type": "application/json"})
pcm = urllib.request.urlopen(req, timeout=300).read()
s = socket.create_connection(("127.0.0.1", 10200), timeout=30)
s.sendall(b'{"type": "describe"}\\n')
print(json.dumps({"health": h.get("status"), "pcm": len(pcm), "wyoming": s.makefile("rb").readline().decode()}))
"""


def test_network_none_starts_and_answers_a_client_inside(start, tmp_path):
    """No network at all: the server starts from the mounted model (nothing reaches for a hub or an index) and
    answers a client run inside the container, over HTTP and Wyoming."""
    voices = tmp_path / "voices" / "alloy"
    voices.mkdir(parents=True)
    shutil.copy(PROMPT_WAV, voices / "ref.wav")
    (voices / "ref.txt").write_text(PROMPT_TEXT)
    os.chown(voices.parent, 1000, 1000)
    os.chown(voices, 1000, 1000)
    c = start("--volume", f"{voices.parent}:/voices", network="none", publish=False)
    deadline = time.monotonic() + HEALTHY_WITHIN_S
    while True:
        r = podman("exec", c.name, "python3", "-c", CLIENT_INSIDE, check=False, timeout=400)
        if r.returncode == 0:
            break
        assert c.state()["Running"], c.logs()[-4000:]
        assert time.monotonic() < deadline, (r.stderr[-2000:], c.logs()[-3000:])
        time.sleep(2)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["pcm"] > 24_000 // 4 * 2 and '"info"' in got["wyoming"], got
    net = podman("inspect", "--format", "{{json .NetworkSettings.Networks}}", c.name).stdout.strip()
    assert net in ("null", "{}"), net


def test_read_only_root_with_the_cache_volume(start, volumes):
    """--read-only: only the volumes are writable; the flow's precision check (auto) is kept in the cache."""
    voices, cache = volumes("ro-voices", "ro-cache")
    c = start("--read-only", "--volume", f"{voices}:/voices", "--volume", f"{cache}:/cache",
              command=("serve", "--threads", "1"), env={"COSYLLAMA_AUTO": "measure"})
    import httpx

    r = httpx.post(f"{c.url}/v1/voices", files={"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")},
                   data={"text": PROMPT_TEXT, "id": "en"}, timeout=120)
    assert r.status_code == 200, r.text
    assert len(speech_pcm(c.url, key=None)) > 0
    assert c.exec("sh", "-c", "touch /opt/x 2>&1 || echo refused").stdout.strip().endswith("refused")
    listing = c.exec("sh", "-c", "ls -A /cache /voices").stdout
    assert "en.pt" in listing and "precision-checks.json" in listing, listing


def test_sigterm_stops_it_within_10_s(start, pytestconfig):
    """SIGTERM (podman stop, docker stop) reaches the server through tini; it shuts down cleanly and exits
    within 10 s. The exit status is 143 (128 + SIGTERM): uvicorn re-raises the signal once it has shut down."""
    c = start()
    t0 = time.monotonic()
    podman("kill", "--signal", "TERM", c.name)
    podman("wait", c.name, timeout=STOP_WITHIN_S + 20)
    took = time.monotonic() - t0
    state, logs = c.state(), c.logs()
    assert took < STOP_WITHIN_S and state["ExitCode"] in (0, 143), (took, state, logs[-2000:])
    assert "Application shutdown complete." in logs and "Traceback" not in logs, logs[-3000:]
    report(pytestconfig, f"SIGTERM: stopped in {took:.1f} s, exit status {state['ExitCode']}")


def test_demo_runs_with_no_weights_and_no_network(image, volumes, pytestconfig):
    """`podman run IMAGE demo`: the full-size random model made in the cache, both backends, nothing fetched."""
    (cache,) = volumes("demo-cache")
    t0 = time.monotonic()
    r = podman("run", "--rm", *ULIMITS, "--network", "none", "--volume", f"{cache}:/cache", image,
               "demo", "--seconds", "1", "--threads", "2", timeout=1800, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "RTF" in out and "llamacpp" in out
    report(pytestconfig, f"demo (no weights, --network none) in {time.monotonic() - t0:.0f} s; its CPU lines:")
    for ln in out.splitlines():
        if ln.strip().startswith(("cpu:", "llama.cpp build:")):
            report(pytestconfig, "  " + ln.strip())
