"""google.rpc error details for a failed RPC, sent in the `grpc-status-details-bin` trailer.

INVALID_ARGUMENT carries a `BadRequest` with one field violation naming the request field the
message is about; RESOURCE_EXHAUSTED and UNAVAILABLE carry a `RetryInfo`. Clients read them with
`grpc_status.rpc_status.from_call(error)` (Python) or any google.rpc.Status parser.
"""
from __future__ import annotations

import re

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.descriptor import Descriptor
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

RETRY_AFTER_SECONDS = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: 1.0,   # a stream slot frees when any request ends
    grpc.StatusCode.UNAVAILABLE: 5.0,          # model loading / shutting down
}
_PATH = re.compile(r"[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*")


def _resolves(path: str, message: Descriptor) -> bool:
    """Whether a dotted path names a field (or, last, a oneof) of `message`."""
    parts = path.split(".")
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        field = message.fields_by_name.get(part)
        if field is None:
            return last and part in message.oneofs_by_name
        if not last:
            if field.message_type is None:
                return False
            message = field.message_type
    return True


def field_of(text: str, request: Descriptor | None) -> str:
    """The first dotted word of `text` that is a field path of `request`, or of one of its
    message fields (then prefixed: StreamSynthesize's "options.speed" is "config.options.speed")."""
    if request is None:
        return ""
    roots = [("", request)] + [(f"{f.name}.", f.message_type) for f in request.fields if f.message_type]
    for word in _PATH.findall(text):
        for prefix, root in roots:
            if _resolves(word, root):
                return prefix + word
    return ""


def error_trailer(code: grpc.StatusCode, message: str, request: Descriptor | None = None,
                  field: str | None = None) -> tuple:
    """Trailing metadata with a google.rpc.Status for `code` (empty when there is no detail)."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        detail = error_details_pb2.BadRequest(field_violations=[error_details_pb2.BadRequest.FieldViolation(
            field=field or field_of(message, request), description=message)])
    elif code in RETRY_AFTER_SECONDS:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(RETRY_AFTER_SECONDS[code] * 1e9))
        detail = error_details_pb2.RetryInfo(retry_delay=delay)
    else:
        return ()
    packed = any_pb2.Any()
    packed.Pack(detail)
    status = status_pb2.Status(code=code.value[0], message=message, details=[packed])
    return tuple(rpc_status.to_status(status).trailing_metadata)
