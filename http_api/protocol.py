"""uvicorn's HTTP protocol with its own 400s (a request it cannot parse) in our JSON error shape
instead of text/plain. The app never sees such a request, so this is the only place to do it."""
from __future__ import annotations

import json
import uuid

from .errors import INVALID, error_body

try:  # what uvicorn's "auto" picks
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Base
except ImportError:  # httptools is not installed
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Base


class JsonErrorsProtocol(_Base):
    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_body(INVALID, f"{msg.rstrip('.')}: the bytes sent are not an HTTP/1.1 request "
                                              "uvicorn can parse")).encode()
        head = [b"HTTP/1.1 400 Bad Request", b"content-type: application/json",
                b"content-length: " + str(len(body)).encode(), b"x-request-id: " + uuid.uuid4().hex.encode(),
                b"connection: close"]
        head += [name + b": " + value for name, value in self.server_state.default_headers]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self.transport.close()
