"""gRPC service for async_cosyvoice: protocol stubs, server, async client.

`pb2` and `pb2_grpc` are the message and service modules generated from
protos/cosyvoice/v1/cosyvoice.proto (see `_stubs`). The server lives in `grpc_async.server`, the client in
`grpc_async.client`; import them explicitly (the server pulls in the model code).
"""
from ._stubs import SERVICE_NAME
from ._stubs import load as _load_stubs

pb2, pb2_grpc = _load_stubs()
assert pb2.DESCRIPTOR.services_by_name["CosyVoice"].full_name == SERVICE_NAME

__all__ = ["pb2", "pb2_grpc", "SERVICE_NAME"]
