"""The Home Assistant add-on on the path Home Assistant's Supervisor takes, step by step as its source does them
(tests/supervisor_steps.py says what is reproduced): the store reads this repository as a clone of its URL
(repository.yaml at the root, the add-on found by its config.yaml), the image is built from the add-on's folder
alone with build.yaml's base and the build arguments for amd64, the user's options are validated against
config.yaml's schema and written to /data/options.json, then the container starts with /data and /share as the
Supervisor mounts them: it converts the GGUF on first start, announces its Wyoming server (discovery), answers
`describe` and a synthesis, and stops on SIGTERM within the Supervisor's 10 s. A user's mistake stops it with
one line and exit status 2, and nothing restarts it. Marked ``container`` (``.ci/run``'s fifth pass).

Stand-ins, since no image registry and no Home Assistant are reachable from these machines:
- The base image ghcr.io/home-assistant/amd64-base-debian:bookworm is a local image TAGGED WITH THAT SAME NAME,
  made from Debian 12's packages with mmdebstrap (minbase and ca-certificates: no Python, as on the real base),
  whose entry point is the real base's /init (s6), absent here, so the add-on must set its own. The Supervisor
  builds with `docker build --pull`; `podman build --pull=never` takes the local image instead. Its tag is
  removed at the end.
- The released cosyllama is a wheel built from this tree, handed to the build at /wheels beside the kept
  llama.cpp wheel (the Dockerfile installs from /wheels where a build mounts one, else from the package index);
  torch comes from this machine's indexes (the build argument TORCH_INDEX= replaces PyTorch's CPU index).
- The Supervisor's discovery endpoint is a small HTTP server in a container known as `supervisor` on the add-on's
  network, as the Supervisor is on its `hassio` network; the Wyoming port is published on 127.0.0.1 for the
  test's client, where Home Assistant reaches it by the add-on's hostname.
Build and run times are written to the terminal."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

import pytest

import supervisor_steps as sv
from container_helpers import (
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
from helpers import MODEL_DIR
from server_helpers import PROMPT_TEXT, PROMPT_WAV

pytestmark = pytest.mark.container

if (_why := missing_tools()) is not None:
    pytest.skip(_why, allow_module_level=True)

URL = "https://github.com/cosyllama/cosyllama"  # the repository a user adds in the store
ARCH = "amd64"
HA_BASE_PACKAGES = "ca-certificates"
STOP_WITHIN_S = 10  # the Supervisor's stop timeout unless config.yaml sets `timeout`
CONVERT_WITHIN_S = 120  # the tiny model's GGUF on first start
FAKE_SUPERVISOR = r"""
import http.server, json
class Supervisor(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        print(json.dumps({"path": self.path, "auth": self.headers["Authorization"], "body": body}), flush=True)
        answer = json.dumps({"result": "ok", "data": {"uuid": "0" * 32}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)
http.server.HTTPServer(("0.0.0.0", 80), Supervisor).serve_forever()
"""


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    """The store's reading of this repository, cloned into the folder its URL's hash names."""
    clone = sv.copy_as_cloned(ROOT, tmp_path_factory.mktemp("addons-git") / sv.repository_hash(URL))
    _, addons, _ = sv.discover(clone)
    ((slug, config),) = addons.items()
    return SimpleNamespace(clone=clone, slug=slug, config=config, plan=sv.build_plan(config, slug, ARCH))


@pytest.fixture(scope="session")
def ha_base(store, pytestconfig):
    engine_or_skip(pytest)
    base = store.plan["base"]
    assert base.startswith("ghcr.io/home-assistant/"), base  # a registry image the Supervisor's --pull can fetch
    with removed_after(base):
        took = debian_image(base, HA_BASE_PACKAGES, 'ENTRYPOINT ["/init"]')
        report(pytestconfig, f"stand-in {base} (mmdebstrap bookworm minbase + {HA_BASE_PACKAGES}): {took:.0f} s")
        yield base


@pytest.fixture(scope="session")
def release(store, tmp_path_factory, pytestconfig):
    """(a wheel directory holding cosyllama's wheel built from this tree and the kept llama.cpp wheel, its version)."""
    out = tmp_path_factory.mktemp("wheels")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(out), str(store.clone)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = out.glob("cosyllama-*.whl")
    built = time.monotonic() - t0
    llama, _ = kept_llama_wheel()
    for f in llama.iterdir():  # the wheel and its BUILD file (version and flags)
        shutil.copy2(f, out / f.name)
    report(pytestconfig, f"release wheel {wheel.name}: {built:.0f} s")
    return out, wheel.name.split("-")[1]


@pytest.fixture(scope="session")
def addon_image(store, ha_base, release, pytestconfig, tmp_path_factory):
    """The image the Supervisor builds: the add-on's folder, its build arguments and labels for amd64."""
    wheels, version = release
    plan = store.plan
    assert plan["args"]["COSYLLAMA_VERSION"] == version  # build.yaml installs the release of this tree
    args = {**plan["args"], "TORCH_INDEX": ""}
    with removed_after(plan["tag"]):
        log = tmp_path_factory.mktemp("addon-build") / "build.log"
        t0 = time.monotonic()
        r = subprocess.run([*PODMAN, "build", "--format", "docker", "--pull=never", "--network", "host", *ULIMITS,
                            f"--volume={wheels}:/wheels:ro", *pip_mounts(),
                            *[a for k, v in args.items() for a in ("--build-arg", f"{k}={v}")],
                            *[a for k, v in plan["labels"].items() for a in ("--label", f"{k}={v}")],
                            "-t", plan["tag"], str(plan["context"])],
                           stdout=log.open("w"), stderr=subprocess.STDOUT, timeout=3600)
        took = time.monotonic() - t0
        text = log.read_text()
        assert r.returncode == 0, text[-5000:]
        assert "the wheel in /wheels" in text and f"cosyllama-{version}" in text, text[-3000:]
        size = int(podman("image", "inspect", "--format", "{{.Size}}", plan["tag"]).stdout.strip())
        report(pytestconfig,
               f"add-on image {plan['tag']} from {plan['base']}: built in {took:.0f} s, {size / 1e6:.0f} MB")
        yield plan["tag"]


@pytest.fixture(scope="session")
def hassio(addon_image):
    """A network like the Supervisor's `hassio`, with the stand-in Supervisor on it: (network, its container)."""
    tag = uuid.uuid4().hex[:8]
    network, supervisor = f"cosyllama-test-hassio-{tag}", f"cosyllama-test-supervisor-{tag}"
    podman("network", "create", network)
    podman("run", "--detach", "--name", supervisor, *ULIMITS, "--network", network, "--network-alias", "supervisor",
           "--entrypoint", "python3", addon_image, "-c", FAKE_SUPERVISOR)
    yield network, supervisor
    podman("rm", "--force", "--time", "0", supervisor, check=False)
    podman("network", "rm", "--force", network, check=False)


def share_and_data(tmp_path, *, model: bool = True, voice: bool = True):
    share, data = tmp_path / "share", tmp_path / "data"
    (share / "cosyllama").mkdir(parents=True)
    data.mkdir()
    if model:
        shutil.copytree(MODEL_DIR, share / "cosyllama" / "Fun-CosyVoice3-0.5B")
    if voice:
        anna = share / "cosyllama" / "voices" / "anna"
        anna.mkdir(parents=True)
        shutil.copy(PROMPT_WAV, anna / "ref.wav")
        (anna / "ref.txt").write_text(PROMPT_TEXT)
    return share, data


def addon_argv(store, image, name, share, data, token, *extra, share_mode: str = "rw") -> list[str]:
    """`podman run` as the Supervisor runs the add-on: its hostname, /data, /share read-write (config.yaml's map),
    its environment, no init (config.yaml: init: false) and no restart policy."""
    return ["run", "--name", name, *ULIMITS, "--hostname", sv.hostname(store.slug), "--volume", f"{data}:/data",
            "--volume", f"{share}:/share:{share_mode}", "--env", "TZ=UTC", "--env", f"SUPERVISOR_TOKEN={token}",
            "--env", f"HASSIO_TOKEN={token}", *extra, image]


def test_the_addon_holds_the_bf16_attention_kernel(addon_image):
    """As in the container image: compiled when the Supervisor builds the add-on, loadable without a compiler."""
    built, why = kernel_in_image(addon_image)
    assert built and why == expected_kernel_problem()


def test_addon_converts_on_first_start_is_discovered_speaks_and_stops_in_time(store, addon_image, hassio, tmp_path,
                                                                             pytestconfig):
    from wyoming.tts import Synthesize

    network, supervisor = hassio
    share, data = share_and_data(tmp_path)
    options = sv.write_options(store.config, {"default_voice": "anna", "threads": 1, "precision": "fp32"}, data)
    assert options["gguf"] == "" and options["model_dir"] == "/share/cosyllama/Fun-CosyVoice3-0.5B"
    name, token, wyoming = f"cosyllama-test-addon-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex, free_port()
    t0 = time.monotonic()
    podman(*addon_argv(store, addon_image, name, share, data, token, "--detach", "--network", network,
                       "-p", f"127.0.0.1:{wyoming}:10200"))
    try:
        while podman("healthcheck", "run", name, check=False).returncode != 0:
            state = json.loads(podman("inspect", "--format", "{{json .State}}", name).stdout)
            logs = podman("logs", name, check=False)
            assert state["Running"] and time.monotonic() - t0 < HEALTHY_WITHIN_S + CONVERT_WITHIN_S, \
                (logs.stdout + logs.stderr)[-4000:]
            time.sleep(2)
        healthy = time.monotonic() - t0
        logs = podman("logs", name).stderr
        assert "converting the speech LLM to /share/cosyllama/gguf/Fun-CosyVoice3-0.5B-speech-q8_0-" in logs, logs
        assert "converted in" in logs and "--threads 1" in logs
        (gguf,) = (share / "cosyllama" / "gguf").glob("*.gguf")
        info = describe(wyoming)
        voices = {v["name"]: v["description"] for v in info["tts"][0]["voices"]}
        assert "anna" in voices and "(anna)" in voices.get("default", ""), voices
        events = asyncio.run(wyoming_session(wyoming, Synthesize(text=TEXT)))
        assert events[-1].type == "audio-stop", [e.type for e in events]
        assert sum(len(e.payload or b"") for e in events if e.type == "audio-chunk") > 24_000 // 4 * 2
        assert (share / "cosyllama" / "voices" / "anna" / "voice.pt").is_file() and (data / "cache").is_dir()
        deadline = time.monotonic() + 60
        while not (announced := [ln for ln in podman("logs", supervisor).stdout.splitlines() if ln.startswith("{")]):
            assert time.monotonic() < deadline, podman("logs", name).stderr[-3000:]
            time.sleep(1)
        assert json.loads(announced[-1]) == {
            "path": "/discovery", "auth": f"Bearer {token}",
            "body": {"service": "wyoming", "config": {"uri": f"tcp://{sv.hostname(store.slug)}:10200"}}}
        t1 = time.monotonic()
        podman("stop", "--time", str(STOP_WITHIN_S), name, timeout=STOP_WITHIN_S + 30)
        stopped = time.monotonic() - t1
        state = json.loads(podman("inspect", "--format", "{{json .State}}", name).stdout)
        assert stopped < STOP_WITHIN_S and state["ExitCode"] in (0, 143), (stopped, state)
        report(pytestconfig, f"add-on: healthy {healthy:.0f} s after start (GGUF converted: {gguf.name}), "
                             f"stopped {stopped:.1f} s after SIGTERM (exit {state['ExitCode']})")
    finally:
        podman("rm", "--force", "--time", "0", name, check=False)


@pytest.mark.parametrize(("case", "words"), [
    ("no model folder", "the model folder /share/cosyllama/Fun-CosyVoice3-0.5B does not exist: download "
                        "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"),
    ("read-only share", "cannot write the voices folder /share/cosyllama/voices (Read-only file system): the add-on "
                        "needs /share writable"),
])
def test_addon_stops_with_one_line_and_exit_2_and_is_not_restarted(store, addon_image, tmp_path, case, words):
    share, data = share_and_data(tmp_path, model=case != "no model folder", voice=False)
    sv.write_options(store.config, {}, data)
    name = f"cosyllama-test-addon-bad-{uuid.uuid4().hex[:6]}"
    argv = addon_argv(store, addon_image, name, share, data, "t", share_mode="ro" if "read-only" in case else "rw")
    try:
        r = podman(*argv, check=False, timeout=120)
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("cosyllama")]
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"cosyllama add-on: {words}"), r.stderr
        assert "Traceback" not in r.stderr + r.stdout
        state = json.loads(podman("inspect", "--format", "{{json .State}}", name).stdout)
        assert not state["Running"] and state["ExitCode"] == 2 and not state.get("Restarting"), state
    finally:
        podman("rm", "--force", "--time", "0", name, check=False)
