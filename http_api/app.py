"""The FastAPI app: routes, the Bearer token on all but health and the page (the API docs too),
body limits, an x-request-id on every response, OpenAI-shaped errors."""
from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from urllib.parse import quote

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from . import errors, speech, voices, websocket
from .backend import Backend, bearer, require_token
from .errors import TIMEOUT, TOO_LARGE, error_body

STATIC = Path(__file__).parent / "static"


DISCONNECT = {"type": "http.disconnect"}


class EarlyAnswer:
    """One request's `send`, shared by a body guard (BodyLimit, BodyDeadline) and the app behind
    it: the guard may answer in the app's place (`answer`) only while the app's own response has
    not started; once the guard has answered, the app's later sends are dropped (the guard's
    `receive` then tells the app the client is gone)."""

    def __init__(self, scope, receive, send):
        self._scope, self._receive, self._send = scope, receive, send
        self.app_started = False  # the app sent its http.response.start (its first send)
        self.answered = False     # the guard answered instead

    async def app_send(self, message) -> None:
        if self.answered:
            return  # the guard's answer went out instead
        self.app_started = True
        await self._send(message)

    async def answer(self, response: Response) -> bool:
        """Send `response` unless the app's own has started; whether it was sent."""
        if self.app_started:
            return False
        self.answered = True
        await response(self._scope, self._receive, self._send)
        return True


class BodyLimit:
    """413 for request bodies over `limit` bytes, declared (content-length) or counted as they stream
    in; in the second case the 413 goes out at once and the app sees the client as gone. A body
    that grows past the limit after the app has answered is the app's (it is answered already)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        early = EarlyAnswer(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await early.answer(self._too_large())
            return
        seen = 0

        async def limited_receive():
            nonlocal seen
            if early.answered:
                return DISCONNECT
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit and await early.answer(self._too_large()):
                return DISCONNECT
            return message

        await self.app(scope, limited_receive, early.app_send)

    def _too_large(self) -> JSONResponse:
        message = f"request body over {self.limit} bytes (limits.max_message_bytes)"
        return JSONResponse(error_body(TOO_LARGE, message), status_code=413)


class BodyDeadline:
    """408 when a request body has not arrived in full within `seconds` of the request's start
    (a body shorter than its Content-Length held the request forever); the connection is closed.
    Once the body is complete, or the app has started its response, `receive` is not timed."""

    def __init__(self, app, seconds: float):
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        early = EarlyAnswer(scope, receive, send)
        body_done = False

        async def timed_receive():
            nonlocal body_done
            if early.answered:
                return DISCONNECT
            # Once the app has answered, the deadline has nothing left to answer, and under
            # uvicorn (ASGI 2.3) `receive` is then how Starlette's streaming and file responses
            # wait for the client to leave: a timeout here would end a good response midway. So the
            # app's response runs its course; uvicorn ends a connection whose request body never
            # completed after that response (connection.py's head deadline). No route reads its
            # body after answering (FastAPI reads it before the route runs).
            if body_done or early.app_started:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                if await early.answer(self._timeout()):
                    return DISCONNECT
                return await receive()  # the app answered while this receive waited: as above
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, early.app_send)

    def _timeout(self) -> JSONResponse:
        message = (f"the request body did not arrive in full within {self.seconds:g} s "
                   "(limits.body_read_seconds)")
        return JSONResponse(error_body(TIMEOUT, message), status_code=TIMEOUT.http, headers={"connection": "close"})


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
    app.add_middleware(BodyDeadline, seconds=backend.config.limits.body_read_seconds)
    app.add_middleware(RequestId)  # outermost: the body limit's 413 gets an id too
    return app
