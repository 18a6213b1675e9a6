"""The deploy files without a container engine (the images themselves: tests/test_container.py, tests/test_addon.py):
the Home Assistant add-on as the Supervisor's store reads it (tests/supervisor_steps.py says what is reproduced),
the add-on's run script (options checked, the model folder checked, the GGUF made on first start, `cosyllama serve`
flags that parse, one line and exit 2 for a user's mistake) and its discovery script."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import supervisor_steps as sv

ROOT = Path(__file__).resolve().parents[1]
ADDON = ROOT / "deploy" / "home-assistant" / "cosyllama"
URL = "https://github.com/cosyllama/cosyllama"  # what a user adds in the store: repository.yaml's url


def load_run():
    spec = importlib.util.spec_from_file_location("addon_run", ADDON / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def run():
    return load_run()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The store's reading of this repository, cloned as the Supervisor clones a URL (its hash names the folder)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a Git work tree: the store reads what a clone holds")
    clone = sv.copy_as_cloned(ROOT, tmp_path_factory.mktemp("addons-git") / sv.repository_hash(URL))
    return clone, *sv.discover(clone)


# -- the Supervisor's store and build ------------------------------------------------------------------------------


def test_the_store_finds_the_repository_at_its_root_and_one_addon(store):
    clone, repository, addons, warnings = store
    assert repository["name"] == "cosyllama" and repository["url"] == URL
    assert list(clone.rglob("repository.yaml")) == [clone / "repository.yaml"]  # nowhere else: it is not read there
    slug = f"{sv.repository_hash(URL)}_cosyllama"
    assert list(addons) == [slug] and addons[slug]["location"] == clone / ADDON.relative_to(ROOT)
    # the store also tries the test model's CosyVoice-BlankEN/config.json, and skips it with a warning, as it must
    assert all("CosyVoice-BlankEN/config.json" in w for w in warnings), warnings


def test_the_addon_config_options_and_translations_agree(store):
    _, _, addons, _ = store
    (config,) = addons.values()
    assert config["discovery"] == ["wyoming"] and "10200/tcp" in config["ports"] and config["init"] is False
    assert config["arch"] == ["amd64"]  # only what is built and run here
    assert {"type": "share", "read_only": False} in config["map"]
    assert set(config["options"]) == set(config["schema"])
    assert sv.validate_options(config["schema"], config["options"])["threads"] == 0
    en = yaml.safe_load((ADDON / "translations" / "en.yaml").read_text())
    assert set(en["configuration"]) == set(config["options"])
    assert set(en["network"]) == set(config["ports"])
    assert (ADDON / "DOCS.md").is_file()


@pytest.mark.parametrize("bad", [{"threads": -1}, {"threads": "many"}, {"threads": 257}, {"precision": "fp16"},
                                 {"model_dir": None}, {"default_voice": 3}])
def test_options_the_supervisor_refuses_before_the_addon_starts(store, bad):
    _, _, addons, _ = store
    (config,) = addons.values()
    with pytest.raises(sv.Invalid):
        sv.validate_options(config["schema"], {**config["options"], **bad})


def test_the_build_is_on_home_assistants_base_and_installs_this_release(store):
    import cosyllama

    _, _, addons, _ = store
    ((slug, config),) = addons.items()
    plan = sv.build_plan(config, slug, "amd64")
    assert plan["base"] == "ghcr.io/home-assistant/amd64-base-debian:bookworm" and plan["pull"]
    assert plan["args"]["BUILD_FROM"] == plan["base"] and plan["args"]["BUILD_ARCH"] == "amd64"
    assert plan["args"]["COSYLLAMA_VERSION"] == cosyllama.__version__
    assert plan["tag"] == f"local/amd64-addon-{slug}:{config['version']}"
    build = yaml.safe_load((ADDON / "build.yaml").read_text())
    assert set(build["build_from"]) == set(config["arch"])  # a base for every declared architecture, no other
    for arch in set(sv.ARCHES) - set(config["arch"]):
        with pytest.raises(sv.Invalid):
            sv.build_plan(config, slug, arch)
    # llama.cpp as the image's: the same version and flags, so one kept wheel serves both builds
    containerfile = (ROOT / "deploy" / "Containerfile").read_text()
    dockerfile = (ADDON / "Dockerfile").read_text()
    assert f"ARG LLAMA_CPP_VERSION={plan['args']['LLAMA_CPP_VERSION']}\n" in containerfile
    flags = re.compile(r'^ARG LLAMA_CMAKE_ARGS="(.*)"$', re.M)
    assert flags.search(dockerfile)[1] == flags.search(containerfile)[1]
    assert "TORCH_SPEC=torch==" + plan["args"]["TORCH_VERSION"] in containerfile
    # nothing the Supervisor's --pull cannot fetch
    for f in ADDON.rglob("*"):
        if f.is_file() and "__pycache__" not in f.parts:
            assert "localhost/" not in f.read_text(), f


# -- run.py: options, model folder, GGUF ---------------------------------------------------------------------------


def options(**kw):
    return {"model_dir": "/share/cosyllama/m", "gguf": "", "voices_dir": "/share/cosyllama/voices",
            "default_voice": "", "language": "en", "threads": 0, "precision": "auto", "api_key": "", **kw}


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_threads_0_leaves_one_core_to_home_assistant(run, cores, threads):
    assert run.check_options(options(), cores)["threads"] == threads
    assert run.check_options(options(threads=cores), cores)["threads"] == cores


@pytest.mark.parametrize(("bad", "words"), [
    ({"threads": 5}, "threads is 5: this host gives the add-on 4 cores; use 1 to 4, or 0 for 3"),
    ({"threads": True}, "threads is True"),
    ({"precision": "fp16"}, "precision is 'fp16'; allowed: auto, fp32, bf16, int8"),
    ({"language": "en, xx"}, "language names xx; CosyVoice3 speaks zh, en"),
    ({"model_dir": "share/m"}, "model_dir is 'share/m': give the model folder's full path"),
    ({"voices_dir": "voices"}, "voices_dir is 'voices'"),
])
def test_options_out_of_range_are_one_line(run, bad, words):
    with pytest.raises(run.AddonError, match=re.escape(words)) as e:
        run.check_options(options(**bad), 4)
    assert "\n" not in str(e.value)


def test_a_missing_or_partial_model_folder_names_the_files_and_where_to_get_them(run, tmp_path):
    with pytest.raises(run.AddonError, match="does not exist: download FunAudioLLM/Fun-CosyVoice3-0.5B-2512") as e:
        run.check_model_dir(tmp_path / "nothing")
    assert "llm.pt 2.0 GB, flow.pt 1.3 GB, hift.pt 83 MB" in str(e.value)
    partial = tmp_path / "m"
    (partial / "CosyVoice-BlankEN").mkdir(parents=True)
    for name in ("cosyvoice3.yaml", "llm.pt", "CosyVoice-BlankEN/config.json"):
        (partial / name).write_text("x")
    with pytest.raises(run.AddonError) as e:
        run.check_model_dir(partial)
    assert ("lacks CosyVoice-BlankEN/vocab.json, CosyVoice-BlankEN/merges.txt, flow.pt, hift.pt, campplus.onnx, "
            "speech_tokenizer_v3.onnx: download FunAudioLLM/Fun-CosyVoice3-0.5B-2512") in str(e.value)
    from helpers import MODEL_DIR

    run.check_model_dir(MODEL_DIR)  # a whole one passes


def test_an_unwritable_share_is_one_line(run, tmp_path):
    blocker = tmp_path / "share"
    blocker.write_text("a file where the folder should be")
    with pytest.raises(run.AddonError, match=r"cannot write the voices folder .*share/cosyllama/voices \(.*\): "
                                             "the add-on needs /share writable"):
        run.writable_dir(blocker / "cosyllama" / "voices", "the voices folder")
    assert run.writable_dir(tmp_path / "ok" / "voices", "x").is_dir() and not list((tmp_path / "ok").rglob(".*"))


def fake_convert(calls):
    def convert(argv):
        calls.append(argv)
        Path(argv[argv.index("--out") + 1]).write_bytes(b"GGUF")
        return SimpleNamespace(returncode=0)

    return convert


def test_no_gguf_named_converts_once_and_keeps_it_under_share(run, tmp_path):
    model = tmp_path / "Fun-CosyVoice3-0.5B"
    model.mkdir()
    (model / "llm.pt").write_bytes(b"w" * 1000)
    gguf_dir = tmp_path / "share" / "cosyllama" / "gguf"
    calls = []
    first = run.resolve_gguf(run.check_options(options(model_dir=str(model)), 2), gguf_dir, run=fake_convert(calls))
    assert first.parent == gguf_dir and first.name.startswith("Fun-CosyVoice3-0.5B-speech-q8_0-")
    assert calls == [["cosyllama", "convert", "--model-dir", str(model), "--out", str(first)]]
    again = run.resolve_gguf(run.check_options(options(model_dir=str(model)), 2), gguf_dir, run=fake_convert(calls))
    assert again == first and len(calls) == 1  # kept: the next start converts nothing
    # new weights in the same folder: converted again, the old file and a stopped conversion's pieces removed
    (gguf_dir / f".{first.stem}x.gguf.partial").write_bytes(b"half")
    (model / "llm.pt").write_bytes(b"v" * 1001)
    new = run.resolve_gguf(run.check_options(options(model_dir=str(model)), 2), gguf_dir, run=fake_convert(calls))
    assert new != first and len(calls) == 2 and sorted(p.name for p in gguf_dir.iterdir()) == [new.name]


def test_a_failed_conversion_or_a_full_disk_stops_with_one_line(run, tmp_path, monkeypatch):
    model = tmp_path / "m"
    model.mkdir()
    (model / "llm.pt").write_bytes(b"w" * 1000)
    out = tmp_path / "m-speech-q8_0-abc.gguf"
    with pytest.raises(run.AddonError, match=r"converting the speech LLM stopped \(exit 2\); the line above says why"):
        run.make_gguf(model, out, run=lambda argv: SimpleNamespace(returncode=2))
    monkeypatch.setattr(run.shutil, "disk_usage", lambda p: SimpleNamespace(free=500))
    with pytest.raises(run.AddonError, match=r"has 0.0 GB free; converting the speech LLM needs about 0.0 GB"):
        run.make_gguf(model, out, run=lambda argv: pytest.fail("converted on a full disk"))


def test_a_named_gguf_that_is_not_there_is_one_line(run, tmp_path):
    with pytest.raises(run.AddonError, match=r"option gguf names .*/m/cv3.gguf, which does not exist: correct it, "
                                             "or empty it"):
        run.resolve_gguf(run.check_options(options(model_dir=str(tmp_path / "m"), gguf="cv3.gguf"), 2), tmp_path)


def test_options_become_serve_flags_that_parse(run):
    from cosyllama.cli import build_parser

    checked = run.check_options(options(gguf="cv3.gguf", default_voice="anna", threads=3, precision="int8",
                                        api_key="k", language="de, EN"), 4)
    argv = run.serve_argv(checked, Path("/share/cosyllama/m/cv3.gguf"))
    assert argv[:2] == ["cosyllama", "serve"] and "k" not in argv  # the key goes by the environment
    args = build_parser().parse_args(argv[1:])
    assert (args.model_dir, args.gguf, args.voices) == ("/share/cosyllama/m", "/share/cosyllama/m/cv3.gguf",
                                                        "/share/cosyllama/voices")
    assert (args.threads, args.precision, args.default_voice, args.language) == (3, "int8", "anna", ["de", "en"])
    assert (args.host, args.port, args.wyoming) == ("0.0.0.0", 8000, "tcp://0.0.0.0:10200")
    bare = build_parser().parse_args(run.serve_argv(run.check_options(options(language=""), 2), Path("g"))[1:])
    assert bare.threads == 1 and bare.default_voice is None and bare.language is None


def test_host_warnings_for_little_memory_and_a_cpu_without_avx2(run):
    assert run.host_warnings("MemAvailable:   16000000 kB\n", "flags\t: fpu sse avx avx2 fma\n") == []
    low, no_avx2 = run.host_warnings("MemAvailable:    2500000 kB\n", "flags\t: fpu sse sse2 ssse3\n")
    assert low.startswith("2.5 GB of memory available; the official model peaks at 3.2-4.6 GB")
    assert "set the VM's CPU type to host" in no_avx2
    assert run.host_warnings("", "processor: 0\n") == []  # nothing read, nothing claimed


def test_a_server_refusing_its_input_stops_the_addon_with_a_pointer(run, capfd):
    code = run.run_server([sys.executable, "-c",
                           "import sys; print('cosyllama serve: error: x.gguf was converted from a different llm.pt',"
                           " file=sys.stderr); sys.exit(2)"])
    err = capfd.readouterr().err.splitlines()
    assert code == 2 and err[-2].startswith("cosyllama serve: error:")
    assert err[-1].startswith("cosyllama add-on: stopped: the line above names what to correct")


def test_a_server_ended_by_sigterm_gives_the_shells_status(run):
    assert run.run_server([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]) == 143


def test_main_stops_with_exit_2_and_one_line_before_any_model_loads(run, tmp_path, monkeypatch, capfd):
    (tmp_path / "options.json").write_text(json.dumps(options(model_dir=str(tmp_path / "absent"))))
    monkeypatch.setattr(run, "OPTIONS", tmp_path / "options.json")
    assert run.main() == 2
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith(f"cosyllama add-on: the model folder {tmp_path / 'absent'} does not exist: download ")
    (tmp_path / "options.json").write_text("{not json")
    assert run.main() == 2 and "cannot read its options" in capfd.readouterr().err


# -- discovery -----------------------------------------------------------------------------------------------------


def test_discovery_announces_the_wyoming_port_to_the_supervisor(monkeypatch):
    spec = importlib.util.spec_from_file_location("addon_discovery", ADDON / "discovery.py")
    discovery = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(discovery)
    sent = []

    class Answer:
        status = 200

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def urlopen(request, timeout):
        sent.append(request)
        return Answer()

    monkeypatch.setenv("SUPERVISOR_TOKEN", "tok")
    monkeypatch.setattr(discovery.urllib.request, "urlopen", urlopen)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert discovery.main(port) == 0
    (req,) = sent
    assert req.full_url == "http://supervisor/discovery" and req.get_method() == "POST"
    assert req.get_header("Authorization") == "Bearer tok"
    body = json.loads(req.data)
    assert body == {"service": "wyoming", "config": {"uri": f"tcp://{socket.gethostname()}:{port}"}}


# -- the image's entry point ---------------------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="runs the entry point as uid 1000")
def test_an_api_key_file_uid_1000_cannot_read_is_one_line_and_exit_2():
    """A secret file mode 0600 owned by root on the host: the image's uid 1000 cannot read it. The entry point
    says so in one line and exits 2 (compose's `restart: unless-stopped` then restarts it, each time with the
    line, docs/deploy.md's traps) before any server starts."""
    folder = Path(tempfile.mkdtemp(prefix="cosyllama-secret-"))  # pytest's own are closed to other users
    try:
        folder.chmod(0o755)
        key = folder / "api_key"
        key.write_text("secret\n")
        key.chmod(0o600)
        r = subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "sh",
                            str(ROOT / "deploy" / "entrypoint.sh"), "serve"], capture_output=True, text=True,
                           timeout=30, env={"PATH": os.environ["PATH"], "COSYLLAMA_API_KEY_FILE": str(key)})
    finally:
        shutil.rmtree(folder)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr == (f"cosyllama: the API key file {key} cannot be read by uid 1000: make it readable "
                        "(chmod 0444, or chown 1000 on the host)\n")
