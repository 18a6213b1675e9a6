"""The public API and CLI through the llama.cpp backend (F32 GGUF: tokens identical to the fixtures)."""

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from cosyllama import load  # noqa: E402
from cosyllama.cli import main  # noqa: E402
from helpers import FIXTURES, MODEL_DIR, load_fixture, synthesize_call  # noqa: E402
from stage_checks import StageRecorder, check_stages, check_whole_waveform  # noqa: E402

CASES = sorted(p.stem for p in FIXTURES.glob("e2e_*.npz"))


@pytest.fixture(scope="module")
def gguf_f32(tiny_gguf):
    return tiny_gguf("speech", "F32")


@pytest.fixture(scope="module")
def tts_llama(gguf_f32):
    return load(MODEL_DIR, llm="llamacpp", gguf=gguf_f32, precision="fp32")


@pytest.fixture(scope="module")
def ref_hift():
    from cosyllama.vocoder import HiFT

    return HiFT.from_dir(MODEL_DIR)


@pytest.mark.parametrize("case", CASES)
def test_e2e_llamacpp_f32_tokens_identical(tts_llama, ref_hift, case):
    _, meta = load_fixture(case)
    with StageRecorder(tts_llama.token2wav) as rec:
        syn = synthesize_call(tts_llama, meta["meta"]["call"])
        chunks = list(syn)
    assert len(syn.timings.tokens) == 1
    check_stages(rec, ref_hift, case[len("e2e_"):], syn.timings.tokens[0], [c.samples.size for c in chunks],
                 frontend=True)
    check_whole_waveform(np.concatenate([c.samples for c in chunks]), case[len("e2e_"):], frontend=True)


def test_cli_gguf_of_another_model_is_refused(tmp_path, capsys):
    other = tmp_path / "other"
    assert main(["make-model", str(other), "--size", "tiny", "--seed", "5"]) == 0
    foreign = tmp_path / "foreign.gguf"
    assert main(["convert", "--model-dir", str(other), "--out", str(foreign), "--type", "F32"]) == 0
    capsys.readouterr()
    rc = main(["synth", "--model-dir", str(MODEL_DIR), "--gguf", str(foreign), "--text", "Hi.",
               "--prompt-wav", str(FIXTURES / "wavs/prompt_en_16k.wav"), "--out", str(tmp_path / "o.wav")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "does not belong" in err or "fingerprint" in err or "different model" in err, err


def test_cli_convert_refuses_overwrite(tmp_path, capsys):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"keep me")
    rc = main(["convert", "--model-dir", str(MODEL_DIR), "--out", str(out), "--type", "F32"])
    assert rc == 2 and out.read_bytes() == b"keep me"
    assert "--force" in capsys.readouterr().err
