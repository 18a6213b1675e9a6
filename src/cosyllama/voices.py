"""Registered voices: prompt features computed once, reused by id, saved to and loaded from a file.

File format: ``torch.save`` of ``{"format": "cosyllama-voices", "version": 1, "voices": {id: {...}}}``
with tensors, strings and int lists only, so it loads with ``weights_only=True`` (no code runs).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import torch

from .errors import InputError
from .frontend import PromptFeatures

FORMAT = "cosyllama-voices"
VERSION = 1
_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_voice_id(voice_id: str) -> str:
    if not isinstance(voice_id, str) or not _ID_RE.match(voice_id):
        raise InputError(f"voice id {voice_id!r} is not allowed; use 1-64 letters, digits, '_', '-' or '.'")
    return voice_id


class VoiceStore:
    """A thread-safe id -> :class:`PromptFeatures` map."""

    def __init__(self):
        self._voices: dict[str, PromptFeatures] = {}
        self._lock = threading.Lock()

    def add(self, voice_id: str, voice: PromptFeatures) -> None:
        check_voice_id(voice_id)
        with self._lock:
            self._voices[voice_id] = voice

    def get(self, voice_id: str) -> PromptFeatures:
        with self._lock:
            voice = self._voices.get(voice_id)
            known = sorted(self._voices)
        if voice is None:
            raise InputError(f"unknown voice {voice_id!r}; registered voices: {', '.join(known) or 'none'}")
        return voice

    def remove(self, voice_id: str) -> None:
        with self._lock:
            if self._voices.pop(voice_id, None) is None:
                raise InputError(f"unknown voice {voice_id!r}")

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self._voices)

    def __contains__(self, voice_id: str) -> bool:
        with self._lock:
            return voice_id in self._voices

    def __len__(self) -> int:
        with self._lock:
            return len(self._voices)

    def save(self, path: str | Path) -> None:
        with self._lock:
            items = dict(self._voices)
        data = {"format": FORMAT, "version": VERSION, "voices": {
            vid: {"speech_tokens": v.speech_tokens, "speaker_embedding": v.speaker_embedding,
                  "prompt_feat": v.prompt_feat, "prompt_text": v.prompt_text,
                  "prompt_text_ids": list(v.prompt_text_ids), "token_rate": v.token_rate}
            for vid, v in items.items()}}
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(data, tmp)
        tmp.replace(path)  # never leave a half-written file behind

    def load(self, path: str | Path) -> list[str]:
        """Add the voices of a file written by :meth:`save`; returns their ids."""
        path = Path(path)
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise InputError(f"voice file {str(path)!r} does not exist") from None
        except Exception as e:
            raise InputError(f"{path}: not a voice file ({type(e).__name__}: {e})") from e
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InputError(f"{path}: not a cosyllama voice file")
        if data.get("version") != VERSION:
            raise InputError(f"{path}: voice file version {data.get('version')} is not supported (need {VERSION})")
        loaded = []
        for vid, d in data["voices"].items():
            try:
                voice = PromptFeatures(
                    speech_tokens=d["speech_tokens"].to(torch.int32), speaker_embedding=d["speaker_embedding"].float(),
                    prompt_feat=d["prompt_feat"].float(), prompt_text=d["prompt_text"],
                    prompt_text_ids=tuple(int(x) for x in d["prompt_text_ids"]),
                    **({"token_rate": int(d["token_rate"])} if "token_rate" in d else {}))
            except (KeyError, AttributeError, TypeError) as e:
                raise InputError(f"{path}: voice {vid!r} is incomplete ({e})") from e
            self.add(vid, voice)
            loaded.append(vid)
        return loaded
