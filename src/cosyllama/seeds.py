"""The seed rule: the one way a request's seed gives each of its parts a seed of its own.

A request's text segment ``i`` (:mod:`cosyllama.tts`), sentence ``k`` of a streamed utterance
(:mod:`cosyllama.server.session`), turn ``k`` of a dialogue (:mod:`cosyllama.dialogue`, offset ``1000·k``)
and attempt ``a`` of a caught take (:mod:`cosyllama.llm.takes`, offset ``a·2**20``) are each seeded with
:func:`offset_seed`: the seed plus the part's offset, wrapped into :data:`SEED_RANGE`. So a text streamed
sentence by sentence gets the seeds it gets sent whole and split the same way, at the top of the range too
(seed ``2**31 - 1``: the second part is seeded 0 either way).
"""

from __future__ import annotations

SEED_RANGE = (0, 2**31 - 1)  # seeds every door takes (OpenAI-style JSON integers, torch's generator)


def offset_seed(seed: int | None, offset: int) -> int | None:
    """``seed + offset``, wrapped into :data:`SEED_RANGE`; None (fresh entropy for every part) stays None."""
    if seed is None:
        return None
    lo, hi = SEED_RANGE
    return lo + (seed - lo + offset) % (hi - lo + 1)


__all__ = ["SEED_RANGE", "offset_seed"]
