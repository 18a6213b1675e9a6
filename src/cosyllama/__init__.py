"""cosyllama: CosyVoice3 text-to-speech with the speech-token LLM on llama.cpp or PyTorch."""

from .errors import (CheckpointError, CosyllamaError, DeviceError, InputError, MissingDependencyError,
                     ModelDirError)

__version__ = "0.1.0"

__all__ = ["CheckpointError", "CosyllamaError", "DeviceError", "InputError", "MissingDependencyError",
           "ModelDirError", "__version__"]
