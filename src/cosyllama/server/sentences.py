"""Text as it is written (an LLM's answer, piece by piece), cut into the sentences to speak:
:class:`SentenceStream`, used by every streamed session (:mod:`cosyllama.server.session`)."""

from __future__ import annotations

from ..limits import RequestLimits
from ..text.normalize import is_only_punctuation, take_sentence_slices


class SentenceStream:
    """The text of one streamed session, piece by piece, cut into the sentences to speak as soon as
    each is complete (:func:`~cosyllama.text.normalize.take_sentences`); ``whole=True`` keeps all
    of it for :meth:`finish` instead (one request for the whole text).

    Bounded by ``limits`` (a :class:`~cosyllama.limits.RequestLimits`): a piece, a sentence and the
    text waiting for its sentence's end are each at most ``input_chars`` characters (a sentence
    that never ends is refused, it does not grow), and the session at most ``session_chars`` in
    all, each piece counting at least one (so empty pieces cannot go on for ever). A refusal is a
    :class:`~cosyllama.limits.LimitExceeded`. Sentences made only of punctuation are dropped.
    """

    def __init__(self, limits: RequestLimits, whole: bool = False):
        self.limits, self.whole = limits, whole
        self.pending = ""  # text not yet a complete sentence
        self.received = 0  # characters taken, at least one per piece
        self.n_sentences = 0  # sentences handed out
        self.leads: list[str] = []  # the whitespace before each sentence handed out by the last call
        self._gap = ""  # whitespace since the last sentence handed out (of slices that said nothing)

    def add(self, piece: str) -> list[str]:
        """Take one piece; the sentences it completes (:attr:`leads`: the whitespace before each)."""
        self.limits.check_chars("input", piece)
        self.received += max(1, len(piece))
        self.limits.check_session(self.received)
        if self.whole:
            self.pending += piece
            self.limits.check_chars("input", self.pending)
            self.leads = []
            return []
        slices, self.pending = take_sentence_slices(self.pending + piece, known=len(self.pending))
        self.limits.check_chars("input", self.pending)
        return self._keep(slices)

    def finish(self) -> list[str]:
        """No more text: the rest, as a last sentence (without end punctuation), if it says anything."""
        rest, self.pending = self.pending.rstrip(), ""
        out = self._keep([rest])
        self._gap = ""
        return out

    def _keep(self, slices: list[str]) -> list[str]:
        """The slices that say something, stripped; :attr:`leads` the whitespace before each (that of the
        slices before it that said nothing included, a sentence that is only punctuation among them)."""
        out, self.leads = [], []
        for raw in slices:
            s = raw.strip()
            if not s or is_only_punctuation(s):
                self._gap += raw if not s else ""
                continue
            self.limits.check_chars("input", s)
            out.append(s)
            self.leads.append(self._gap + raw[:len(raw) - len(raw.lstrip())])
            self._gap = ""
        self.n_sentences += len(out)
        return out


__all__ = ["SentenceStream"]
