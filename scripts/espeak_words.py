"""Speech nobody here wrote, with each word's onset: Debian's libespeak-ng speaks a sentence and reports its
word events through its synthesis callback (``espeakEVENT_WORD``: the word's character position in the text and
the sample where its sound starts). ``scripts/measure_alignment.py`` and tests/test_align.py hold word times
from :mod:`cosyllama.alignment` to these onsets.

libespeak-ng has no kept Python binding that exposes the callback (the PyPI wrappers run the command line), so
this is ctypes over the C API of ``speak_lib.h``. An unstressed word that espeak-ng runs into the next one gets
no event of its own; such words have ``onset`` None and are not measured.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
from dataclasses import dataclass

import numpy as np

_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_EVENT_LIST_TERMINATED = 0
_EVENT_WORD = 1


class _Event(ctypes.Structure):
    # espeak_EVENT (speak_lib.h): the union id is 8 bytes (a char[8], an int or a pointer)
    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
                ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", ctypes.c_char * 8)]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


@dataclass(frozen=True)
class SpokenWord:
    word: str
    onset: float | None  # seconds; None where espeak-ng gave the word no event of its own


class Espeak:
    """libespeak-ng, initialized once per process (the library keeps global state, and initializing it again
    changes what it speaks); ``voice`` and ``rate`` are set again for every sentence."""

    _lib = None
    sample_rate = 0

    def __init__(self, voice: str = "en-us", rate: int = 160):
        self.voice, self.rate = voice, rate
        if Espeak._lib is None:
            name = ctypes.util.find_library("espeak-ng")
            if not name:
                raise OSError("libespeak-ng not found (apt-get install libespeak-ng1 espeak-ng-data)")
            lib = ctypes.CDLL(name)
            Espeak.sample_rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 200, None, 0)
            if Espeak.sample_rate <= 0:
                raise OSError("espeak_Initialize failed")
            Espeak._lib = lib
            Espeak._cb = _CALLBACK(Espeak._collect)  # held: the library calls it for the process's life
            lib.espeak_SetSynthCallback(Espeak._cb)
        self._lib = Espeak._lib

    _pieces: list = []
    _events: list = []

    @staticmethod
    def _collect(wav, n, events) -> int:
        if n > 0:
            Espeak._pieces.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        i = 0
        while events[i].type != _EVENT_LIST_TERMINATED:
            if events[i].type == _EVENT_WORD:
                Espeak._events.append((events[i].text_position, events[i].sample))
            i += 1
        return 0

    def speak(self, text: str) -> tuple[np.ndarray, int, list[SpokenWord]]:
        """``text`` spoken: float32 samples, the sample rate, and each whitespace-separated word of ``text`` with
        its onset in seconds."""
        if self._lib.espeak_SetVoiceByName(self.voice.encode()) != 0:
            raise ValueError(f"espeak-ng has no voice {self.voice!r}")
        self._lib.espeak_SetParameter(1, self.rate, 0)  # espeakRATE, words per minute
        Espeak._pieces, Espeak._events = [], []
        data = text.encode("utf-8")
        buf = ctypes.create_string_buffer(data)
        if self._lib.espeak_Synth(buf, len(data) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None) != 0:
            raise RuntimeError("espeak_Synth failed")
        self._lib.espeak_Synchronize()
        pieces = Espeak._pieces
        audio = (np.concatenate(pieces) if pieces else np.zeros(0, np.int16)).astype(np.float32) / 32768
        # text_position counts characters from 1; map each word's first character to its onset
        onset_at = {}
        for pos, sample in Espeak._events:
            onset_at.setdefault(pos - 1, sample / self.sample_rate)
        words = [SpokenWord(m.group(), onset_at.get(m.start())) for m in re.finditer(r"\S+", text)]
        return audio, self.sample_rate, words
