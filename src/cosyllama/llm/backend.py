"""The small protocol every LLM backend implements (torch, llama.cpp).

A backend owns the weights and the KV memory; a *sequence* is one request's position in it. The
backend never samples: it returns the log-probabilities over the 6761 speech ids, and the shared
sampler (:mod:`cosyllama.llm.sampling`) picks the token. Decode steps of several sequences can be
advanced together in one call (:meth:`LLMBackend.step`), which is what the server batches.

Every backend runs its prompt in pieces too (``begin`` then ``prefill_step`` until it returns the
log-probs): the batching scheduler puts one piece between two decode steps of the other sequences,
so a long prompt neither stalls them nor runs on after its client has gone; ``start`` runs it whole
(a request decoding alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from ..config import LLMConfig
from ..errors import InputError


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


def check_max_seq_tokens(max_seq_tokens: int | None, cfg: LLMConfig) -> int:
    """The positions one sequence may use: ``max_seq_tokens`` (1 .. the model's context length),
    or that context length when None."""
    n_pos = cfg.qwen.max_position_embeddings
    if max_seq_tokens is None:
        return n_pos
    if not 1 <= max_seq_tokens <= n_pos:
        raise InputError(f"max_seq_tokens (--max-seq-tokens) must be 1..{n_pos} (the model's context length), "
                         f"got {max_seq_tokens}")
    return int(max_seq_tokens)


@runtime_checkable
class LLMBackend(Protocol):
    """What the decode loop, the scheduler, the servers and the CPU report need from a backend."""

    name: str  # "torch" | "llamacpp": the backend's family, as reports and the servers name it
    cfg: LLMConfig  # speech ids, sampling defaults; vocab_size (6761) = len(logp)
    # sequences held at once (a start beyond them raises BackendBusyError); None: no bound of its own (the
    # scheduler then decodes DEFAULT_MAX_ACTIVE together)
    n_seq_max: int | None
    # positions one sequence may use, prompt + new speech tokens (the unit of RequestLimits.seq_tokens); None: unknown
    max_seq_tokens: int | None
    n_threads: int | None  # CPU threads of its own (llama.cpp's); None: it shares PyTorch's

    def stats(self) -> dict | None:
        """Counters for the server's ``/health`` (``"llm"``), or None when the backend keeps none."""
        ...

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

    # The prefill in pieces: ``start`` equals ``begin`` + ``prefill_step`` until it returns the logp.

    def begin(self, prefill: Prefill, max_new_tokens: int) -> object:
        """Create a sequence and reserve its memory for ``len(prefill) + max_new_tokens`` positions;
        nothing is computed yet. Raises ``BackendBusyError`` when the memory is full and
        ``InputError`` when the sequence can never fit."""
        ...

    def prefill_step(self, handle: object, max_positions: int) -> torch.Tensor | None:
        """Run up to ``max_positions`` more prompt positions of the sequence; return the logp
        (vocab_size,) of its first token once the whole prompt is in, else None."""
        ...

