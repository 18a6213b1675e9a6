"""The deploy scripts that run without a container engine (the images themselves: tests/test_container.py):
the add-on's run script turns Home Assistant's options.json into `cosyllama serve` flags that parse, and its
discovery script announces the Wyoming port to the Supervisor as the Wyoming integration expects."""

from __future__ import annotations

import json
import runpy
import socket
from pathlib import Path

ADDON = Path(__file__).resolve().parents[1] / "deploy" / "home-assistant" / "cosyllama"


def test_addon_options_become_serve_flags_that_parse():
    from cosyllama.cli import build_parser

    serve_argv = runpy.run_path(str(ADDON / "run.py"))["serve_argv"]
    options = {"model_dir": "/share/cosyllama/m", "gguf": "cv3.gguf", "voices_dir": "/share/cosyllama/voices",
               "default_voice": "anna", "threads": 3, "precision": "int8", "api_key": "k", "language": "de, en"}
    argv = serve_argv(options)
    assert argv[:2] == ["cosyllama", "serve"] and "k" not in argv  # the key goes by the environment
    args = build_parser().parse_args(argv[1:])
    assert (args.model_dir, args.gguf, args.voices) == ("/share/cosyllama/m", "/share/cosyllama/m/cv3.gguf",
                                                        "/share/cosyllama/voices")
    assert (args.threads, args.precision, args.default_voice, args.language) == (3, "int8", "anna", ["de", "en"])
    assert (args.host, args.port, args.wyoming) == ("0.0.0.0", 8000, "tcp://0.0.0.0:10200")
    bare = build_parser().parse_args(serve_argv({**options, "gguf": "", "threads": 0, "default_voice": "",
                                                 "language": ""})[1:])
    assert bare.gguf is None and bare.threads is None and bare.default_voice is None and bare.language is None


def test_discovery_announces_the_wyoming_port_to_the_supervisor(monkeypatch):
    script = runpy.run_path(str(ADDON / "discovery.py"))
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
    main = script["main"]
    monkeypatch.setattr(main.__globals__["urllib"].request, "urlopen", urlopen)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert main(port) == 0
    (req,) = sent
    assert req.full_url == "http://supervisor/discovery" and req.get_method() == "POST"
    assert req.get_header("Authorization") == "Bearer tok"
    body = json.loads(req.data)
    assert body == {"service": "wyoming",
                    "config": {"uri": f"tcp://{socket.gethostname()}:{port}"}}
