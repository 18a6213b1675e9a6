"""The LLM checkpoint is one choice of the configuration: ``llm_weights=`` / ``--llm-weights``
(``llm.pt`` by default, the official directory's RL-tuned ``llm.rl.pt`` otherwise), with the GGUF
fingerprint following the file it was converted from."""

from __future__ import annotations

import pytest
import torch

from cosyllama.config import load_config
from cosyllama.errors import CheckpointError, InputError
from helpers import FIXTURES, MODEL_DIR


@pytest.fixture(scope="module")
def rl_model_dir(tmp_path_factory):
    """The fixture model plus an ``llm.rl.pt``: same keys, a changed output head."""
    d = tmp_path_factory.mktemp("rl-model")
    for p in MODEL_DIR.iterdir():
        (d / p.name).symlink_to(p)
    sd = torch.load(MODEL_DIR / "llm.pt", map_location="cpu", weights_only=True)
    key = next(k for k in sd if k.endswith("llm_decoder.weight"))
    sd[key] = sd[key] + 0.05 * torch.randn(sd[key].shape, generator=torch.Generator().manual_seed(0))
    torch.save(sd, d / "llm.rl.pt")
    return d


def test_torch_llm_loads_the_chosen_checkpoint(rl_model_dir):
    from cosyllama.config import load_config
    from cosyllama.llm.factory import make_llm

    cfg = load_config(rl_model_dir)
    base, rl = make_llm(cfg), make_llm(cfg, llm_weights="llm.rl.pt")
    w_base, w_rl = base.model.llm_decoder.weight, rl.model.llm_decoder.weight
    assert not torch.equal(w_base, w_rl)
    assert torch.equal(base.model.speech_embedding.weight, rl.model.speech_embedding.weight)


def test_a_missing_checkpoint_is_one_clear_error(capsys, tmp_path):
    from cosyllama import load
    from cosyllama.cli import main

    with pytest.raises(InputError, match=r"llm\.nope\.pt.* do not exist.*has: llm\.pt"):
        load(MODEL_DIR, llm_weights="llm.nope.pt")
    rc = main(["synth", "--model-dir", str(MODEL_DIR), "--text", "Hi.", "--out", str(tmp_path / "o.wav"),
               "--prompt-wav", str(FIXTURES / "wavs" / "prompt_en_16k.wav"), "--llm-weights", "llm.nope.pt"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "llm.nope.pt" in err and "Traceback" not in err


def test_gguf_follows_the_checkpoint_it_was_made_from(rl_model_dir, tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    from cosyllama.cli import main
    from cosyllama.llm.llamacpp_backend import LlamaCppLLM

    out = tmp_path / "rl.gguf"
    assert main(["convert", "--model-dir", str(rl_model_dir), "--out", str(out), "--type", "F32",
                 "--llm-weights", "llm.rl.pt"]) == 0
    with pytest.raises(CheckpointError, match=r"made from llm\.rl\.pt.*--llm-weights llm\.rl\.pt"):
        LlamaCppLLM(out, load_config(rl_model_dir))
    with LlamaCppLLM(out, load_config(rl_model_dir), llm_weights="llm.rl.pt", n_ctx=256) as b:
        assert b.info.layout == "speech"
