"""The FastAPI app: routes, the Bearer token on all but health and the page, body limits, OpenAI-shaped errors."""
from __future__ import annotations

from pathlib import Path

from fastapi import Depends, FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from . import errors, speech, voices, websocket
from .backend import Backend, require_token
from .errors import TOO_LARGE, error_body

STATIC = Path(__file__).parent / "static"


class BodyLimit:
    """413 for request bodies over `limit` bytes, declared (content-length) or counted as they stream
    in; in the second case the 413 goes out at once and the app sees the client as gone."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(scope, receive, send)
        seen = 0
        rejected = started = False

        async def limited_receive():
            nonlocal seen, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit and not started:
                rejected = True
                await self._reject(scope, receive, send)
                return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if rejected:
                return  # the 413 went out already
            started = True
            await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _reject(self, scope, receive, send) -> None:
        message = f"request body over {self.limit} bytes (limits.max_message_bytes)"
        await JSONResponse(error_body(TOO_LARGE, message), status_code=413)(scope, receive, send)


def create_app(backend: Backend) -> FastAPI:
    app = FastAPI(title="async_cosyvoice", docs_url="/docs", redoc_url=None)
    app.state.backend = backend
    errors.install(app)
    protected = [Depends(require_token)]
    app.include_router(speech.router, dependencies=protected)
    app.include_router(voices.router, dependencies=protected)
    app.include_router(voices.health)
    app.include_router(websocket.router)  # checks the token itself (browsers cannot set headers)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/favicon.ico", include_in_schema=False)  # what browsers and bookmarks ask for
    async def favicon() -> FileResponse:
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    app.add_middleware(BodyLimit, limit=backend.config.limits.max_message_bytes)
    return app
