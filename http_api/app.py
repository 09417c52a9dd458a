"""The FastAPI app: routes, the Bearer token on all but health and the page (the API docs too),
body limits, an x-request-id on every response, OpenAI-shaped errors."""
from __future__ import annotations

import uuid
from pathlib import Path
from urllib.parse import quote

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from . import errors, speech, voices, websocket
from .backend import Backend, bearer, require_token
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


class RequestId:
    """Gives every HTTP request an id (`scope["state"]["request_id"]`, which the routes log and
    errors quote) and every response its `x-request-id` header, also those made before a route
    runs (validation, auth, 404, the body limit)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def add_docs(app: FastAPI, backend: Backend) -> None:
    """/openapi.json and the Swagger page /docs, behind the token like the API (header, or
    `?api_key=` for a browser, which the page passes on to its fetch of the schema)."""

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        backend.check_token(bearer(request))
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request):
        backend.check_token(bearer(request))
        key = request.query_params.get("api_key")
        return get_swagger_ui_html(openapi_url="/openapi.json" + (f"?api_key={quote(key)}" if key else ""),
                                   title="async_cosyvoice API")


def create_app(backend: Backend) -> FastAPI:
    app = FastAPI(title="async_cosyvoice", docs_url=None, redoc_url=None, openapi_url=None)
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

    if backend.config.server.http_docs:
        add_docs(app, backend)
    @app.get("/favicon.ico", include_in_schema=False)  # what browsers and bookmarks ask for
    async def favicon() -> FileResponse:
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    app.add_middleware(BodyLimit, limit=backend.config.limits.max_message_bytes)
    app.add_middleware(RequestId)  # outermost: the body limit's 413 gets an id too
    return app
