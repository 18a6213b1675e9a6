"""Upstream-compatible facade: scripts written for CosyVoice's ``AutoModel`` switch by changing one
import::

    from cosyllama.compat import AutoModel      # was: from cosyvoice.cli.cosyvoice import AutoModel
    cosyvoice = AutoModel(model_dir="Fun-CosyVoice3-0.5B", load_llama_cpp=True, gguf_model_path="q8.gguf")
    for out in cosyvoice.inference_zero_shot(text, prompt_text, "prompt.wav", stream=False):
        torchaudio.save("out.wav", out["tts_speech"], cosyvoice.sample_rate)

Same method names and arguments; each yield is ``{"tts_speech": float32 tensor (1, N)}`` at 24 kHz.
A thin layer over :class:`cosyllama.tts.TTS`; arguments the reference accepts but that have no
meaning here (``load_trt``, ``load_vllm``, ``fp16``, ``trt_concurrent``) are accepted and ignored.

Reproducibility works as upstream scripts expect: each call draws its sampling seed from torch's
global generator, so ``torch.manual_seed(s)`` (or upstream's ``set_all_random_seed``) before a call
makes it repeatable, while the sampling itself runs on a private generator.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from .errors import InputError
from .options import LoadOptions
from .request import SEED_RANGE, SynthesisOptions, SynthesisRequest
from .tts import TTS
from .voices import VoiceStore

SPKINFO_NAME = "spk2info.pt"


def _call_seed() -> int:
    """A per-call seed drawn from torch's global generator (see the module docstring)."""
    return int(torch.randint(0, SEED_RANGE[1], (1,)).item())


class CosyVoice3:
    def __init__(self, model_dir: str, load_llama_cpp: bool = False, gguf_model_path: str | None = None,
                 device: str = "cpu", threads: int | None = None, n_gpu_layers: int = 0, precision: str = "auto",
                 load_trt: bool = False, load_vllm: bool = False, fp16: bool = False, trt_concurrent: int = 1):
        self.model_dir = str(model_dir)
        self.tts = TTS(LoadOptions(model_dir, llm="llamacpp" if load_llama_cpp else "torch", gguf=gguf_model_path,
                                   device=device, threads=threads, n_gpu_layers=n_gpu_layers, precision=precision))
        self.sample_rate = self.tts.sample_rate
        spk = Path(model_dir) / SPKINFO_NAME
        if spk.is_file():
            try:
                self.tts.voices.load(spk)
            except InputError:
                pass  # an upstream-format spk2info.pt: its speakers are not usable by CosyVoice3 anyway

    @staticmethod
    def _dicts(chunks) -> Iterator[dict]:
        for c in chunks:
            yield {"tts_speech": torch.from_numpy(c.samples).reshape(1, -1)}

    def _run(self, tts_text: str, mode: str, prompt_wav, zero_shot_spk_id: str, stream: bool, speed: float,
             text_frontend: bool, prompt_text: str | None = None, instruction: str | None = None) -> Iterator[dict]:
        """One request: a registered speaker (``zero_shot_spk_id``) replaces the clip and its transcript."""
        opts = SynthesisOptions(stream=stream, speed=speed, text_frontend=text_frontend, seed=_call_seed())
        if zero_shot_spk_id:
            request = SynthesisRequest(tts_text, mode, voice=zero_shot_spk_id, instruction=instruction, options=opts)
        else:
            request = SynthesisRequest(tts_text, mode, prompt_wav=prompt_wav, prompt_text=prompt_text,
                                       instruction=instruction, options=opts)
        return self._dicts(self.tts.run(request))

    def inference_zero_shot(self, tts_text: str, prompt_text: str, prompt_wav, zero_shot_spk_id: str = "",
                            stream: bool = False, speed: float = 1.0, text_frontend: bool = True) -> Iterator[dict]:
        return self._run(tts_text, "zero-shot", prompt_wav, zero_shot_spk_id, stream, speed, text_frontend,
                         prompt_text=prompt_text)

    def inference_cross_lingual(self, tts_text: str, prompt_wav, zero_shot_spk_id: str = "", stream: bool = False,
                                speed: float = 1.0, text_frontend: bool = True) -> Iterator[dict]:
        return self._run(tts_text, "cross-lingual", prompt_wav, zero_shot_spk_id, stream, speed, text_frontend)

    def inference_instruct2(self, tts_text: str, instruct_text: str, prompt_wav, zero_shot_spk_id: str = "",
                            stream: bool = False, speed: float = 1.0, text_frontend: bool = True) -> Iterator[dict]:
        return self._run(tts_text, "instruct", prompt_wav, zero_shot_spk_id, stream, speed, text_frontend,
                         instruction=instruct_text)

    def inference_vc(self, source_wav, prompt_wav, stream: bool = False, speed: float = 1.0) -> Iterator[dict]:
        opts = SynthesisOptions(stream=stream, speed=speed, seed=_call_seed())
        return self._dicts(self.tts.voice_conversion(source_wav, prompt_wav, options=opts))

    def add_zero_shot_spk(self, prompt_text: str, prompt_wav, zero_shot_spk_id: str) -> bool:
        self.tts.add_voice(zero_shot_spk_id, prompt_wav, prompt_text)
        return True

    def list_available_spks(self) -> list[str]:
        return self.tts.voices.ids()

    def save_spkinfo(self) -> None:
        """Write the registered voices to ``<model_dir>/spk2info.pt`` (cosyllama's voice format)."""
        self.tts.voices.save(Path(self.model_dir) / SPKINFO_NAME)


def AutoModel(**kwargs) -> CosyVoice3:
    """``AutoModel(model_dir=..., load_llama_cpp=False, gguf_model_path=None, ...)``: the model
    directory must hold ``cosyvoice3.yaml`` (CosyVoice v1/v2 directories are not supported)."""
    if "model_dir" not in kwargs:
        raise InputError("AutoModel needs model_dir=")
    d = Path(kwargs["model_dir"])
    if d.is_dir() and not (d / "cosyvoice3.yaml").is_file() and any(
            (d / n).is_file() for n in ("cosyvoice.yaml", "cosyvoice2.yaml")):
        raise InputError(f"{d} is a CosyVoice v1/v2 model directory; cosyllama runs CosyVoice3 only")
    return CosyVoice3(**kwargs)


__all__ = ["AutoModel", "CosyVoice3", "VoiceStore"]
