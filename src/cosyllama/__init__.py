"""cosyllama: CosyVoice3 text-to-speech with the speech-token LLM on llama.cpp or PyTorch.

``import cosyllama`` is light; the models load on first use of :func:`load`.
"""

from .errors import CheckpointError, CosyllamaError, DeviceError, InputError, MissingDependencyError, ModelDirError

__version__ = "0.1.0"

_LAZY = {"load": "tts", "TTS": "tts", "SynthesisOptions": "request", "SynthesisRequest": "request", "Synthesis": "tts",
         "AudioChunk": "engine", "PromptFeatures": "frontend", "LoadOptions": "options", "align": "alignment"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'cosyllama' has no attribute {name!r}")


__all__ = ["AudioChunk", "CheckpointError", "CosyllamaError", "DeviceError", "InputError", "LoadOptions",
           "MissingDependencyError", "ModelDirError", "PromptFeatures", "Synthesis", "SynthesisOptions",
           "SynthesisRequest", "TTS", "align", "load", "__version__"]
