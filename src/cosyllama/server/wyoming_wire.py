"""The Wyoming protocol's wire format, read within bounds (for :mod:`cosyllama.server.wyoming`).

The `wyoming` package's reader buffers whatever a header announces (``data_length``,
``payload_length``) and hands on whatever the data holds; :func:`read_event` checks the header
line, its lengths (:func:`event_caps`, per event type) and the fields of each event this server
answers before it reads or uses them, parses their JSON with its nesting bounded
(:func:`cosyllama.server.client_json.loads`), and answers anything else with :class:`ProtocolError`.
:func:`event_bytes` writes an event as the package does. Needs the ``wyoming`` extra.
"""

from __future__ import annotations

import asyncio
import json

from ..errors import MissingDependencyError
from ..limits import LimitExceeded
from ..voices import show_id
from . import client_json
from .errors import Refusal

try:
    from wyoming import __version__ as WYOMING_VERSION
    from wyoming.event import Event
    from wyoming.tts import SynthesizeVoice
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise MissingDependencyError("the Wyoming server needs its extra: pip install 'cosyllama[wyoming]'") from e

# What one event may take. A text event's data holds at most --max-input-chars characters of text,
# each at most 12 bytes as JSON (a character outside the BMP written as two \u escapes), beside its
# voice, format and context; every other event a TTS server answers is small.
TEXT_BYTES_PER_CHAR = 12
EVENT_SLACK_BYTES = 16 * 1024
SMALL_EVENT_BYTES = 16 * 1024
TEXT_EVENTS = ("synthesize", "synthesize-chunk")
EVENT_TYPES = ("describe", "synthesize", "synthesize-start", "synthesize-chunk", "synthesize-stop", "ping")


class RequestRefused(Refusal):
    """A request the server answers with an ``error`` event; ``code`` is its machine-readable reason."""

    def __init__(self, message: str, code: str):
        super().__init__(message, code)


class ProtocolError(RequestRefused):
    """An event this server cannot read: ``error`` ``protocol_error``, then the connection closes."""

    def __init__(self, message: str):
        super().__init__(message, "protocol_error")


def event_caps(limits) -> dict[str, int]:
    """The bytes (header line and data together) an event of each type this server answers may
    take, from the per-request limits (:class:`~cosyllama.limits.RequestLimits`)."""
    text = TEXT_BYTES_PER_CHAR * limits.input_chars + EVENT_SLACK_BYTES
    return {t: text if t in TEXT_EVENTS else SMALL_EVENT_BYTES for t in EVENT_TYPES}


async def read_event(reader: asyncio.StreamReader, first: bytes, caps: dict[str, int], timeout: float,
                     input_chars: int) -> Event | None:
    """The event whose first byte is ``first`` (already read) from ``reader`` (made with a limit of
    at least the largest cap): its header line and data at most ``caps[type]`` bytes, checked from
    the header before the data is read, no payload, all of it within ``timeout`` seconds
    (``asyncio.TimeoutError``). None when the client left in the middle. :class:`ProtocolError`,
    or :class:`LimitExceeded` naming ``--max-input-chars`` (``input_chars``) for a text event over
    its cap."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    line_cap = max(caps.values())
    try:
        if first == b"\n":
            raise ProtocolError("the event's header line is empty")
        try:
            line = first + await asyncio.wait_for(reader.readuntil(b"\n"), deadline - loop.time())
        except (asyncio.LimitOverrunError, ValueError):  # the reader's limit
            raise ProtocolError(f"the event's header line is longer than {line_cap} bytes") from None
        if len(line) > line_cap:
            raise ProtocolError(f"the event's header line is longer than {line_cap} bytes")
        header = _json_object(line, "header line")
        kind = header.get("type")
        if not isinstance(kind, str) or not kind:
            raise ProtocolError("the event's header has no type (a string)")
        if kind not in caps:
            raise ProtocolError(f"unknown event type {show_id(kind)}; this server answers {', '.join(EVENT_TYPES)}")
        inline = header.get("data")
        if inline is not None and not isinstance(inline, dict):
            raise ProtocolError(f"the {kind} event's data is {json_kind(inline)}, not an object")
        n_data, n_payload = _length(header, "data_length"), _length(header, "payload_length")
        if n_payload:
            raise ProtocolError(f"a {kind} event carries no payload (payload_length {n_payload})")
        if len(line) + n_data > caps[kind]:
            if kind in TEXT_EVENTS:
                raise LimitExceeded(f"the {kind} event is {len(line) + n_data} bytes, more than the {caps[kind]} "
                                    f"its text may take (--max-input-chars {input_chars})",
                                    field="input", limit=input_chars, flag="--max-input-chars")
            raise ProtocolError(f"the {kind} event is {len(line) + n_data} bytes, more than the {caps[kind]} "
                                "it may take")
        data = dict(inline or {})
        if n_data:
            raw = await asyncio.wait_for(reader.readexactly(n_data), deadline - loop.time())
            data.update(_json_object(raw, "data"))
    except asyncio.IncompleteReadError:
        return None
    return Event(type=kind, data=data)


def event_bytes(event: Event) -> bytes:
    """``event`` in the protocol's wire format: a JSON header line, then its data (JSON), then its payload."""
    header: dict = {"type": event.type, "version": WYOMING_VERSION}
    data = json.dumps(event.data, ensure_ascii=False).encode() if event.data else b""
    if data:
        header["data_length"] = len(data)
    if event.payload:
        header["payload_length"] = len(event.payload)
    return json.dumps(header, ensure_ascii=False).encode() + b"\n" + data + (event.payload or b"")


def json_kind(value) -> str:
    """What JSON calls ``value``'s kind, with an article: "a string", "an array", "null" ..."""
    kinds = {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "an array",
             dict: "an object", type(None): "null"}
    return kinds.get(type(value), "a value")


def _json_object(raw: bytes, what: str) -> dict:
    try:
        value = client_json.loads(raw)  # nested at most MAX_DEPTH levels: never a RecursionError
    except client_json.ClientJSONError as e:
        raise ProtocolError(f"the event's {what} {e}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"the event's {what} is {json_kind(value)}, not an object")
    return value


def _length(header: dict, key: str) -> int:
    n = header.get(key)
    if n is None:
        return 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ProtocolError(f"the event's {key} is {show_id(json.dumps(n))}, not a whole number >= 0")
    return n


def optional_str(data: dict, key: str, what: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise ProtocolError(f"{what}'s {key} is {json_kind(value)}, not a string")
    return value


def voice_field(data: dict, what: str) -> SynthesizeVoice | None:
    """The voice a synthesize / synthesize-start asks for (as the `wyoming` package reads it), checked."""
    voice = data.get("voice")
    if voice is None:
        return None
    if not isinstance(voice, dict):
        raise ProtocolError(f"{what}'s voice is {json_kind(voice)}, not an object")
    name = optional_str(voice, "name", f"{what}'s voice")
    speaker = optional_str(voice, "speaker", f"{what}'s voice")
    language = optional_str(voice, "language", f"{what}'s voice")
    if "name" in voice:
        return SynthesizeVoice(name=name, speaker=speaker)
    if "language" in voice:
        return SynthesizeVoice(language=language)
    return None


def text_field(data: dict, what: str) -> str:
    text = data.get("text")
    if not isinstance(text, str):
        raise ProtocolError(f"{what} needs a text (a string); got " +
                            ("none" if text is None else json_kind(text)))
    return text


__all__ = ["EVENT_TYPES", "ProtocolError", "RequestRefused", "event_bytes", "event_caps", "optional_str", "read_event",
           "text_field", "voice_field"]
