"""Speech tokens and speaker embedding from prompt audio, with the two ONNX models of the model directory (see
docs/reference.md#speech-tokenizer and docs/reference.md#speaker-embedding): ``speech_tokenizer_v3.onnx`` (16
kHz Whisper log-mel -> 25 Hz speech tokens) and ``campplus.onnx`` (Kaldi fbank -> 192-d speaker embedding).

One :class:`PromptEncoder` per model directory holds the two onnxruntime sessions, created once.
``InferenceSession.run`` is thread-safe, and the encoder keeps no other state, so one instance
serves concurrent requests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .audio import kaldi_fbank, whisper_log_mel
from .errors import DeviceError, MissingDependencyError, ModelDirError

SPEECH_TOKENIZER_FILE = "speech_tokenizer_v3.onnx"
SPEAKER_ENCODER_FILE = "campplus.onnx"
SPEAKER_EMBED_DIM = 192
SPEECH_TOKEN_COUNT = 6561  # speech token ids are in [0, 6561)


def _session(path: Path, providers: Sequence[str], threads: int | None):
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise MissingDependencyError("the prompt encoders need onnxruntime: pip install onnxruntime") from e
    if not path.is_file():
        raise ModelDirError(f"{path} is missing; the model directory must contain {path.name}")
    available = ort.get_available_providers()
    unknown = [p for p in providers if p not in available]
    if unknown:
        raise DeviceError(f"onnxruntime provider(s) {unknown} not available here; available: {available}")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        opts.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(str(path), sess_options=opts, providers=list(providers))
    except Exception as e:  # onnxruntime raises its own exception types for corrupt files
        raise ModelDirError(f"{path}: onnxruntime cannot load it: {e}") from e


class PromptEncoder:
    """Speech tokenizer + speaker encoder sessions of one model directory.

    ``providers``: onnxruntime execution providers, default CPU only (e.g.
    ``("CUDAExecutionProvider", "CPUExecutionProvider")`` where onnxruntime-gpu is installed).
    ``threads``: intra-op threads per session (None: onnxruntime's default).
    """

    def __init__(self, model_dir: str | Path, providers: Sequence[str] = ("CPUExecutionProvider",),
                 threads: int | None = None):
        model_dir = Path(model_dir)
        self._tokenizer = _session(model_dir / SPEECH_TOKENIZER_FILE, providers, threads)
        self._speaker = _session(model_dir / SPEAKER_ENCODER_FILE, providers, threads)
        self._tok_inputs = [i.name for i in self._tokenizer.get_inputs()]
        self._spk_input = self._speaker.get_inputs()[0].name
        if len(self._tok_inputs) != 2:
            raise ModelDirError(f"{model_dir / SPEECH_TOKENIZER_FILE}: expected 2 inputs (feats, feats_length), "
                                f"found {self._tok_inputs}")

    def speech_tokens(self, wav16: torch.Tensor) -> torch.Tensor:
        """25 Hz speech tokens of 16 kHz audio ``(1, N)`` -> int32 ``(n_tok,)``, ids in [0, 6561).

        Input to the ONNX model: the Whisper log-mel float32 ``(1, 128, T)`` and ``[T]`` int32.
        Callers check the 30 s limit (:func:`cosyllama.audio.check_prompt_audio`).
        """
        mel = whisper_log_mel(wav16).numpy().astype(np.float32, copy=False)
        feeds = {self._tok_inputs[0]: mel, self._tok_inputs[1]: np.array([mel.shape[2]], dtype=np.int32)}
        tokens = self._tokenizer.run(None, feeds)[0]
        return torch.from_numpy(np.asarray(tokens).reshape(-1).astype(np.int32))

    def speaker_embedding(self, wav16: torch.Tensor) -> torch.Tensor:
        """Speaker embedding of 16 kHz audio ``(1, N)`` -> float32 ``(192,)``, not normalized.

        Input to the ONNX model: the Kaldi fbank minus its per-bin mean over time, ``(1, T, 80)``.
        """
        feat = kaldi_fbank(wav16)
        feat = feat - feat.mean(dim=0, keepdim=True)
        out = self._speaker.run(None, {self._spk_input: feat.unsqueeze(0).numpy()})[0]
        return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(-1))
