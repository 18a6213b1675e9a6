"""JSON a client sends on a connection the server reads itself (a WebSocket message, a Wyoming
event's header line and data), parsed within bounds, and a client's strings as a message echoes them.

Python's parser recurses once per nested array or object: a few KB of ``[[[[…`` raise
``RecursionError`` deep inside it (a traceback, not a client's mistake). :func:`loads` refuses,
before parsing, text over ``max_bytes`` bytes or nested more than ``max_depth`` levels
(:data:`MAX_DEPTH`; counted by a linear scan that skips strings), with :class:`ClientJSONError`,
a ``ValueError`` whose text is one line saying why, to follow the name of what was parsed
("the message is nested ..."). No message this server takes nests more than 3 levels.

:func:`clip` and :func:`clip_names` bound what an error message echoes of a client's strings
(a field name, a message type): at most :data:`~cosyllama.voices.SHOWN_ID_CHARS` characters each,
at most :data:`~cosyllama.voices.NAMED_IDS` names, so that a message never grows with the request.
"""

from __future__ import annotations

import json
import re

from ..voices import NAMED_IDS, SHOWN_ID_CHARS

MAX_DEPTH = 32  # arrays and objects inside each other a client's JSON may hold

# a JSON string (also one cut short at the end of the text), or a bracket outside strings
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]', re.DOTALL)


_LONE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # a surrogate escape; whether it is paired is checked after


class ClientJSONError(ValueError):
    """A client's JSON that :func:`loads` does not parse; its text says why, in one line, to follow
    the name of what was parsed (``is not JSON``, ``is nested more than 32 levels deep`` ...)."""


def nesting_depth(text: str, limit: int | None = None) -> int:
    """The deepest nesting of arrays and objects in ``text`` (JSON; brackets inside strings do not
    count); stops counting once it passes ``limit``. Linear in ``len(text)``, no recursion."""
    depth = deepest = 0
    for m in _TOKEN.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if limit is not None and deepest > limit:
                    break
        elif c in "]}":
            depth = max(0, depth - 1)
    return deepest


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH, max_bytes: int | None = None):
    """``json.loads(text)`` for text a client sent, or :class:`ClientJSONError` when it is larger
    than ``max_bytes`` bytes (UTF-8), nested more than ``max_depth`` levels deep, not UTF-8 (bytes)
    or not JSON."""
    if isinstance(text, (bytes, bytearray)):
        if max_bytes is not None and len(text) > max_bytes:
            raise ClientJSONError(f"is larger than {max_bytes} bytes")
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            raise ClientJSONError("is not UTF-8") from None
    elif max_bytes is not None and (len(text) > max_bytes or
                                    (4 * len(text) > max_bytes and len(text.encode("utf-8", "surrogatepass")) >
                                     max_bytes)):
        raise ClientJSONError(f"is larger than {max_bytes} bytes")
    if nesting_depth(text, max_depth) > max_depth:
        raise ClientJSONError(f"is nested more than {max_depth} levels deep (arrays and objects inside each other)")
    try:
        value = json.loads(text)
    except RecursionError:  # not reached within MAX_DEPTH; a small stack, say
        raise ClientJSONError(f"is nested too deep to read (at most {max_depth} levels)") from None
    except ValueError:
        raise ClientJSONError("is not JSON") from None
    if _LONE_SURROGATE.search(text):
        try:  # JSON's \uXXXX escapes may name half of a surrogate pair, which is no character: no text
            json.dumps(value, ensure_ascii=False).encode("utf-8")  # can hold it, and every encoder refuses it
        except UnicodeEncodeError:
            raise ClientJSONError("holds a \\uD800-\\uDFFF escape that is half a character (not text)") from None
    return value


def clip(s, n: int = SHOWN_ID_CHARS) -> str:
    """A client's string as a message echoes it: ``repr`` of at most ``n`` characters of it, then
    ``...`` and its length when it was longer; a value that is no string is named by its type."""
    if not isinstance(s, str):
        return f"(a {type(s).__name__})"
    if len(s) <= n:
        return repr(s)
    return f"{s[:n]!r}... ({len(s)} characters)"


def clip_names(names, n: int = NAMED_IDS) -> str:
    """A client's names (e.g. fields the server does not take) for a message: the first ``n``, each
    clipped (:func:`clip`), then how many more."""
    names = list(names)
    head = ", ".join(clip(x) for x in names[:n])
    return head if len(names) <= n else f"{head} and {len(names) - n} more"


def clip_param(s, n: int = SHOWN_ID_CHARS) -> str | None:
    """A client's field name as an error's ``param``: unquoted, at most ``n`` characters (then ``...``)."""
    if s is None:
        return None
    s = str(s)
    return s if len(s) <= n else s[:n] + "..."


__all__ = ["MAX_DEPTH", "ClientJSONError", "clip", "clip_names", "clip_param", "loads", "nesting_depth"]
