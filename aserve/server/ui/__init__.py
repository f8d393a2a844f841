"""The playground at `/`: a static page (index.html, app.js, style.css beside this file) that talks to the
server's own OpenAI routes and /metrics from the browser.

The files are read once, when the app is built, and served from memory: three small files need no static-file
machinery, and a missing file fails at start-up rather than on the first visit. Every URL the page uses is
relative to the page, so it works unchanged under --root-path. The page carries no API key: the browser sends
the one the user types (see app.js), so these routes are open (app.OPEN_PATHS) and the API routes stay guarded.
"""
from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

HERE = Path(__file__).parent
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/ui/style.css": ("style.css", "text/css; charset=utf-8")}
PATHS = tuple(FILES)

# Only our own files and our own origin: a page that holds an API key runs nothing it did not ship.
HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                                      "base-uri 'self'; frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def routes() -> list[Route]:
    """GET routes for the page and its two assets."""
    def serve(body: bytes, media_type: str):
        async def endpoint(request: Request) -> Response:
            return Response(body, media_type=media_type, headers=HEADERS)
        return endpoint

    return [Route(path, serve((HERE / name).read_bytes(), media_type), methods=["GET"])
            for path, (name, media_type) in FILES.items()]
