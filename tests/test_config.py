"""Model directory reading: safe yaml, required files, strict llm.pt loading."""

import shutil

import pytest
import torch

from cosyllama.config import REQUIRED_FILES, Tagged, load_config, read_hyperpyyaml
from cosyllama.errors import CheckpointError, DeviceError, ModelDirError
from cosyllama.llm.torch_backend import TorchLLM
from cosyllama.weights import load_llm_weights
from helpers import MODEL_DIR


def test_config_values():
    cfg = load_config(MODEL_DIR)
    assert cfg.sample_rate == 24000 and cfg.chunk_size == 25 and cfg.token_mel_ratio == 2
    assert cfg.llm.qwen.hidden_size == 16 and cfg.llm.qwen.num_hidden_layers == 2
    assert cfg.llm.qwen.vocab_size == 151936 and cfg.llm.qwen.rope_theta == 1e6
    assert cfg.llm.vocab_size == 6761 and (cfg.llm.sos, cfg.llm.eos, cfg.llm.task_id) == (6561, 6562, 6563)
    s = cfg.llm.sampling
    assert (s.top_p, s.top_k, s.win_size, s.tau_r) == (0.8, 25, 10, 0.1)
    assert cfg.flow.static_chunk_size == 50  # !ref <chunk_size> * <token_mel_ratio>
    assert cfg.flow.inference_cfg_rate == 0.7 and cfg.flow.dit_depth == 2
    assert cfg.hift.upsample_rates == (8, 5, 3) and cfg.hift.f0_cond_channels == 32
    assert cfg.feat.n_fft == 1920 and cfg.feat.fmax is None and cfg.feat.center is False


def test_yaml_tags_are_data_not_code(tmp_path):
    marker = tmp_path / "pwned"
    y = tmp_path / "x.yaml"
    y.write_text(f"a: 2\nb: !ref <a> * 3\nboom: !apply:os.system ['touch {marker}']\n"
                 "obj: !new:collections.OrderedDict\n  k: !ref <b>\n")
    doc = read_hyperpyyaml(y)
    assert doc["b"] == 6
    assert isinstance(doc["boom"], Tagged) and doc["boom"].target == "os.system"
    assert doc["obj"].args == {"k": 6}
    assert not marker.exists()


def test_yaml_ref_rejects_code(tmp_path):
    y = tmp_path / "x.yaml"
    y.write_text("a: 2\nb: !ref <a> + __import__('os').getpid()\n")
    with pytest.raises(ModelDirError, match="cannot resolve a !ref"):
        read_hyperpyyaml(y)


def _copy_model(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(MODEL_DIR, d)
    return d


def test_missing_dir_lists_required_files(tmp_path):
    with pytest.raises(ModelDirError, match="must contain: cosyvoice3.yaml"):
        load_config(tmp_path / "nope")


@pytest.mark.parametrize("name", ["llm.pt", "cosyvoice3.yaml", "CosyVoice-BlankEN/config.json", "campplus.onnx"])
def test_missing_file_named(tmp_path, name):
    d = _copy_model(tmp_path)
    (d / name).unlink()
    with pytest.raises(ModelDirError, match=rf"lacks {name}.*must contain") as e:
        load_config(d)
    assert all(f in str(e.value) for f in REQUIRED_FILES)


def _load_edited_llm(tmp_path, edit):
    """Load a copy of the fixture llm.pt after ``edit(state_dict)`` changed it."""
    sd = torch.load(MODEL_DIR / "llm.pt", weights_only=True)
    edit(sd)
    p = tmp_path / "llm.pt"
    torch.save(sd, p)
    return load_llm_weights(p, load_config(MODEL_DIR).llm)


def test_checkpoint_missing_and_unexpected_keys(tmp_path):
    def edit(sd):
        sd.pop("llm_decoder.weight")
        sd["llm_decoder.bias"] = torch.zeros(6761)

    with pytest.raises(CheckpointError, match=r"missing keys: llm_decoder\.weight.*unexpected keys: llm_decoder\.bias"):
        _load_edited_llm(tmp_path, edit)


def test_checkpoint_wrong_shape(tmp_path):
    with pytest.raises(CheckpointError, match=r"speech_embedding\.weight \(6564, 16\) \(expected \(6761, 16\)\)"):
        _load_edited_llm(tmp_path, lambda sd: sd.update({"speech_embedding.weight": torch.zeros(6564, 16)}))


def test_checkpoint_not_a_checkpoint(tmp_path):
    cfg = load_config(MODEL_DIR)
    p = tmp_path / "llm.pt"
    p.write_bytes(b"this is not a zip file")
    with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint"):
        load_llm_weights(p, cfg.llm)


def test_cuda_without_cuda_is_an_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError, match="no CUDA device"):
        TorchLLM.from_dir(MODEL_DIR, device="cuda")
    with pytest.raises(DeviceError, match="not supported"):
        TorchLLM.from_dir(MODEL_DIR, device="tpu")


def test_true_fp32_turns_tf32_off_for_cuda_and_restores_after_overlapping_blocks():
    """The flags are process-wide and need no GPU to read or set, so the bookkeeping is checked here;
    tests/test_gpu.py checks that a CUDA vocoder call really runs with TF32 off."""
    from cosyllama.device import true_fp32

    flags = lambda: (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)  # noqa: E731
    saved = flags()
    try:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, True
        with true_fp32(torch.device("cpu")):
            assert flags() == (True, True)
        outer = true_fp32(torch.device("cuda"))
        inner = true_fp32(torch.device("cuda:0"))
        outer.__enter__()
        assert flags() == (False, False)
        inner.__enter__()
        outer.__exit__(None, None, None)  # blocks of two threads may end in either order
        assert flags() == (False, False)
        inner.__exit__(None, None, None)
        assert flags() == (True, True)
        with pytest.raises(ValueError):
            with true_fp32(torch.device("cuda")):
                raise ValueError
        assert flags() == (True, True)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
