"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}` with a matching status.

Library errors get their status from the library's one table (`async_cosyvoice.errors.status_of`,
shared with gRPC); it also gives the WebSocket error codes.
"""
from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from async_cosyvoice.errors import ERROR_STATUSES, INTERNAL_STATUS, ErrorStatus, InvalidRequest, status_of

Status = ErrorStatus  # http, type (OpenAI's error "type"), code (also the WebSocket error code)
INTERNAL = INTERNAL_STATUS
INVALID = dict(ERROR_STATUSES)[InvalidRequest]
UNAUTHORIZED = Status("UNAUTHENTICATED", 401, "authentication_error", "invalid_api_key")
TOO_LARGE = Status("RESOURCE_EXHAUSTED", 413, "invalid_request_error", "request_too_large")


class ApiError(Exception):
    """An error raised by the HTTP layer itself (auth, body size, a bad field)."""

    def __init__(self, status: Status, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def status_for(error: BaseException) -> Status:
    """An HTTP-layer error's own status, else the library's one table (`status_of`)."""
    return error.status if isinstance(error, ApiError) else status_of(error)


def error_body(status: Status, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": status.type, "param": param, "code": status.code}}


def error_response(error: BaseException, request_id: str) -> JSONResponse:
    status = status_for(error)
    if status is INTERNAL:
        message = f"internal error (request id {request_id}); see the server log"
    else:
        message = error.message if isinstance(error, ApiError) else str(error)
    headers = None
    if status is UNAUTHORIZED:
        headers = {"WWW-Authenticate": "Bearer"}
    elif status.http in (429, 503):
        headers = {"Retry-After": "1"}  # both pass: a slot frees up, the model finishes loading
    return JSONResponse(error_body(status, message, getattr(error, "param", None)), status_code=status.http,
                        headers={**(headers or {}), "x-request-id": request_id})


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    problems, param = [], None
    for e in exc.errors():
        if e.get("type") == "json_invalid":  # loc is ("body", <character offset>): not a field
            where = e.get("loc", ())[-1]
            reason = (e.get("ctx") or {}).get("error", "invalid JSON")
            problems.append(f"the request body is not valid JSON ({reason} at character {where})")
            continue
        loc = [str(p) for p in e.get("loc", ()) if p not in ("body", "query", "path", "form")]
        if not loc:  # the body as a whole: not a JSON object (e.g. no Content-Type: application/json)
            problems.append(f"the request body must be a JSON object ({e.get('msg', 'invalid')}); send it with "
                            "Content-Type: application/json")
            continue
        field = ".".join(loc)
        param = param or field
        problems.append(f"{field}: {e.get('msg', 'invalid')}")
    return "; ".join(problems) or "invalid request", param


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(exc)
    return error_response(ApiError(INVALID, message, param), request_id_of(request))


async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = Status("INVALID_ARGUMENT", exc.status_code, "invalid_request_error",
                    "not_found" if exc.status_code == 404 else "http_error")
    return error_response(ApiError(status, str(exc.detail)), request_id_of(request))


async def _on_api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc, request_id_of(request))


def request_id_of(request: Request) -> str:
    """The id the app's RequestId middleware gave this request (its x-request-id header)."""
    return request.scope.get("state", {}).get("request_id") or "-"


def install(app) -> None:
    """Every error leaves the app in OpenAI's shape."""
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(ApiError, _on_api_error)
