"""Python stubs for protos/cosyvoice/v1/cosyvoice.proto, generated on first import.

`grpc_tools.protoc` (a dependency) compiles the proto into a cache folder named after a hash of
the proto text and the protobuf/grpcio-tools versions, so an edited proto or an upgraded
protobuf gets fresh stubs and nothing generated is ever committed. The proto is compiled under
its canonical name `cosyvoice/v1/cosyvoice.proto` (what reflection clients see), wherever the
file lives. The modules are loaded as `grpc_async.cosyvoice_pb2` / `grpc_async.cosyvoice_pb2_grpc`
without touching `sys.path`: the one absolute import protoc writes into the service module
(`from cosyvoice.v1 import cosyvoice_pb2`) is made relative when the stubs are generated.

Environment:
  ASYNC_COSYVOICE_PROTO      path of cosyvoice.proto (default: next to this package, a link or a
                             copy in wheels, or the repo's protos/cosyvoice/v1/)
  ASYNC_COSYVOICE_STUBS_DIR  cache folder (default: `async_cosyvoice.files.cache_root()`/stubs)

`python -m grpc_async._stubs` prints where the stubs are.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from async_cosyvoice.files import atomic_directory, cache_root

PROTO_NAME = "cosyvoice.proto"
PROTO_PACKAGE_PATH = "cosyvoice/v1/cosyvoice.proto"   # its path under the proto root (buf, reflection)
_GENERATOR_VERSION = "2"   # bump when _compile's output changes, so cached stubs are rebuilt
SERVICE_NAME = "cosyvoice.v1.CosyVoice"
_PKG_DIR = Path(__file__).resolve().parent


def proto_path() -> Path:
    env = os.environ.get("ASYNC_COSYVOICE_PROTO")
    candidates = [Path(env)] if env else []
    candidates += [_PKG_DIR / PROTO_NAME, _PKG_DIR.parent / "protos" / PROTO_PACKAGE_PATH]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{PROTO_NAME} not found (looked in {', '.join(map(str, candidates))}); "
        "set ASYNC_COSYVOICE_PROTO to its path")


def _cache_root() -> Path:
    env = os.environ.get("ASYNC_COSYVOICE_STUBS_DIR")
    return Path(env) if env else cache_root() / "stubs"


def _fingerprint(proto: bytes) -> str:
    import google.protobuf
    import grpc_tools

    h = hashlib.sha256(proto)
    h.update(_GENERATOR_VERSION.encode())
    h.update(google.protobuf.__version__.encode())
    h.update(getattr(grpc_tools, "__version__", "").encode())
    with contextlib.suppress(Exception):
        from importlib.metadata import version
        h.update(version("grpcio-tools").encode())
    return h.hexdigest()[:20]


def _compile(proto: Path, out_dir: Path) -> None:
    """cosyvoice_pb2.py and cosyvoice_pb2_grpc.py for `proto`, flat in `out_dir`."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    root = out_dir / "include"
    source = root / PROTO_PACKAGE_PATH
    source.parent.mkdir(parents=True)
    shutil.copyfile(proto, source)
    generated = out_dir / "generated"
    generated.mkdir()
    args = ["grpc_tools.protoc", f"-I{root}", f"-I{well_known}",
            f"--python_out={generated}", f"--grpc_python_out={generated}", str(source)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto} (see the messages above)")
    package_dir = generated / Path(PROTO_PACKAGE_PATH).parent
    shutil.move(package_dir / "cosyvoice_pb2.py", out_dir / "cosyvoice_pb2.py")
    service = (package_dir / "cosyvoice_pb2_grpc.py").read_text()
    absolute = "from cosyvoice.v1 import cosyvoice_pb2 as"
    if absolute not in service:
        raise RuntimeError(f"unexpected protoc output: no {absolute!r} in cosyvoice_pb2_grpc.py")
    (out_dir / "cosyvoice_pb2_grpc.py").write_text(service.replace(absolute, "from . import cosyvoice_pb2 as"))
    shutil.rmtree(root)
    shutil.rmtree(generated)


def stubs_dir() -> Path:
    """Folder holding the generated modules for the current proto (generated if missing)."""
    proto = proto_path()
    data = proto.read_bytes()
    key = _fingerprint(data)
    roots = [_cache_root(), Path(tempfile.gettempdir()) / f"async_cosyvoice-stubs-{os.getuid()}"]
    last_error: Exception | None = None
    for root in roots:
        target = root / key
        if (target / "cosyvoice_pb2_grpc.py").is_file():
            return target
        try:  # another process may win the race: its finished copy is kept
            with atomic_directory(target, finished=lambda p: (p / "cosyvoice_pb2_grpc.py").is_file()) as work:
                _compile(proto, work)
            return target
        except OSError as e:  # cache folder not writable: try the next one
            last_error = e
    raise RuntimeError(f"cannot write generated stubs to {roots}: {last_error}")


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load() -> tuple[ModuleType, ModuleType]:
    """(cosyvoice_pb2, cosyvoice_pb2_grpc), generating them if needed."""
    pkg = __name__.rpartition(".")[0]
    pb2_name, grpc_name = f"{pkg}.cosyvoice_pb2", f"{pkg}.cosyvoice_pb2_grpc"
    if grpc_name in sys.modules:
        return sys.modules[pb2_name], sys.modules[grpc_name]
    folder = stubs_dir()
    pb2 = _load(pb2_name, folder / "cosyvoice_pb2.py")
    pb2_grpc = _load(grpc_name, folder / "cosyvoice_pb2_grpc.py")  # imports pb2 as `from . import`
    return pb2, pb2_grpc


if __name__ == "__main__":
    print(stubs_dir())
