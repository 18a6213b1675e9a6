"""The benchmark scripts that scripts/gpu_check.sh runs, end to end on the tiny fixture model: each
runs and writes JSON that loads. A GPU window is short; a script that fails there (a value JSON
cannot hold once cost bench_first_audio.py its rows) loses its measurement."""

import json
import runpy
from pathlib import Path

import pytest

from helpers import MODEL_DIR

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_first_audio(tmp_path, capsys):
    out = tmp_path / "first-audio.jsonl"
    main = runpy.run_path(str(SCRIPTS / "bench_first_audio.py"))["main"]
    assert main(["--model-dir", str(MODEL_DIR), "--llm", "torch", "--threads", "1", "--prompt-cache-mb", "0,512",
                 "--warm", "--requests", "1", "--prompt-seconds", "1", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_cache_mb"] for r in rows] == [0, 512]
    for r in rows:
        assert r["llm"] == "torch" and r["warm"] is True and r["flow"] in ("fp32", "bf16", "int8")
        assert len(r["first_audio_s"]) == 1 and r["first_audio_s"][0] > 0
    assert "first audio" in capsys.readouterr().out
    # the low-latency first chunk, split into its parts
    assert main(["--model-dir", str(MODEL_DIR), "--llm", "torch", "--threads", "1", "--prompt-cache-mb", "512",
                 "--warm", "--requests", "1", "--prompt-seconds", "1", "--first-chunk-tokens", "5", "--breakdown",
                 "--json", str(out)]) == 0
    row = json.loads(out.read_text().splitlines()[-1])
    assert row["first_chunk_tokens"] == 5 and row["breakdown"][0]["flow_s"] > 0


def test_first_audio_paths_in_turns(tmp_path, capsys):
    out = tmp_path / "first-audio.jsonl"
    main = runpy.run_path(str(SCRIPTS / "bench_first_audio.py"))["main"]
    assert main(["--model-dir", str(MODEL_DIR), "--llm", "torch", "--threads", "1", "--prompt-cache-mb", "512",
                 "--warm", "--requests", "2", "--prompt-seconds", "1", "--breakdown",
                 "--paths", "direct/main,scheduler/thread", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["path"] for r in rows] == ["direct/main", "scheduler/thread"]
    for r in rows:
        assert len(r["first_audio_s"]) == 2 and all(t > 0 for t in r["first_audio_s"])
        assert len(r["breakdown"]) == 2 and all(b["flow_s"] > 0 for b in r["breakdown"])
    assert "[scheduler/thread]: first audio" in capsys.readouterr().out


def test_first_audio_refuses_an_unknown_path(capsys):
    main = runpy.run_path(str(SCRIPTS / "bench_first_audio.py"))["main"]
    with pytest.raises(SystemExit) as e:
        main(["--paths", "direct/main,server"])
    assert e.value.code == 2 and "--paths" in capsys.readouterr().err


def test_concurrency(tmp_path, capsys):
    out = tmp_path / "concurrency.json"
    main = runpy.run_path(str(SCRIPTS / "bench_concurrency.py"))["main"]
    assert main(["--model-dir", str(MODEL_DIR), "--streams", "1,2", "--tokens", "4", "--repeat", "1", "--threads", "1",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["backend"].startswith("TorchLLM(") and res["backend"] in capsys.readouterr().out
    assert [lv["streams"] for lv in res["levels"]] == [1, 2]
    assert all(lv["tokens"] == 4 * lv["streams"] and lv["tokens_per_s"] > 0 for lv in res["levels"])


def test_load_test_against_a_server_it_starts(tmp_path):
    out = tmp_path / "load.json"
    main = runpy.run_path(str(SCRIPTS / "load_test.py"))["main"]
    assert main(["--model-dir", str(MODEL_DIR), "--threads", "1", "--parallel", "2", "--concurrency", "1,2",
                 "--requests", "2", "--time-limit", "30", "--beside-chars", "400", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 2]
    assert all(lv["beside_chars"] == 400 for lv in res["levels"])
    for lv in res["levels"]:
        assert lv["ok"] == lv["requests"] >= 1 and not lv["errors"] and lv["first_chunk_p50"] > 0
    assert res["health"]["status"] == "ok"


def test_speech_stream_against_the_http_endpoint(tmp_path, capsys):
    out = tmp_path / "speech-stream.jsonl"
    main = runpy.run_path(str(SCRIPTS / "bench_speech_stream.py"))["main"]
    assert main(["--model-dir", str(MODEL_DIR), "--llm", "torch", "--threads", "1", "--requests", "1",
                 "--prompt-seconds", "1", "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert set(row["first_audio_s"]) == {"websocket", "http"}
    assert all(len(t) == 1 and t[0] > 0 for t in row["first_audio_s"].values())
    assert row["machine"]["cpu_class"] and row["threads"] == 1
    printed = capsys.readouterr().out
    assert "/v1/audio/speech/stream (pieces)" in printed and row["machine"]["cpu_class"] in printed


def test_llm_fidelity_on_the_tiny_model(tmp_path, monkeypatch, capsys):
    """The quantization fidelity script: the float32 GGUF against the torch LLM is the same model (top-1
    everywhere, KL at rounding level), Q4_0 is measurably not (its KL is past F32's by orders)."""
    monkeypatch.setenv("COSYLLAMA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "fidelity.json"
    main = runpy.run_path(str(SCRIPTS / "llm_fidelity.py"))["main"]
    assert main(["--tiny", "--types", "F32,Q4_0", "--prompts", "2", "--steps", "12", "--threads", "1",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())["types"]
    assert res["F32"]["top1"] == 1.0 and res["F32"]["free_equal"] == 1.0 and res["F32"]["kl_max"] < 1e-6
    assert res["Q4_0"]["kl_mean"] > 100 * max(res["F32"]["kl_mean"], 1e-9)
    assert "Q4_0" in capsys.readouterr().out


def test_flow_ceiling(tmp_path, capsys):
    out = tmp_path / "ceiling.json"
    from cosyllama.cpu import onednn_bf16_reorder_ok

    flow_ceiling = runpy.run_path(str(SCRIPTS / "flow_ceiling.py"))
    main = flow_ceiling["main"]
    assert main(["--model-dir", str(MODEL_DIR), "--threads", "1", "--calls", "1", "--prompt-seconds", "0.4",
                 "--output-seconds", "0.4", "--no-compile", "--variants", "fp32,bf16", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert [r["product"] for r in res["products"]] == ["qkv", "attention out", "ff in + GELU", "ff out", "ff chain"]
    assert all(r["static_products_only_ms"] > 0 for r in res["products"][:4])
    chain = res["products"][4]
    assert chain["static_int8_epilogue_ms"] > 0 and chain["dynamic_onednn_ms"] > 0
    assert chain["static_int8_epilogue_max_error"] < 1.0  # not garbage: the chain's outputs are O(1)
    if onednn_bf16_reorder_ok():  # oneDNN's bf16 kernels: AVX-NE-CONVERT or AVX-512 BW + VL + DQ
        assert all(r["bf16_ms"] > 0 for r in res["products"][:4]) and res["left_out"] == []
        assert chain["bf16_max_error"] < chain["static_int8_epilogue_max_error"]  # int8 errs more than bf16
    else:  # the bf16 rows are left out, and the script says why; the rest ran
        assert not any("bf16_ms" in r for r in res["products"])
        assert res["left_out"] == [flow_ceiling["BF16_LEFT_OUT"]] and flow_ceiling["BF16_LEFT_OUT"] in printed
    assert [r["dtype"] for r in res["attention"]] == ["float32", "bfloat16"]
    assert [r["variant"] for r in res["profile"]] == ["fp32", "bf16"]
    assert all(r["self_cpu_seconds_per_audio_second"] for r in res["profile"])
    assert "attention bfloat16" in printed


def test_flow_pt2e_without_torchao_says_how_to_install(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "torchao", None)  # an import of it now raises ImportError
    main = runpy.run_path(str(SCRIPTS / "flow_pt2e.py"))["main"]
    with pytest.raises(SystemExit) as e:
        main(["--model-dir", str(MODEL_DIR)])
    assert e.value.code == 2 and "pip install torchao" in capsys.readouterr().err


def test_flow_pt2e_refuses_an_unknown_scheme(capsys):
    main = runpy.run_path(str(SCRIPTS / "flow_pt2e.py"))["main"]
    with pytest.raises(SystemExit) as e:
        main(["--quantization", "static,fp4"])
    assert e.value.code == 2 and "static, dynamic" in capsys.readouterr().err


@pytest.mark.slow
def test_flow_pt2e_on_the_tiny_model(tmp_path, capsys):
    """The whole measurement where torchao is installed (it is no dependency: skipped otherwise)."""
    pytest.importorskip("torchao")
    out = tmp_path / "pt2e.json"
    main = runpy.run_path(str(SCRIPTS / "flow_pt2e.py"))["main"]
    assert main(["--model-dir", str(MODEL_DIR), "--threads", "1", "--quantization", "dynamic", "--rounds", "1",
                 "--prompt-seconds", "0.4", "--output-seconds", "0.4", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["rows"]) == {"bf16", "int8-onednn+bf16", "inductor-bf16", "pt2e-dynamic", "pt2e-dynamic+2bf16"}
    for row in res["rows"].values():
        assert row["seconds_per_audio_second"][0] > 0 and 0 <= row["mel_error_mean"] <= row["mel_error_max"]
    assert "x bf16" in capsys.readouterr().out


def test_first_chunk_ab(tmp_path, capsys):
    from cosyllama.flow.fast_dit import FastDiT

    out = tmp_path / "ab.json"
    main = runpy.run_path(str(SCRIPTS / "ab_first_chunk.py"))["main"]
    assert main(["--model-dir", str(MODEL_DIR), "--llm", "torch", "--precision", "bf16", "--threads", "1",
                 "--rounds", "2", "--prompt-seconds", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["flow"] == "bf16" and set(data["flow_s"]) == {"before", "now"}
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in data["first_audio_s"].values())
    assert data["switched"] == ["lowp_conv_pos", "keep_modulations", "pad_keys", "attention_kernel_on",
                                "kv_in_place"]  # all
    assert FastDiT.lowp_conv_pos and FastDiT.keep_modulations and FastDiT.pad_keys  # the defaults are back
    assert FastDiT.attention_kernel_on and FastDiT.kv_in_place
    assert "now: first chunk's flow call" in capsys.readouterr().out
    # one switch, with the low-latency first chunk
    assert main(["--model-dir", str(MODEL_DIR), "--llm", "torch", "--precision", "bf16", "--threads", "1",
                 "--rounds", "2", "--prompt-seconds", "1", "--switch", "kv_in_place", "--first-chunk-tokens", "5",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["switched"] == ["kv_in_place"] and data["first_chunk_tokens"] == 5 and FastDiT.kv_in_place


def test_first_chunk_ab_between_engines(tmp_path, capsys):
    from cosyllama.flow.fast_dit import int8_engine_problem

    engines = ("onednn+bf16", "onednn+bf16+static")
    if any(int8_engine_problem(e) for e in engines):
        pytest.skip(int8_engine_problem(engines[1]) or int8_engine_problem(engines[0]))
    out = tmp_path / "ab.json"
    main = runpy.run_path(str(SCRIPTS / "ab_first_chunk.py"))["main"]
    assert main(["--model-dir", str(MODEL_DIR), "--llm", "torch", "--precision", "int8", "--threads", "1",
                 "--rounds", "2", "--prompt-seconds", "1", "--engines", ",".join(engines), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["flow_s"]) == set(engines) and data["switched"] == [] and data["engine"] == ",".join(engines)
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in data["first_audio_s"].values())
    assert "onednn+bf16+static: first chunk's flow call" in capsys.readouterr().out


def test_key_padding_bench(tmp_path, capsys):
    out = tmp_path / "keys.json"
    main = runpy.run_path(str(SCRIPTS / "bench_key_padding.py"))["main"]
    assert main(["--threads", "1", "--queries", "20", "--keys", "40", "--reps", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert list(data["rows"]) == [str(n) for n in range(40, 56)]
    assert all(r["plain_ms"] > 0 and r["padded_ms"] > 0 for r in data["rows"].values())
    assert "padded to 48" in capsys.readouterr().out
    assert main(["--threads", "1", "--whole", "--keys", "33", "--step", "8", "--reps", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["queries"] == "keys" and list(data["rows"]) == ["33", "41"]
    assert "a whole call" in capsys.readouterr().out


def test_attention_bench(tmp_path, capsys):
    from cosyllama.flow import native_attention

    main = runpy.run_path(str(SCRIPTS / "bench_attention.py"))["main"]
    out = tmp_path / "attention.json"
    args = ["--threads", "1", "--frames", "20,37", "--heads", "2", "--rounds", "1", "--json", str(out)]
    if native_attention.library()[0] is None:
        assert main(args) == 1
        assert "cannot run here" in capsys.readouterr().out
        return
    assert main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["frames"] for r in rows] == [20, 37]
    assert all(r["kernel_s"] > 0 and r["pytorch_s"] > 0 and r["max_err_kernel"] < 0.02 for r in rows)


def test_avx2_proxy_holds_every_library_down(tmp_path, monkeypatch):
    """scripts/avx2_proxy.py: only the AVX2 llama.cpp variants stay, the forced switches and the oneDNN-only int8
    engines reach the script, and the proxy's cache links the real one's models and clips but not its verdicts."""
    own = tmp_path / "proxy"
    lib = own / "llama" / "llama_cpp" / "lib"
    lib.mkdir(parents=True)
    for v in ("zen4", "skylakex", "alderlake", "haswell", "sse42"):
        (lib / f"libggml-cpu-{v}.so").write_bytes(b"")
    real = tmp_path / "real"
    (real / "model").mkdir(parents=True)
    (real / "model" / "flow.pt").write_bytes(b"")
    (real / "precision-checks.json").write_text("{}")
    (real / "bench-prompt-3s.wav").write_bytes(b"")
    monkeypatch.setenv("COSYLLAMA_CACHE", str(real))
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\n"
        "import cosyllama.flow.fast_dit as f\n"
        "keys = ('ATEN_CPU_CAPABILITY', 'ONEDNN_MAX_CPU_ISA', 'MKL_ENABLE_INSTRUCTIONS', 'COSYLLAMA_CACHE')\n"
        "out = {'env': {k: os.environ.get(k) for k in keys}, 'engines': list(f.INT8_ENGINES),\n"
        "       'path': os.environ['PYTHONPATH'].split(os.pathsep)[0], 'argv': sys.argv[1:]}\n"
        "open(sys.argv[1], 'w').write(json.dumps(out))\n")
    out = tmp_path / "out.json"
    main = runpy.run_path(str(SCRIPTS / "avx2_proxy.py"))["main"]
    assert main(["--llama-wheel", str(tmp_path / "unused.whl"), "--cache", str(own), str(probe), "--",
                 str(out), "more"]) == 0
    got = json.loads(out.read_text())
    assert got["env"] == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                          "MKL_ENABLE_INSTRUCTIONS": "AVX2", "COSYLLAMA_CACHE": str(own)}
    assert got["engines"] == ["onednn"] and got["argv"] == [str(out), "more"]
    assert got["path"] == str(own / "llama")
    assert sorted(p.name for p in lib.iterdir()) == ["libggml-cpu-haswell.so", "libggml-cpu-sse42.so"]
    assert (own / "model").is_symlink() and (own / "bench-prompt-3s.wav").is_symlink()
    assert not (own / "precision-checks.json").exists()  # the proxy's verdicts are its own


def test_avx2_proxy_refuses_a_wheel_without_variants(tmp_path, monkeypatch, capsys):
    lib = tmp_path / "proxy" / "llama" / "llama_cpp" / "lib"
    lib.mkdir(parents=True)
    (lib / "libggml-cpu.so").write_bytes(b"")
    monkeypatch.setenv("COSYLLAMA_CACHE", str(tmp_path / "real"))
    main = runpy.run_path(str(SCRIPTS / "avx2_proxy.py"))["main"]
    with pytest.raises(SystemExit, match="GGML_CPU_ALL_VARIANTS"):
        main(["--llama-wheel", "plain.whl", "--cache", str(tmp_path / "proxy"), "x.py"])
