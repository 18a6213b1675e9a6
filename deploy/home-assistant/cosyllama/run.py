"""The add-on's start: /data/options.json (as the Supervisor writes it) checked, the model folder checked, the
speech LLM converted to a GGUF on first start when none is named (kept under /share), then `cosyllama serve`
with Wyoming on 10200 and the HTTP API on 8000, announced to Home Assistant once it listens (discovery.py).

Plain Python in the image's venv, no bashio. A user's mistake (a missing or incomplete model folder, an
unwritable /share, an option out of range, a GGUF of another model) is one line in the add-on's log and exit
status 2: the add-on stops and stays stopped. The Supervisor starts a stopped add-on again only when the user
turned its watchdog on (docs/deploy.md, "Home Assistant add-on")."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from cosyllama.config import REQUIRED_FILES
from cosyllama.defaults import LANGUAGES

OPTIONS = Path(os.environ.get("COSYLLAMA_ADDON_OPTIONS", "/data/options.json"))
GGUF_DIR = Path("/share/cosyllama/gguf")  # where the GGUF made on first start is kept
CACHE = Path(os.environ.get("COSYLLAMA_CACHE", "/data/cache"))
HERE = Path(__file__).resolve().parent
WYOMING_PORT = 10200
HTTP_PORT = 8000
PRECISIONS = ("auto", "fp32", "bf16", "int8")
MODEL_REPO = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
# the big files at the official shapes (what `cosyllama make-model --size full` writes, byte for byte in size)
WEIGHT_SIZES = "llm.pt 2.0 GB, flow.pt 1.3 GB, hift.pt 83 MB"
PEAK_MEMORY_GB = (3.2, 4.6)  # fp32 flow ... bf16 flow (docs/benchmarks.md, docs/amx.md)
EXIT_USER = 2  # what `cosyllama` exits with for a user's mistake


class AddonError(Exception):
    """A user's mistake: its one line goes to the add-on's log, then the add-on stops (exit 2)."""


def log(line: str) -> None:
    print(f"cosyllama add-on: {line}", file=sys.stderr, flush=True)


def cores() -> int:
    """The cores this container may run on."""
    return len(os.sched_getaffinity(0))


def default_threads(n_cores: int) -> int:
    """``threads: 0``: every core but one, which is left to Home Assistant; at least one."""
    return max(1, n_cores - 1)


def read_options(path: Path) -> dict:
    try:
        options = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise AddonError(f"cannot read its options {path}: {e}") from None
    if not isinstance(options, dict):
        raise AddonError(f"{path} holds {type(options).__name__}, not the options' mapping")
    return options


def check_options(options: dict, n_cores: int) -> dict:
    """The options with their defaults filled in and ``threads`` resolved, or :class:`AddonError` naming the
    first one out of range. The Supervisor checks types against config.yaml's schema; this checks what the
    schema cannot know (this host's cores, absolute paths, the language codes)."""
    o = dict(options)
    model_dir = str(o.get("model_dir") or "")
    if not model_dir.startswith("/"):
        raise AddonError(f"option model_dir is {model_dir!r}: give the model folder's full path, "
                         "e.g. /share/cosyllama/Fun-CosyVoice3-0.5B")
    voices = str(o.get("voices_dir") or "/share/cosyllama/voices")
    if not voices.startswith("/"):
        raise AddonError(f"option voices_dir is {voices!r}: give a full path, e.g. /share/cosyllama/voices")
    threads = o.get("threads") or 0
    if not isinstance(threads, int) or isinstance(threads, bool) or not 0 <= threads <= n_cores:
        raise AddonError(f"option threads is {threads!r}: this host gives the add-on {n_cores} cores; use 1 to "
                         f"{n_cores}, or 0 for {default_threads(n_cores)} (all but one, left to Home Assistant)")
    precision = o.get("precision") or "auto"
    if precision not in PRECISIONS:
        raise AddonError(f"option precision is {precision!r}; allowed: {', '.join(PRECISIONS)}")
    codes = [c.strip().lower() for c in str(o.get("language") or "").replace(",", " ").split()]
    bad = [c for c in codes if c not in LANGUAGES]
    if bad:
        raise AddonError(f"option language names {', '.join(bad)}; CosyVoice3 speaks {', '.join(LANGUAGES)} "
                         "(comma-separated; empty: all of them)")
    return {**o, "model_dir": model_dir.rstrip("/") or "/", "voices_dir": voices, "precision": precision,
            "language": codes, "threads": threads or default_threads(n_cores), "gguf": str(o.get("gguf") or ""),
            "default_voice": str(o.get("default_voice") or ""), "api_key": str(o.get("api_key") or "")}


def check_model_dir(model_dir: Path) -> None:
    """:class:`AddonError` naming what is missing and where to get it, when the folder is not a whole model."""
    where = (f"download {MODEL_REPO} (Hugging Face or ModelScope; {WEIGHT_SIZES}, plus the small files) and copy "
             f"it to {model_dir} (the Samba or SSH add-on reaches /share)")
    if not model_dir.is_dir():
        raise AddonError(f"the model folder {model_dir} does not exist: {where}")
    missing = [name for name in REQUIRED_FILES if not (model_dir / name).is_file()]
    if missing:
        raise AddonError(f"the model folder {model_dir} lacks {', '.join(missing)}: {where}")


def writable_dir(path: Path, what: str) -> Path:
    """``path`` made if missing and shown writable (a file created and removed), else :class:`AddonError`."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".cosyllama-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise AddonError(f"cannot write {what} {path} ({e.strerror or e}): the add-on needs /share writable "
                         "(config.yaml maps it read-write; a full disk or a read-only mount stops it)") from None
    return path


def auto_gguf_path(model_dir: Path, gguf_dir: Path) -> Path:
    """Where the GGUF made from ``model_dir``'s llm.pt is kept: its name changes when llm.pt does (its path,
    size or time), so new weights in the same folder are converted again instead of refused."""
    llm = (model_dir / "llm.pt").resolve()
    st = llm.stat()
    stamp = hashlib.sha1(f"{llm}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    return gguf_dir / f"{model_dir.name}-speech-q8_0-{stamp}.gguf"


def make_gguf(model_dir: Path, out: Path, run=subprocess.run) -> Path:
    """Convert ``model_dir``'s speech LLM to ``out`` (Q8_0) with `cosyllama convert`, whose progress lines go to
    the log; earlier files made for this folder (and pieces left by a stopped conversion) are removed after."""
    prefix = out.name.rsplit("-", 1)[0]  # NAME-speech-q8_0
    for piece in out.parent.glob(f".{prefix}-*"):  # .NAME.partial, .NAME.f32.tmp of a conversion stopped midway
        piece.unlink(missing_ok=True)
    need = int((model_dir / "llm.pt").stat().st_size * 1.2)  # the F32 file while converting, then Q8_0
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise AddonError(f"{out.parent} has {free / 1e9:.1f} GB free; converting the speech LLM needs about "
                         f"{need / 1e9:.1f} GB while it runs (0.4 GB after): free space on /share, or name a GGUF "
                         "file in the options")
    log(f"no GGUF file named: converting the speech LLM to {out} (Q8_0, once; minutes on a small CPU)")
    t0 = time.monotonic()
    r = run(["cosyllama", "convert", "--model-dir", str(model_dir), "--out", str(out)])
    if r.returncode != 0:
        raise AddonError(f"converting the speech LLM stopped (exit {r.returncode}); the line above says why")
    for old in out.parent.glob(f"{prefix}-*.gguf"):
        if old != out:
            old.unlink(missing_ok=True)
    log(f"converted in {time.monotonic() - t0:.0f} s; kept for the next starts")
    return out


def resolve_gguf(options: dict, gguf_dir: Path, run=subprocess.run) -> Path:
    """The GGUF to serve: the one the options name, else the one made (on first start) from the model folder."""
    model_dir = Path(options["model_dir"])
    if options["gguf"]:
        named = Path(options["gguf"]) if options["gguf"].startswith("/") else model_dir / options["gguf"]
        if not named.is_file():
            raise AddonError(f"option gguf names {named}, which does not exist: correct it, or empty it to have "
                             f"the add-on convert one into {gguf_dir}")
        return named
    out = auto_gguf_path(model_dir, writable_dir(gguf_dir, "the GGUF folder"))
    return out if out.is_file() else make_gguf(model_dir, out, run=run)


def serve_argv(options: dict, gguf: Path) -> list[str]:
    """`cosyllama serve`'s command line for the checked options (:func:`check_options`) and the GGUF."""
    argv = ["cosyllama", "serve", "--model-dir", options["model_dir"], "--host", "0.0.0.0",
            "--port", str(HTTP_PORT), "--wyoming", f"tcp://0.0.0.0:{WYOMING_PORT}",
            "--voices", options["voices_dir"], "--precision", options["precision"],
            "--threads", str(options["threads"]), "--gguf", str(gguf)]
    if options["default_voice"]:
        argv += ["--default-voice", options["default_voice"]]
    for code in options["language"]:  # none: every language
        argv += ["--language", code]
    return argv


