"""The cosyvoice.v1 stubs as Ray's gRPC proxy needs them.

Ray's proxy pickles each request message to hand it to a replica, and pickle names a message
class by its `__module__`. protoc's generated classes say `cosyvoice_pb2` (the file they came
from), while `grpc_async._stubs` loads that file as `grpc_async.cosyvoice_pb2` without putting
the stub cache on sys.path. So in the Ray processes (the proxy imports this module through
`grpc_options.grpc_servicer_functions`; the replicas import it with the deployments) the name
`cosyvoice_pb2` is bound to the loaded module, and pickling resolves.
"""
from __future__ import annotations

import sys

from grpc_async import pb2, pb2_grpc

if sys.modules.setdefault("cosyvoice_pb2", pb2) is not pb2:
    raise ImportError("another module named cosyvoice_pb2 is loaded; Ray's gRPC proxy would unpickle "
                      "requests into it")

add_CosyVoiceServicer_to_server = pb2_grpc.add_CosyVoiceServicer_to_server
