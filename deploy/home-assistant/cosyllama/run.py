"""The add-on's run script: /data/options.json (as Home Assistant writes it) to `cosyllama serve` flags, with
Wyoming on 10200 and the HTTP API on 8000. Plain Python (the image's), no bashio: it runs on any base.
Announces the Wyoming server to Home Assistant (discovery.py) once it listens, where the Supervisor is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

OPTIONS = Path(os.environ.get("COSYLLAMA_ADDON_OPTIONS", "/data/options.json"))
HERE = Path(__file__).resolve().parent
WYOMING_PORT = 10200
HTTP_PORT = 8000


def serve_argv(options: dict) -> list[str]:
    """`cosyllama serve`'s command line for the add-on's options."""
    argv = ["cosyllama", "serve", "--model-dir", options["model_dir"], "--host", "0.0.0.0",
            "--port", str(HTTP_PORT), "--wyoming", f"tcp://0.0.0.0:{WYOMING_PORT}",
            "--voices", options.get("voices_dir") or "/share/cosyllama/voices",
            "--precision", options.get("precision") or "auto"]
    if options.get("gguf"):
        gguf = options["gguf"]
        argv += ["--gguf", gguf if os.path.isabs(gguf) else os.path.join(options["model_dir"], gguf)]
    if int(options.get("threads") or 0) > 0:
        argv += ["--threads", str(int(options["threads"]))]
    if options.get("default_voice"):
        argv += ["--default-voice", options["default_voice"]]
    for code in (options.get("language") or "").replace(",", " ").split():  # empty: every language
        argv += ["--language", code.strip().lower()]
    return argv


def main() -> int:
    try:
        options = json.loads(OPTIONS.read_text())
    except (OSError, ValueError) as e:
        print(f"cosyllama add-on: cannot read its options {OPTIONS}: {e}", file=sys.stderr)
        return 2
    argv = serve_argv(options)
    if options.get("api_key"):
        os.environ["COSYLLAMA_API_KEY"] = options["api_key"]  # not on the command line, where ps shows it
    Path(os.environ.get("COSYLLAMA_CACHE", "/data/cache")).mkdir(parents=True, exist_ok=True)
    Path(argv[argv.index("--voices") + 1]).mkdir(parents=True, exist_ok=True)
    if os.environ.get("SUPERVISOR_TOKEN"):  # under Home Assistant: announce the Wyoming server once it listens
        subprocess.Popen([sys.executable, str(HERE / "discovery.py"), str(WYOMING_PORT)])
    print("cosyllama add-on: " + " ".join(argv), file=sys.stderr, flush=True)
    os.execvp(argv[0], argv)
    return 1


if __name__ == "__main__":
    sys.exit(main())
