"""``POST /dev/captioned_speech``: speech with its word times, in Kokoro-FastAPI's shapes, so its clients work
unchanged. Needs the ``server`` extra; word times need the ``align`` extra (docs/captions.md).

The request is that of ``POST /v1/audio/speech`` (:class:`~cosyllama.server.openai_speech.SpeechRequest`, checked the
same way, with the same bounds) with Kokoro's fields:

* ``stream`` (default true, as Kokoro's): the answer is one JSON object per line (``application/x-ndjson``), an
  ``{"audio", "audio_format", "timestamps": []}`` line per piece of encoded audio as it is made (``audio``
  base64), and after each segment's last audio a line with ``audio`` empty, that segment's words in
  ``timestamps`` and the segment itself in ``segment`` (docs/captions.md's JSON: its times, or why it has no
  words). Alignment runs after the segment's audio has been sent: it never delays audio.
* ``stream`` false: one JSON object, ``{"audio", "audio_format", "timestamps", "segments", "srt", "vtt"}``: the
  whole file in base64, every word, every segment, and the captions as SRT and WebVTT text.
* ``return_timestamps`` (default true): false makes no word times (``timestamps`` null; segments still
  carry their exact times, which cost nothing).
* ``lang_code``: the aligner's language (Kokoro's one-letter codes are mapped: ``a``/``b`` English, ``e``
  Spanish, ``f`` French, ``h`` Hindi, ``i`` Italian, ``j`` Japanese, ``p`` Portuguese, ``z`` Chinese); omitted:
  from the text's script.
* ``normalization_options`` is accepted and not used (cosyllama normalizes text as the reference does);
  ``volume_multiplier`` other than 1 and ``return_download_link`` true are refused (422), not ignored.

Word times are seconds from the start of the whole output (``start_time``, ``end_time``).
"""

from __future__ import annotations

import base64
import json
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from ..alignment import LANGUAGE_CODE
from ..captions import Segment, to_srt, to_vtt
from ..llm.scheduler import RequestCancelled
from ..openmp import gives_team_back
from .common import state_of
from .errors import Refusal, api_error
from .job import SpeechJob
from .openai_speech import SpeechRequest, check_request
from .speech import log, run_job
from .wire import MEDIA_TYPES, AudioStream

PATH = "/dev/captioned_speech"
NDJSON = "application/x-ndjson"
KOKORO_LANGUAGES = {"a": "en", "b": "en", "e": "es", "f": "fr", "h": "hi", "i": "it", "j": "ja", "p": "pt",
                    "z": "zh"}


class KokoroCaptionFields(BaseModel):
    """Kokoro-FastAPI's fields of a captioned request (the module docstring), beside a speech or dialogue body's."""

    stream: bool = Field(True, description="true (default): NDJSON lines as audio is made; false: one JSON object")
    return_timestamps: bool = Field(True, description="align each segment's words (the align extra)")
    return_download_link: bool = Field(False, description="Kokoro's; not supported here (only false)")
    lang_code: str | None = Field(None, max_length=16, description="the aligner's language: a code like en, or "
                                  "one of Kokoro's letters; omitted: from the text's script")
    volume_multiplier: float = Field(1.0, description="Kokoro's; only 1 here (the audio is the model's)")
    normalization_options: dict | None = Field(None, description="Kokoro's; accepted, not used")


class CaptionedSpeechRequest(KokoroCaptionFields, SpeechRequest):
    """Body of ``POST /dev/captioned_speech``: :class:`SpeechRequest`'s fields and Kokoro-FastAPI's."""


def _words(seg: Segment) -> list[dict]:
    return [{"word": w.word, "start_time": w.start, "end_time": w.end} for w in seg.words or ()]


def _line(payload: dict) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


