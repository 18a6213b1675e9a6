"""Which registered voice a request's voice name speaks with: the one resolver of every door (``POST
/v1/audio/speech`` and its siblings, the WebSocket, Wyoming), :class:`VoiceNames`. No door's dependencies.

A name is looked up in this order: an alias (``--voice-alias NAME=ID``), a registered id, then, for a name that
stands in for the default voice (one of OpenAI's built-in names over HTTP; ``default``, or no name at all, on
Wyoming), the default voice: ``--default-voice``, else, on Wyoming, the first registered voice in alphabetical
order. A name that finds no voice, or whose voice cannot be read, is one error whatever the door,
:class:`~cosyllama.voices.UnknownVoiceError`: its message names the voice asked for, a few registered ones and
where a client finds them all, never a file or a library (the log has why a voice could not be read); each door
answers it as its not-found (HTTP 404 ``voice_not_found``, an ``error`` message or event ``voice_not_found``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import InputError
from ..voices import UnknownVoiceError, check_voice_id, describe_ids, show_id, unknown_voice

log = logging.getLogger("cosyllama.voices")  # the voices' one log

# the built-in voice names of OpenAI's speech API (its reference for POST /v1/audio/speech); some clients
# (pipecat's OpenAITTSService) send nothing else
OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")
DEFAULT_VOICE = "default"  # Wyoming's name for the server's default voice (describe lists it)


@dataclass(frozen=True)
class VoiceNames:
    """How a door's voice names find registered voices (the module docstring): ``aliases`` (``--voice-alias``)
    first, then the registered id itself, then, for a name in ``stand_ins`` (or no name), the default voice:
    ``default`` (``--default-voice``), else the first registered voice when ``first_is_default``. The rest is
    how the door's messages say it: ``listed`` (names listed before the registered ids), ``listed_by`` (where a
    client finds every id), ``add`` (how to add one). The default is HTTP's; :meth:`wyoming` is Wyoming's."""

    aliases: Mapping[str, str] = field(default_factory=dict)
    default: str | None = None
    stand_ins: frozenset[str] = frozenset(OPENAI_VOICES)
    first_is_default: bool = False
    listed: tuple[str, ...] = ()
    listed_by: str = " (GET /v1/voices lists them)"
    add: str = "; add one with POST /v1/voices"

    def __post_init__(self):
        for name, target in self.aliases.items():
            check_voice_id(name)
            check_voice_id(target)
        if self.default is not None:
            check_voice_id(self.default)

    @classmethod
    def wyoming(cls, default: str | None) -> VoiceNames:
        """Wyoming's: no aliases; ``default`` (or no voice) speaks with ``default``, else the first registered voice."""
        return cls(default=default, stand_ins=frozenset({DEFAULT_VOICE}), first_is_default=True,
                   listed=(DEFAULT_VOICE,), listed_by=" (describe lists them)", add="")

    def resolve(self, voices, name: str | None):
        """The id and features (a :class:`~cosyllama.frontend.PromptFeatures`) of the registered voice that
        ``name`` speaks with (None: the default voice), from the store ``voices``; it may read files: call it
        off the event loop. :class:`~cosyllama.voices.UnknownVoiceError` when there is none, or when it cannot
        be read (removed meanwhile, its file gone bad: the log says why, the client learns no path)."""
        voice_id = self.voice_id(voices, name)
        try:
            return voice_id, voices.get(voice_id)
        except Exception as e:
            if not isinstance(e, UnknownVoiceError):
                log.warning("voice %s cannot be read: %s", voice_id, e)
            raise self._unknown(voice_id, voices) from None

    def voice_id(self, voices, name: str | None) -> str:
        """The id of the registered voice that ``name`` speaks with (see :meth:`resolve`)."""
        if name is not None and name in self.aliases:
            target, how = self.aliases[name], f"--voice-alias {name}={self.aliases[name]}"
        elif name is not None and name in voices:
            return name
        elif name is None or name in self.stand_ins:
            target, how = self._default(voices, name)
        else:
            raise self._unknown(name, voices)
        if target not in voices:
            said = (f"the default voice {target!r} ({how}) is not registered" if name is None else
                    f"voice {show_id(name)} speaks with {target!r} ({how}), which is not registered")
            raise UnknownVoiceError(f"{said}; registered voices: {self._ids(voices)}{self.add}")
        return target

    def _default(self, voices, name: str | None) -> tuple[str, str]:
        """The default voice, and which flag made it so."""
        if self.default is not None:
            return self.default, f"--default-voice {self.default}"
        if self.first_is_default:
            ids = sorted(voices.ids())
            if ids:
                return ids[0], "the first registered voice"
            raise UnknownVoiceError("no voice is registered; register one through the HTTP API (POST /v1/voices) "
                                    "or start with --voices DIR holding one")
        whose = " (one of OpenAI's names)" if name in OPENAI_VOICES else ""
        raise UnknownVoiceError(
            f"voice {show_id(name)}{whose} is not registered here and the server has no default voice; register a "
            f"voice with id {name!r} (POST /v1/voices), or start the server with --default-voice ID or "
            f"--voice-alias {name}=ID; registered voices: {self._ids(voices)}")

    def _ids(self, voices) -> str:
        return describe_ids(sorted(voices.ids()), more=self.listed_by)

    def _unknown(self, name, voices) -> UnknownVoiceError:
        return UnknownVoiceError(unknown_voice(name, [*self.listed, *sorted(voices.ids())], more=self.listed_by)
                                 + self.add)


def parse_voice_aliases(values) -> dict[str, str]:
    """``--voice-alias NAME=ID`` values as a table (each checked; a NAME given twice is an error)."""
    out: dict[str, str] = {}
    for value in values or ():
        name, sep, target = value.partition("=")
        name, target = name.strip(), target.strip()
        if not sep or not name or not target:
            raise InputError(f"--voice-alias {value!r} is not NAME=ID, e.g. alloy=anna")
        if name in out:
            raise InputError(f"--voice-alias gives {name!r} twice ({out[name]!r} and {target!r})")
        out[name] = target
    return out


__all__ = ["DEFAULT_VOICE", "OPENAI_VOICES", "VoiceNames", "parse_voice_aliases"]
