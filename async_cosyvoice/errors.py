"""Errors callers can act on, and the one table that gives each its status on every front door.

`status_of(error)` is what gRPC (a `grpc.StatusCode` name), HTTP (a status code and OpenAI's error
`type`) and the WebSocket (`4000 + http` and `code`) answer for it; the doors only translate.
"""
from __future__ import annotations

from dataclasses import dataclass


class CosyVoiceError(Exception):
    """Base class for errors raised to callers of the library."""


class InvalidRequest(CosyVoiceError, ValueError):
    """The request is malformed (empty text, bad audio, out-of-range option). -> INVALID_ARGUMENT"""


class SpeakerNotFound(CosyVoiceError, KeyError):
    """No speaker with that id. -> NOT_FOUND"""

    def __str__(self):  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else "speaker not found"


class SpeakerExists(CosyVoiceError):
    """A speaker with that id exists and overwrite was not asked for. -> ALREADY_EXISTS"""


class NotReady(CosyVoiceError):
    """The model is still loading or the service is shutting down. -> UNAVAILABLE"""


class Overloaded(CosyVoiceError):
    """Too many concurrent requests. -> RESOURCE_EXHAUSTED"""


class DeviceOutOfMemory(CosyVoiceError):
    """The device ran out of memory in a batch this request was part of (its other requests fail
    the same way; the server keeps serving). -> RESOURCE_EXHAUSTED, HTTP 503"""


class TooLarge(CosyVoiceError):
    """A request whose memory bound (cost.py) is over limits.max_request_bytes or the whole
    limits.memory_budget_bytes: it can never run here, so retrying does not help. -> RESOURCE_EXHAUSTED / 413"""


class Unsupported(CosyVoiceError):
    """A valid request this model or configuration cannot serve. -> FAILED_PRECONDITION"""


class ClientTimeout(CosyVoiceError):
    """A client sent what a request needs too slowly (limits.first_message_seconds, body_read_seconds).
    -> DEADLINE_EXCEEDED / 408"""


class TextTimeout(ClientTimeout):
    """A text stream sent no piece (nor its end) for longer than limits.text_idle_seconds. -> DEADLINE_EXCEEDED"""


class ModelDirError(Exception):
    """A model directory file is missing, unreadable or not what CosyVoice2 expects.
    The message names the file (relative to the directory) and what was expected."""

    def __init__(self, file: str, message: str):
        self.file = file
        self.message = message
        super().__init__(f"{file}: {message}")


class SpeakerCorrupt(CosyVoiceError):
    """A stored speaker record exists but cannot be used (truncated, a checksum mismatch, tokens
    outside the model's vocabulary). Its data is gone: the speaker must be registered again. -> DATA_LOSS"""


class StoreUnavailable(NotReady):
    """The speaker store (Redis) does not answer. Requests that need no stored speaker still run.
    -> UNAVAILABLE"""


class EngineDead(NotReady):
    """The speech-token engine died (its process was killed, its step loop failed). The instance
    cannot serve any more and is exiting. -> UNAVAILABLE"""


class ConfigError(CosyVoiceError, ValueError):
    """The configuration asks for what this machine cannot give (a device this torch build lacks,
    a port another process holds). Raised before anything is loaded; the message says the fix."""


@dataclass(frozen=True)
class ErrorStatus:
    grpc: str   # grpc.StatusCode name
    http: int   # HTTP status; the WebSocket closes with 4000 + it
    type: str   # OpenAI's error "type"
    code: str   # our stable code (HTTP error.code, WebSocket error code)


# First match wins: subclasses before their bases.
ERROR_STATUSES: tuple[tuple[type[Exception], ErrorStatus], ...] = (
    (InvalidRequest, ErrorStatus("INVALID_ARGUMENT", 400, "invalid_request_error", "invalid_request")),
    (Unsupported, ErrorStatus("FAILED_PRECONDITION", 400, "invalid_request_error", "unsupported")),
    (SpeakerNotFound, ErrorStatus("NOT_FOUND", 404, "invalid_request_error", "voice_not_found")),
    (SpeakerExists, ErrorStatus("ALREADY_EXISTS", 409, "invalid_request_error", "voice_exists")),
    (SpeakerCorrupt, ErrorStatus("DATA_LOSS", 500, "server_error", "data_loss")),
    (TextTimeout, ErrorStatus("DEADLINE_EXCEEDED", 408, "invalid_request_error", "text_timeout")),
    (ClientTimeout, ErrorStatus("DEADLINE_EXCEEDED", 408, "invalid_request_error", "timeout")),
    (TooLarge, ErrorStatus("RESOURCE_EXHAUSTED", 413, "invalid_request_error", "request_too_large")),
    (Overloaded, ErrorStatus("RESOURCE_EXHAUSTED", 429, "rate_limit_error", "overloaded")),
    (DeviceOutOfMemory, ErrorStatus("RESOURCE_EXHAUSTED", 503, "server_error", "device_out_of_memory")),
    (StoreUnavailable, ErrorStatus("UNAVAILABLE", 503, "server_error", "store_unavailable")),
    (NotReady, ErrorStatus("UNAVAILABLE", 503, "server_error", "unavailable")),
)
INTERNAL_STATUS = ErrorStatus("INTERNAL", 500, "server_error", "internal_error")


def status_of(error: BaseException) -> ErrorStatus:
    """The status of a library error on every door; INTERNAL_STATUS for anything else (a bug)."""
    for cls, status in ERROR_STATUSES:
        if isinstance(error, cls):
            return status
    return INTERNAL_STATUS