class CaptionLines:
    """What makes a speech job's answer carry its segments' words (the module docstring's shapes); mixed into
    :class:`~cosyllama.server.job.SpeechJob` and its dialogue kind, after :meth:`start_captions`."""

    def start_captions(self, response_format: str) -> None:
        self.audio_format = MEDIA_TYPES[response_format]
        self._told = 0  # segments whose words line has gone out

    def _untold(self) -> list[Segment]:
        with self.lock:
            if self.syn is None or self._told >= len(self.syn.segments):
                return []
            self.syn.finish_words()  # the segment's audio went out with the previous line
            segs = self.syn.segments[self._told:]
            self._told += len(segs)
            return segs

    def next_line(self) -> bytes | None:
        """The next NDJSON line(s) of a streamed answer (maybe empty), or None after the last: the words of
        the segments whose audio has gone out, else the next piece of audio."""
        segs = self._untold()
        if not segs:
            piece = self.next_bytes()
            if piece is not None:
                return piece and _line({"audio": base64.b64encode(piece).decode("ascii"),
                                        "audio_format": self.audio_format, "timestamps": []})
            segs = self._untold()
            if not segs:
                return None
        return b"".join(_line({"audio": "", "audio_format": self.audio_format, "timestamps": _words(s),
                               "segment": s.as_dict()}) for s in segs)

    def whole_answer(self, with_words: bool) -> bytes:
        """The non-streamed answer: the whole file and every segment's words and captions, as one JSON object."""
        data = self.whole_file()
        with self.lock:
            self.syn.finish_words()
            segs = list(self.syn.segments)
        return json.dumps({"audio": base64.b64encode(data).decode("ascii"), "audio_format": self.audio_format,
                           "timestamps": [w for s in segs for w in _words(s)] if with_words else None,
                           "segments": [s.as_dict() for s in segs], "srt": to_srt(segs), "vtt": to_vtt(segs)},
                          ensure_ascii=False).encode()


class CaptionedJob(CaptionLines, SpeechJob):
    """A speech job whose answer carries its segments' words."""

    def __init__(self, tts, request, streaming: str | None, response_format: str):
        super().__init__(tts, request, streaming, response_format)
        self.start_captions(response_format)


async def _lines(job: CaptionLines, first: bytes | None):
    data = first
    try:
        while data is not None:
            if data:
                yield data
            data = await run_in_threadpool(gives_team_back(job.next_line))
    except RequestCancelled:
        return
    except Exception as e:  # the status line is gone: end the stream early and say why in the log
        log.error("stream ended early: %s", api_error(e).message)


def refuse_unsupported(body, path: str = PATH) -> None:
    """Refuse what a captioned request (``body``: :class:`KokoroCaptionFields` and a speech body) cannot do."""
    if body.stream_format is not None:
        raise Refusal(f"stream_format is not a field of {path}; use stream (true: NDJSON lines as audio is made)",
                      "unsupported_field", status=422, param="stream_format")
    if body.return_download_link:
        raise Refusal("return_download_link is not supported here: the answer carries the audio itself",
                      "unsupported_value", status=422, param="return_download_link")
    if body.lang_code is not None and not LANGUAGE_CODE.fullmatch(KOKORO_LANGUAGES.get(body.lang_code,
                                                                                     body.lang_code)):
        raise Refusal("lang_code must be a language code like en or pt-br, or one of Kokoro's letters "
                      f"({', '.join(KOKORO_LANGUAGES)})", "invalid_value", status=422, param="lang_code")
    if body.volume_multiplier != 1.0:
        raise Refusal("volume_multiplier must be 1 here (the audio is the model's, unscaled)", "unsupported_value",
                      status=422, param="volume_multiplier")


router = APIRouter()


def with_words(synthesis, body):
    """``synthesis`` (a checked request) aligning its words as ``body`` asks (``return_timestamps``, ``lang_code``)."""
    language = KOKORO_LANGUAGES.get(body.lang_code, body.lang_code) if body.lang_code else None
    return replace(synthesis, options=replace(synthesis.options, word_times=body.return_timestamps,
                                              word_language=language))


async def answer(request: Request, state, job: CaptionLines, streaming: str | None, body):
    """Run ``job`` and answer in the captioned shapes: NDJSON lines when it streams, else one JSON object."""
    def respond(first: bytes | None, cleanup) -> Response:
        if streaming:
            return AudioStream(_lines(job, first), cleanup, NDJSON, {"Cache-Control": "no-cache"})
        return Response(first, media_type="application/json")

    return await run_job(request, state, job, job.next_line if streaming else
                         (lambda: job.whole_answer(body.return_timestamps)), respond, streams=streaming is not None)


@router.post(PATH)
async def captioned_speech(body: CaptionedSpeechRequest, request: Request):
    refuse_unsupported(body)
    state = state_of(request.app)
    streaming, synthesis = await check_request(body, state)
    job = CaptionedJob(state.tts, with_words(synthesis, body), streaming, body.response_format)
    return await answer(request, state, job, streaming, body)


__all__ = ["PATH", "CaptionLines", "CaptionedSpeechRequest", "KokoroCaptionFields", "answer", "refuse_unsupported",
           "router", "with_words"]
