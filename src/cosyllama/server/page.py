"""The web page ``cosyllama serve`` answers at ``/``: type a text, pick or register a voice, hear it
stream. Plain HTML, CSS and JavaScript shipped in the package (``cosyllama/web``), no build step;
the page calls the public API only (``/v1/voices``, ``/v1/audio/speech``, ``/dev/captioned_speech``
for captions), from the server's own origin, so it needs no ``--allow-origin``. With ``--api-key``
the page itself loads without the key (it holds no data) and asks for it. Needs the ``server`` extra."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

WEB_DIR = Path(__file__).parent / "web"
# path -> (file in WEB_DIR, media type)
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
}
PAGE_PATHS = frozenset(FILES)  # answered to GET without the API key
# the page loads only its own files and talks only to its own origin; no one may frame it
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "media-src 'self' blob:; img-src 'self' data:; form-action 'none'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_page(app: FastAPI) -> None:
    """Serve the page's files on ``app`` (left out of the OpenAPI schema)."""
    for path, (name, media_type) in FILES.items():
        app.add_api_route(path, _endpoint((WEB_DIR / name).read_bytes(), media_type), methods=["GET", "HEAD"],
                          include_in_schema=False)


def _endpoint(data: bytes, media_type: str):
    async def serve_file():
        return Response(data, media_type=media_type, headers=HEADERS)

    return serve_file