def host_warnings(meminfo: str, cpuinfo: str) -> list[str]:
    """What this host lacks for the official model, as warnings (it may still run, slowly or not at all)."""
    out = []
    fields = dict(line.split(":", 1) for line in meminfo.splitlines() if ":" in line)
    avail_kb = int((fields.get("MemAvailable") or "0 kB").split()[0])
    if avail_kb and avail_kb < PEAK_MEMORY_GB[0] * 1e6:
        out.append(f"{avail_kb / 1e6:.1f} GB of memory available; the official model peaks at "
                   f"{PEAK_MEMORY_GB[0]}-{PEAK_MEMORY_GB[1]} GB: it may be killed while loading (give the machine "
                   "or VM more memory)")
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    if flags is not None and "avx2" not in flags:
        out.append("the CPU shows no AVX2 (a VM's generic CPU model hides it: set the VM's CPU type to host); "
                   "speech will be several times slower than real time")
    return out


def run_server(argv: list[str]) -> int:
    """Run the server as a child, SIGTERM forwarded to it (tini gives it to this process), and return its exit
    status; a user's mistake it refused (exit 2) gets the add-on's line after its own."""
    child = subprocess.Popen(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    code = child.wait()
    if code < 0:  # ended by a signal: the status a shell gives it (143 for SIGTERM)
        code = 128 - code
    if code == EXIT_USER:
        log("stopped: the line above names what to correct (the add-on's options, or the files under /share)")
    return code


def main() -> int:
    try:
        options = check_options(read_options(OPTIONS), cores())
        check_model_dir(Path(options["model_dir"]))
        writable_dir(Path(options["voices_dir"]), "the voices folder")
        writable_dir(CACHE, "the cache")
        gguf = resolve_gguf(options, GGUF_DIR)
    except AddonError as e:
        log(str(e))
        return EXIT_USER
    for warning in host_warnings(_read("/proc/meminfo"), _read("/proc/cpuinfo")):
        log(f"warning: {warning}")
    argv = serve_argv(options, gguf)
    if options["api_key"]:
        os.environ["COSYLLAMA_API_KEY"] = options["api_key"]  # not on the command line, where ps shows it
    if os.environ.get("SUPERVISOR_TOKEN"):  # under Home Assistant: announce the Wyoming server once it listens
        subprocess.Popen([sys.executable, str(HERE / "discovery.py"), str(WYOMING_PORT)])
    log(" ".join(argv))
    return run_server(argv)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
