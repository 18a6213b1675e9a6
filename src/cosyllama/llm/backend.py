"""The small protocol every LLM backend implements (torch, llama.cpp).

A backend owns the weights and the KV memory; a *sequence* is one request's position in it. The
backend never samples: it returns the log-probabilities over the 6761 speech ids, and the shared
sampler (:mod:`cosyllama.llm.sampling`) picks the token. Decode steps of several sequences can be
advanced together in one call (:meth:`LLMBackend.step`), which is what the server batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from ..config import LLMConfig


@dataclass(frozen=True)
class Prefill:
    """The LLM prompt of one request (see docs/reference.md#prefill).

    The backend assembles ``[sos] + text(text_ids) + [task_id] + speech(prompt_speech_tokens)``:
    ``text_ids`` are Qwen text ids (prompt/instruct text followed by the target text) and
    ``prompt_speech_tokens`` speech ids in ``[0, 6561)`` from the prompt audio (may be empty).
    """

    text_ids: tuple[int, ...]
    prompt_speech_tokens: tuple[int, ...] = ()

    def __len__(self) -> int:
        """Number of prefill positions, sos and task included."""
        return len(self.text_ids) + len(self.prompt_speech_tokens) + 2


@runtime_checkable
class LLMBackend(Protocol):
    """What the decode loop needs from a backend."""

    name: str  # "torch" | "llamacpp"
    config: LLMConfig  # speech ids, sampling defaults; vocab_size (6761) = len(logp)

    def start(self, prefill: Prefill, max_new_tokens: int) -> tuple[object, torch.Tensor]:
        """Create a sequence, run the prefill, return ``(handle, logp)``.

        ``logp``: float32 CPU tensor (vocab_size,) = log_softmax of the speech logits at the last
        prefill position. ``max_new_tokens`` lets the backend reserve KV memory for the whole request.
        """
        ...

    def step(self, batch: Sequence[tuple[object, int]]) -> list[torch.Tensor]:
        """Feed one speech token to each listed sequence (all advanced together); return each one's logp."""
        ...

    def release(self, handle: object) -> None:
        """Free the sequence's KV memory at once. Idempotent."""
        ...
