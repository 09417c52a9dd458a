"""The cosyvoice.v1 stubs as Ray's gRPC proxy needs them.

Ray's proxy pickles each request message to hand it to a replica, and pickle names a message
class by its `__module__`. protoc's generated classes say `cosyvoice.v1.cosyvoice_pb2` (the
proto's canonical path), while `grpc_async._stubs` loads that file as `grpc_async.cosyvoice_pb2`
without putting the stub cache on sys.path. So in the Ray processes (the proxy imports this
module through `grpc_options.grpc_servicer_functions`; the replicas import it with the
deployments) that name, and its parent packages, are bound to the loaded module, and pickling
resolves.
"""
from __future__ import annotations

import sys
import types

from grpc_health.v1 import health_pb2_grpc

from grpc_async import pb2, pb2_grpc

PICKLED_NAME = pb2.RegisterSpeakerRequest.__module__  # what pickle looks up: cosyvoice.v1.cosyvoice_pb2


def _bind(name: str) -> None:
    *parents, _ = name.split(".")
    for i in range(len(parents)):  # empty parent packages, so `import cosyvoice.v1.cosyvoice_pb2` resolves
        package = ".".join(parents[:i + 1])
        if package not in sys.modules:
            module = types.ModuleType(package)
            module.__path__ = []
            sys.modules[package] = module
    if sys.modules.setdefault(name, pb2) is not pb2:
        raise ImportError(f"another module named {name} is loaded; Ray's gRPC proxy would unpickle "
                          "requests into it")


_bind(PICKLED_NAME)

add_CosyVoiceServicer_to_server = pb2_grpc.add_CosyVoiceServicer_to_server
add_HealthServicer_to_server = health_pb2_grpc.add_HealthServicer_to_server

# What `grpc_options.grpc_servicer_functions` names: our service, and grpc.health.v1 so that
# clients and probes that wait for SERVING (CosyVoiceClient.wait_ready, grpc_health_probe) work.
GRPC_SERVICER_FUNCTIONS = [f"{__name__}.add_CosyVoiceServicer_to_server", f"{__name__}.add_HealthServicer_to_server"]
