"""Backend-independent token choice: upstream's repetition-aware sampling (RAS) and greedy.

RAS (see docs/reference.md#ras-sampling): softmax -> stable descending sort -> keep candidates while (cum < top_p and
count < top_k), so the candidate that crosses top_p is kept -> draw one from the kept (unnormalised)
probabilities. If the drawn id occurs at least ``win_size * tau_r`` times in the last ``win_size``
emitted tokens, ban it and draw from the FULL distribution instead.

All draws use a per-request :class:`torch.Generator`; the global RNG is never touched. Seeded with
``s``, a fresh generator reproduces upstream's ``torch.manual_seed(s); ras_sampling(...)`` draws on
the CPU exactly, because the same float32 values reach ``torch.multinomial`` in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..config import SamplingConfig


def nucleus_candidates(logp: torch.Tensor, top_p: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate set of nucleus sampling, in draw order.

    logp: (V,) log-probabilities (``-inf`` allowed). Returns ``(ids, probs)``, both (n,), with
    probs the softmax values (float32, not renormalised) sorted descending, ties in ascending id order.
    """
    probs = torch.softmax(logp.float(), dim=0)
    values, ids = torch.sort(probs, descending=True, stable=True)
    head = values[:top_k].cpu().numpy()
    # The reference accumulates in float32 one candidate at a time; cumsum could round differently
    # right at the top_p boundary, so the inclusion test is replayed exactly.
    limit = np.float32(top_p)
    cum = np.float32(0.0)
    n = 0
    while n < len(head) and cum < limit and n < top_k:
        cum = np.float32(cum + head[n])
        n += 1
    return ids[:n], values[:n]


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, replacement=True, generator=generator).item())


def ras_sample(logp: torch.Tensor, history: Sequence[int], sampling: SamplingConfig,
               generator: torch.Generator) -> int:
    """One RAS draw. logp: (V,) float32 CPU; history: tokens emitted so far (unfiltered)."""
    ids, probs = nucleus_candidates(logp, sampling.top_p, sampling.top_k)
    tok = int(ids[_draw(probs, generator)].item())
    window = history[-sampling.win_size:] if sampling.win_size > 0 else []
    repeats = sum(1 for t in window if t == tok)
    if repeats >= sampling.win_size * sampling.tau_r:
        banned = logp.float().clone()
        banned[tok] = float("-inf")
        tok = _draw(torch.softmax(banned, dim=0), generator)
    return tok


def greedy_sample(logp: torch.Tensor) -> int:
    """Argmax; the lowest id wins exact ties (torch.argmax returns the first maximum)."""
    return int(torch.argmax(logp).item())


class Sampler:
    """Per-request token chooser: RAS with its own generator, or greedy.

    ``seed=None`` seeds the generator non-deterministically (fresh entropy per request).
    """

    def __init__(self, sampling: SamplingConfig, *, greedy: bool = False, seed: int | None = None):
        self.sampling = sampling
        self.greedy = greedy
        self.generator = torch.Generator(device="cpu")
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(seed))

    def __call__(self, logp: torch.Tensor, history: Sequence[int]) -> int:
        if self.greedy:
            return greedy_sample(logp)
        return ras_sample(logp, history, self.sampling, self.generator)
