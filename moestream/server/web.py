"""The web page: `GET /` answers with a chat + live dashboard page, its script and style at /ui/<name>.

Every asset is package data (moestream/server/web/), served as is: no build step, nothing from another
host. The page itself is public (it holds no data); what it shows comes from the API routes, which
ask for the key when the server has one.
"""
from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

ASSETS = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8", "markdown.js": "text/javascript; charset=utf-8"}
# the page runs only its own files; model output is rendered as escaped text (markdown.js), and this
# policy is a second wall against any HTML that would slip through
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'")


def asset(name: str) -> bytes:
    return resources.files(__package__).joinpath("web", name).read_bytes()


def _response(name: str) -> Response:
    return Response(asset(name), media_type=ASSETS[name],
                    headers={"Cache-Control": "no-cache", "Content-Security-Policy": _CSP,
                             "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})


def add_routes(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def index():
        return _response("index.html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def ui_asset(name: str):
        if name not in ASSETS:
            raise StarletteHTTPException(404)
        return _response(name)
