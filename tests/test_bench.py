"""make-model output loads strictly; bench's JSON carries every documented field."""

import json

import pytest
import torch

from cosyllama.cli import main
from cosyllama.config import load_config
from cosyllama.errors import InputError
from cosyllama.weights import load_flow_weights, load_hift_weights, load_llm_weights
from helpers import MODEL_DIR


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("made") / "tiny"
    assert main(["make-model", str(d), "--size", "tiny", "--seed", "3"]) == 0
    return d


def test_make_model_loads_strictly(tiny_model):
    cfg = load_config(tiny_model)
    assert cfg.llm.qwen.hidden_size == 16 and cfg.flow.dit_depth == 2 and cfg.hift.base_channels == 32
    llm = load_llm_weights(tiny_model / "llm.pt", cfg.llm)
    load_flow_weights(tiny_model / "flow.pt", cfg.flow)
    load_hift_weights(tiny_model / "hift.pt", cfg.hift)
    assert all(torch.isfinite(v).all() for v in llm.values())


def test_make_model_deterministic_and_refuses_overwrite(tiny_model, tmp_path, capsys):
    other = tmp_path / "again"
    assert main(["make-model", str(other), "--size", "tiny", "--seed", "3"]) == 0
    a = torch.load(tiny_model / "flow.pt", weights_only=True)
    b = torch.load(other / "flow.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["make-model", str(other), "--size", "tiny"]) == 2
    assert "--force" in capsys.readouterr().err


def test_made_model_synthesizes(tiny_model):
    import cosyllama
    from cosyllama.tools.bench_setup import prompt_wav

    tts = cosyllama.load(tiny_model)
    audio = tts.cross_lingual("Hello there.", prompt_wav(2.0), greedy=True, max_tokens=30, ignore_stop=True).audio()
    assert audio.shape == (30 * 960,) and abs(audio).max() <= 0.99


def test_bench_json_has_every_field(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("COSYLLAMA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model-dir", str(tiny_model), "--json", str(out), "--prompt-seconds", "1",
               "--output-seconds", "1", "--threads", "1"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["machine"]) >= {"cpu", "threads", "gpu", "cpu_class", "isa", "torch_kernels", "llama_cpp"}
    assert res["machine"]["threads"] == 1
    from cosyllama.cpu import cpu_class

    assert res["machine"]["cpu_class"] == cpu_class() and res["machine"]["llama_cpp"]  # the build's features
    assert res["machine"]["device"] == "cpu" and {r["device"] for r in res["llm"] + res["pipeline"]} == {"cpu"}
    configs = {(r["backend"], r["layout"], r["type"]) for r in res["llm"]}
    assert configs == {("torch", None, "F32")} | {("llamacpp", lay, t) for lay in ("speech", "merged")
                                                 for t in ("F16", "Q8_0", "Q4_K_M", "Q4_0")}
    for r in res["llm"]:
        assert r["decode_tokens"] == 25 and r["prefill_tokens"] == 25 + 41 + 2
        assert r["tokens_per_s"] > 0 and r["rtf"] > 0
    for part in ("flow", "vocoder"):
        assert res[part] and all(r["variant"] and r["seconds_per_audio_second"] > 0 for r in res[part])
    from cosyllama.precision import int8_available

    engines = torch.backends.quantized.supported_engines
    assert [r["variant"] for r in res["flow"]] == ["fp32", "bf16"] + (["int8"] if int8_available() else []) + (
        ["int8-onednn"] if "onednn" in engines else [])
    assert res["flow"][0]["mel_max_abs_diff_vs_fp32"] == 0
    assert [(r["llm"], r["flow"]) for r in res["pipeline"]][:2] == [("torch fp32", "fp32"),
                                                                     ("llamacpp speech Q8_0", "fp32")]
    for r in res["pipeline"]:
        assert r["rtf"] > 0 and r["first_chunk_s"] > 0 and r["peak_rss_mb"] > 0 and r["flow"]


def test_rows_take_turns_so_a_drift_cancels(tiny_model, tmp_path, monkeypatch):
    """With --repeat 2 the pipeline's configurations run A B C, C B A: a machine that slows down
    steadily during the run gives every row the same median (run one after another, the last
    row would look slowest); each row keeps its rounds and its highest peak RSS."""
    import types

    from cosyllama.tools import bench

    assert bench.rounds(["a", "b", "c"], 3) == list("abccbaabc") and bench.rounds(["a"], 2) == ["a", "a"]
    monkeypatch.setenv("COSYLLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bench, "ensure_gguf", lambda *a, **k: tmp_path / "fake.gguf")
    monkeypatch.setattr(bench, "llamacpp_gpu_layers", lambda *a, **k: 0)
    calls = []

    def child(cmd, **kw):  # a child whose times grow by one with every run, whatever it runs
        load = json.loads(cmd[-1])["load"]  # the child's LoadOptions
        calls.append((load["llm"], load["precision"]))
        t = float(len(calls))
        out = {"flow": load["precision"], "rtf": t, "first_chunk_s": 10 * t, "peak_rss_mb": 100.0 * t,
               "llm_s": t, "token2wav_s": t, "stream_llm_s": t, "stream_token2wav_s": t}
        return types.SimpleNamespace(returncode=0, stdout=json.dumps(out) + "\n", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", child)
    rows = bench.run_pipeline(tiny_model, 1, 1.0, 1.0, 2, lambda *_: None)
    configs = [(c[0], c[3]) for c in bench.PIPELINE_CONFIGS]
    assert calls == configs + configs[::-1]
    assert [r["rtf"] for r in rows] == [3.5] * 3 and [r["first_chunk_s"] for r in rows] == [35.0] * 3
    assert [r["peak_rss_mb"] for r in rows] == [600.0, 500.0, 400.0]
    assert all(len(r["rounds"]) == 2 for r in rows) and rows[2]["flow"] == "auto"


def test_bench_flow_rows_take_turns(tiny_model, tmp_path, monkeypatch):
    """--repeat 2 times each flow and vocoder precision twice, interleaved, and reports the median."""
    monkeypatch.setenv("COSYLLAMA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    assert main(["bench", "--model-dir", str(tiny_model), "--json", str(out), "--parts", "flow,vocoder",
                 "--repeat", "2", "--flow-precisions", "fp32,bf16", "--prompt-seconds", "1",
                 "--output-seconds", "1", "--threads", "1"]) == 0
    res = json.loads(out.read_text())
    assert [r["variant"] for r in res["flow"]] == ["fp32", "bf16"] and res["flow"][0]["mel_max_abs_diff_vs_fp32"] == 0
    for r in res["flow"] + res["vocoder"]:
        rs = r["rounds_seconds_per_audio_second"]
        assert len(rs) == 2 and r["seconds_per_audio_second"] == pytest.approx(sum(rs) / 2)


def test_bench_rejects_bad_parts(capsys):
    assert main(["bench", "--parts", "llm,gpu"]) == 2
    assert "unknown --parts gpu" in capsys.readouterr().err


def test_bench_flow_precisions(capsys):
    from cosyllama.tools.bench_flow import flow_variants

    cpu = torch.device("cpu")
    assert flow_variants("int8, auto,int8", cpu) == ("fp32", "int8", "auto")  # fp32 first: the fidelity reference
    assert "int8" not in flow_variants(None, torch.device("cuda"))
    assert main(["bench", "--flow-precisions", "fp32,int4"]) == 2
    assert "--flow-precisions 'fp32,int4': choose from fp32, bf16, int8, auto" in capsys.readouterr().err


def test_bench_rejects_a_device_it_cannot_use(capsys):
    assert main(["bench", "--device", "tpu"]) == 2
    assert "device 'tpu' is not supported" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--device", "cuda"]) == 2
        assert "sees no CUDA device" in capsys.readouterr().err


def test_size_config_is_what_make_model_writes():
    from cosyllama.errors import InputError
    from cosyllama.tools.synthetic import size_config

    tiny, ref = size_config("tiny"), load_config(MODEL_DIR)  # make-model's tiny = the fixtures' model
    assert (tiny.llm, tiny.flow, tiny.hift, tiny.feat) == (ref.llm, ref.flow, ref.hift, ref.feat)
    full = size_config("full")
    assert (full.flow.dit_dim, full.flow.dit_depth, full.hift.base_channels, full.llm.qwen.num_hidden_layers) \
        == (1024, 22, 512, 24)
    with pytest.raises(InputError):
        size_config("huge")


def test_llm_types_choose_the_llamacpp_rows():
    from cosyllama.errors import InputError
    from cosyllama.tools.bench import LLM_CONFIGS, llm_configs

    assert llm_configs(None) == LLM_CONFIGS
    assert llm_configs("Q8_0") == [("torch", None, "F32"), ("llamacpp", "speech", "Q8_0"),
                                   ("llamacpp", "merged", "Q8_0")]
    with pytest.raises(InputError, match="Q9"):
        llm_configs("Q8_0,Q9")


def test_bench_profile_stream_and_research_variants(tiny_model, tmp_path, monkeypatch, capsys):
    """--profile splits a flow and a vocoder call by op kind, --stream times one streaming synthesis per
    flow variant with the flow cache and without; the research variants run and change what they claim."""
    monkeypatch.setenv("COSYLLAMA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    assert main(["bench", "--model-dir", str(tiny_model), "--json", str(out), "--parts", "flow,vocoder",
                 "--flow-precisions", "bf16,bf16-res16,bf16-steps2,fp32-autocast,int8",
                 "--vocoder-precisions", "fp32-ref",
                 "--profile", "--stream", "--prompt-seconds", "1", "--output-seconds", "2", "--threads", "1"]) == 0
    table = capsys.readouterr().out
    assert "op time shares of one call" in table and "streaming (fp32 vocoder)" in table
    res = json.loads(out.read_text())
    flow = {r["variant"]: r for r in res["flow"]}
    assert list(flow) == ["fp32", "bf16", "bf16-res16", "bf16-steps2", "fp32-autocast", "int8"]
    for r in res["flow"]:
        share = r["time_share"]
        assert set(share) == {"int8 products", "quantization passes", "bf16/fp32 products", "attention", "conv",
                              "dtype conversions", "gelu", "norm/modulation", "other"}
        assert share["attention"] > 0 and share["bf16/fp32 products"] > 0  # int8: the input/output projections
        assert (share["int8 products"] > 0) == (r["variant"] == "int8")
        assert sum(share.values()) == pytest.approx(1, abs=0.01)
        s = r["stream"]  # 1 s prompt + 2 s: one 25-token chunk, then the final call
        assert s["flow_calls"] == 2 and s["peak_cache_mb"] > 0 and s["wav_max_abs_diff_cache_vs_recompute"] < 1e-4
        for mode in ("cache", "recompute"):
            assert 0 < s[mode]["first_chunk_s"] <= s[mode]["total_s"] and 0 < s[mode]["flow_s"] <= s[mode]["total_s"]
    diffs = {v: r["mel_mean_abs_diff_vs_fp32"] for v, r in flow.items()}
    assert diffs["fp32"] == 0 and all(d > 0 for v, d in diffs.items() if v != "fp32")
    assert diffs["bf16-res16"] != diffs["bf16"] and diffs["bf16-steps2"] > 10 * diffs["bf16"]
    assert [r["variant"] for r in res["vocoder"]] == ["fp32", "fp32-ref"]
    assert all("conv" in r["time_share"] for r in res["vocoder"])
    assert 0 < res["vocoder"][1]["wav_max_abs_diff_vs_fp32"] < 1e-3  # the reference path: same math


def test_flow_variant_names():
    from cosyllama.flow.fast_dit import FastDiT
    from cosyllama.tools.bench_flow import FlowVariant, batch_sizes, flow_variants, vocoder_variants

    cpu = torch.device("cpu")
    assert FlowVariant.parse("bf16-steps5") == FlowVariant("bf16-steps5", "bf16", steps=5)
    assert FlowVariant.parse("int8-onednn") == FlowVariant("int8-onednn", "int8", engine="onednn")
    assert FlowVariant.parse("fp32-autocast").autocast and FlowVariant.parse("bf16-res16").residual_bf16
    assert all(FlowVariant.parse(n) is None for n in ("bf16-steps0", "bf16-steps101", "auto-steps3", "fp16"))
    assert flow_variants("bf16-res16,bf16-steps7", cpu) == ("fp32", "bf16-res16", "bf16-steps7")
    assert flow_variants("bf16,fp32", cpu, reference=False) == ("bf16", "fp32")
    with pytest.raises(InputError, match="bf16-steps0"):
        flow_variants("bf16-steps0", cpu)
    with FlowVariant.parse("bf16-res16").running(cpu):
        assert FastDiT.residual_dtype == torch.bfloat16
    assert FastDiT.residual_dtype == torch.float32  # restored
    assert vocoder_variants(None) == ("fp32", "bf16") and vocoder_variants("bf16-ref") == ("fp32", "bf16-ref")
    with pytest.raises(InputError, match="--vocoder-precisions 'int8'"):
        vocoder_variants("int8")
    assert batch_sizes(None) == (1, 2, 4, 8, 16) and batch_sizes("4,1,4") == (4, 1)
    with pytest.raises(InputError, match="--batch-sizes"):
        batch_sizes("1,x")


def test_bench_setup_paths_follow_the_cache_dir_and_are_light(tmp_path, monkeypatch):
    """The bench set-up's files live in the cache directory; a GGUF already there is reused, not converted
    again; importing bench_setup loads neither torch nor numpy (scripts set threads after importing it)."""
    import subprocess
    import sys

    from cosyllama.tools import bench_setup

    monkeypatch.setenv("COSYLLAMA_CACHE", str(tmp_path))
    assert bench_setup.full_model_dir(3) == tmp_path / "full-random-seed3"
    path = bench_setup.gguf_path(MODEL_DIR, "speech", "Q8_0")
    assert path.parent.parent == tmp_path / "gguf" and path.name == "llm-speech-Q8_0.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"made before")
    said = []
    assert bench_setup.ensure_gguf(MODEL_DIR, "speech", "Q8_0", said.append) == path and said == []
    code = "import sys, cosyllama.tools.bench_setup; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


def test_bench_setup_makes_a_gguf_once_when_two_processes_ask_at_once(tmp_path, monkeypatch):
    """Two makers of one cached GGUF (a bench beside a demo): the second waits for the first and finds the
    file made, instead of rewriting the F32 file the first one's quantizer is reading (that died of SIGBUS)."""
    import threading
    import time

    from cosyllama.llm import gguf
    from cosyllama.tools import bench_setup

    monkeypatch.setenv("COSYLLAMA_CACHE", str(tmp_path))
    inside, calls = threading.Event(), []

    def fake_convert(model_dir, out, **kw):
        calls.append(out)
        inside.set()
        time.sleep(0.3)  # the second thread arrives while this one converts (it is already waiting by then)
        out.write_bytes(b"gguf")
        return out

    monkeypatch.setattr(gguf, "convert", fake_convert)
    first = threading.Thread(target=bench_setup.ensure_gguf, args=(MODEL_DIR, "speech", "Q8_0", lambda m: None))
    first.start()
    assert inside.wait(30)
    path = bench_setup.ensure_gguf(MODEL_DIR, "speech", "Q8_0", lambda m: None)  # must wait, then reuse
    first.join(30)
    assert path.read_bytes() == b"gguf" and len(calls) == 1


def test_the_torch_attention_variant_runs_pytorchs_attention(monkeypatch):
    """``<variant>-torch-attention`` is its variant with PyTorch's bf16 attention where the bf16 kernel would run
    (what the kernel gains, in turns in one run); the setting is back as it was after each call."""
    from cosyllama.flow import native_attention
    from cosyllama.tools.bench_flow import FlowVariant

    v = FlowVariant.parse("int8-onednn+bf16+static-torch-attention")
    assert (v.precision, v.engine, v.torch_attention) == ("int8", "onednn+bf16+static", True)
    assert FlowVariant.parse("bf16-torch-attention").precision == "bf16"
    assert FlowVariant.parse("bf16-torch-attention-torch-attention") is None
    assert FlowVariant.parse("bf17-torch-attention") is None
    monkeypatch.setenv(native_attention.ENV, "kernel")
    with v.running(torch.device("cpu")):
        assert native_attention.mode() == "pytorch"
    assert native_attention.mode() == "kernel"
    monkeypatch.delenv(native_attention.ENV)
    with v.running(torch.device("cpu")):
        assert native_attention.mode() == "pytorch"
    assert native_attention.ENV not in __import__("os").environ
