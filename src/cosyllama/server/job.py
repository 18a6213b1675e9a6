"""One synthesis as a server runs it: :class:`SynthesisJob`, advanced chunk by chunk from a thread
pool while the event loop stays free (``POST /v1/audio/speech``, ``/v1/audio/speech/stream`` and
Wyoming share it), and :class:`SpeechJob`, one whose audio is encoded as an OpenAI speech request asks
(HTTP and the WebSocket)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace

import numpy as np

from ..audio_out import StreamEncoder, encode
from ..engine import AudioChunk
from ..llm.decode import CancelToken
from ..memory import trim_heap
from ..request import SynthesisRequest

log = logging.getLogger("cosyllama.server")


class SynthesisJob:
    """The synthesis of ``request`` on ``tts`` (the server's pipeline), opened, advanced and closed
    from worker threads.

    ``lock`` keeps :meth:`close` from running while a chunk is being made in another thread;
    ``token`` (a :class:`~cosyllama.llm.decode.CancelToken` passed to ``tts.run``) lets the event
    loop free the LLM sequence at once, without waiting for that chunk."""

    def __init__(self, tts, request: SynthesisRequest):
        self.tts, self.request = tts, request
        self.token = CancelToken()
        self.lock = threading.Lock()
        self.syn = None  # the Synthesis, once opened
        self._takes_logged = 0  # caught takes already in the log

    def open(self) -> None:
        """Start the synthesis (the frontend runs here; the LLM at the first chunk)."""
        with self.lock:
            self.syn = self.tts.run(self.request, cancel=self.token)
            self._opened()

    def _opened(self) -> None:
        """Called under the lock once the synthesis exists (a subclass adds what it sends with)."""

    def next_chunk(self) -> AudioChunk | None:
        """The next chunk, or None at the end; call with :attr:`lock` held. Each caught take (docs/retries.md)
        goes to the server log as its segment ends."""
        chunk = next(self.syn, None) if self.syn is not None else None
        if self.syn is not None:
            caught = self.syn.timings.retries
            for r in caught[self._takes_logged:]:
                log.warning("bad take: %s", r.describe())
            self._takes_logged = len(caught)
        return chunk

    def next(self) -> np.ndarray | None:
        """The next chunk's float32 samples, or None at the end."""
        with self.lock:
            chunk = self.next_chunk()
        return None if chunk is None else chunk.samples

    def output(self):
        """What a streamed session sends next (:mod:`cosyllama.server.session`): here the next chunk's
        float32 samples, or None at the end."""
        return self.next()

    def close(self) -> None:
        """Stop the synthesis; its LLM sequence is free when this returns. Gives the heap's free
        pages back to the OS (see :mod:`cosyllama.memory`)."""
        self.token.cancel()
        with self.lock:
            if self.syn is not None:
                self.syn.close()
            self._closed()
        trim_heap()

    def _closed(self) -> None:
        """Called under the lock when the job closes (a subclass ends what it sends with)."""


class SpeechJob(SynthesisJob):
    """One speech request's synthesis (:class:`~cosyllama.server.job.SynthesisJob`); a streamed job
    also owns the encoder of its response body. Its synthesis streams unless the request's speed or
    format needs the finished audio (then its segments are encoded as they come)."""

    def __init__(self, tts, request: SynthesisRequest, streaming: str | None, response_format: str):
        super().__init__(tts, request)
        self.streaming, self.response_format = streaming, response_format
        self.encoder = None
        self._whole_sent = False

    def _opened(self) -> None:
        if self.streaming:
            self.encoder = StreamEncoder(self.response_format, self.tts.sample_rate)

    def next_bytes(self) -> bytes | None:
        """Streamed: the next piece of the encoded body (maybe empty), or None after the last."""
        with self.lock:
            if self.encoder is None:
                return None
            chunk = self.next_chunk()
            if chunk is not None:
                return self.encoder.write(chunk.samples)
            tail = self.encoder.close()
            self.encoder = None
            return tail

    def output(self) -> bytes | None:
        """What a streamed session sends next (:mod:`cosyllama.server.session`): a streamed job's next
        piece of the encoded stream (maybe empty), else the whole file at once; None after the last."""
        if self.streaming:
            return self.next_bytes()
        if self._whole_sent:
            return None
        self._whole_sent = True
        return self.whole_file()

    def whole_file(self) -> bytes:
        """The rest of the synthesis, encoded as one file (a request without a stream)."""
        parts = []
        while (samples := self.next()) is not None:
            parts.append(samples)
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return encode(audio, self.tts.sample_rate, self.response_format)

    def usage(self) -> dict:
        """Token counts, as OpenAI reports them: ``input_tokens`` counts the text tokens of
        ``input`` and ``instructions`` as given (before normalization), ``output_tokens`` the
        speech tokens the LLM made (after the silent-token filter)."""
        r, tokenize = self.request, self.tts.frontend.tokenize
        n_in = len(tokenize(r.text)) + (len(tokenize(r.instruction)) if r.instruction else 0)
        n_out = sum(len(t) for t in self.syn.timings.tokens)
        return {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}

    def retries(self) -> list[dict]:
        """The takes caught so far (docs/retries.md), as :meth:`~cosyllama.llm.takes.BadTake.as_dict`."""
        return [r.as_dict() for r in self.syn.timings.retries] if self.syn is not None else []

    def _closed(self) -> None:
        if self.encoder is not None:
            self.encoder.close()
            self.encoder = None




@dataclass(frozen=True)
class SpeechFormat:
    """How a streamed session's utterance answers (the WebSocket's :attr:`Template.door
    <cosyllama.server.session.Template.door>`): the audio format, how it streams, whether each sentence's words
    are aligned; :meth:`job` makes a sentence's synthesis."""

    response_format: str
    streaming: str | None
    word_timestamps: bool = False

    def job(self, tts, request: SynthesisRequest) -> SpeechJob:
        if self.word_timestamps:
            request = replace(request, options=replace(request.options, word_times=True))
        return SpeechJob(tts, request, self.streaming, self.response_format)


__all__ = ["SpeechFormat", "SpeechJob", "SynthesisJob"]
