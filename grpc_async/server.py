"""The CosyVoice gRPC service on grpc.aio.

This module is the server's lifecycle: bind the port with health NOT_SERVING, load and warm up the
model in the background, report unreadable speaker records, flip health to SERVING, and on
shutdown go NOT_SERVING, drain in-flight streams (those still running when the grace period ends
get UNAVAILABLE) and close the model.

If the LM engine dies (vLLM's EngineCore process killed, the native step loop failing), health
turns NOT_SERVING at once and for good, every request gets UNAVAILABLE with the reason, and
`serve` shuts down and returns ENGINE_DEAD_EXIT_CODE: the process exits non-zero so that the
orchestrator (systemd, Kubernetes, Ray Serve) replaces it. We do not restart the engine in place:
a half-dead process (KV cache, worker threads, device state of unknown health) is worse than a
fresh one, and the orchestrator already knows how to start one.

Also served: grpc.health.v1 (Check, Watch, List), server reflection, Prometheus metrics on a side
HTTP port (`/metrics` only). The pieces live next to it: `servicer` (the RPCs), `encoding` (audio out),
`auth` (bearer token, TLS), `metrics`.

Entry points: `run(config)` (blocking, used by `async-cosyvoice serve`), `serve(config)`
(coroutine) and `CosyVoiceServer` (start/stop in an existing loop, e.g. tests).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import ipaddress
import logging
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

import grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from async_cosyvoice.config import Config
from async_cosyvoice.devices import check_device, devices_of
from async_cosyvoice.errors import (
    ConfigError,
    CosyVoiceError,
    ModelDirError,
    StoreUnavailable,
    Unsupported,
)
from async_cosyvoice.heap import fix_mmap_threshold
from async_cosyvoice.loop_thread import LoopThread
from async_cosyvoice.placement import create_synthesizer
from async_cosyvoice.speaker_store import open_speaker_store
from async_cosyvoice.tts import Synthesizer

from ._stubs import SERVICE_NAME
from .auth import BearerAuthInterceptor, server_credentials
from .device_metrics import DeviceCollector
from .metrics import Metrics
from .servicer import CosyVoiceServicer, pb2_grpc
from .store_watch import StoreWatch
from .undecodable import UndecodableRequests

if TYPE_CHECKING:
    from http_api import HttpFrontDoor

log = logging.getLogger("grpc_async.server")

ENGINE_DEAD_EXIT_CODE = 3  # `serve`/`run`/`main` return it when the LM engine died
STARTUP_ERROR_EXIT_CODE = 2  # a configuration or model the server cannot serve
_END_STREAMS_WAIT = 5.0  # seconds for cancelled streams to send their UNAVAILABLE
# After the engine died the port stays open this long (at most the drain grace) answering
# UNAVAILABLE with the reason: grpc's stop cancels calls it has not yet handed to a handler, so a
# request racing the health change would otherwise get a bare CANCELLED, which clients don't retry.
_DEAD_LINGER_SECONDS = 1.0


def check_port_free(host: str, port: int | None, door: str) -> None:
    """ConfigError when another process listens on host:port (grpc and uvicorn would each print
    their own lines and a traceback). Port None or 0 (any free port) is always fine."""
    if not port:
        return
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ConfigError(f"the {door} port {host}:{port} is in use by another process; stop it or "
                                      f"choose another port") from None


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server to this machine (a name other than localhost counts as
    not: it may resolve to any interface)."""
    if host.lower() in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class HealthServicer(grpc_health.aio.HealthServicer):
    """grpc.health.v1 with List (grpcio-health-checking's servicer leaves it unimplemented)."""

    async def List(self, request: health_pb2.HealthListRequest, context) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in self._server_status.items()})


class CosyVoiceServer:
    """Binds the port at once (health NOT_SERVING), loads the model in the background, then flips
    health to SERVING. `synthesizer` may be given (already created) instead of loading one."""

    def __init__(self, config: Config, synthesizer: "Synthesizer | None" = None,
                 synthesizer_factory: Callable[[Config], Awaitable["Synthesizer"]] | None = None):
        self.config = config
        self.metrics = Metrics()
        self.servicer = CosyVoiceServicer(config, self.metrics)
        self.health = HealthServicer()
        self._given = synthesizer
        self._factory = synthesizer_factory
        self._loader: asyncio.Task | None = None
        self._engine_watch: asyncio.Task | None = None
        self._store_watch: StoreWatch | None = None
        self.engine_died: asyncio.Future[str] | None = None  # resolves with the reason; made in start()
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http: "HttpFrontDoor | None" = None
        self.http_port: int | None = None
        self._stopped = asyncio.Event()

    @property
    def synthesizer(self) -> "Synthesizer | None":
        return self.servicer.synth

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> int | None:
        """Open the front doors (gRPC on server.port, HTTP on server.http_port; either may be None)
        and load the model in the background. Returns the gRPC port (None when gRPC is off)."""
        cfg = self.config
        if cfg.server.port is None and cfg.server.http_port is None:
            raise ValueError("both front doors are off: set server.port (gRPC) and/or server.http_port (HTTP)")
        if self._given is None:
            for device in devices_of(cfg):
                check_device(device)
        check_port_free(cfg.server.host, cfg.server.port, "gRPC (--port)")
        check_port_free(cfg.server.host, cfg.server.http_port, "HTTP (--http-port)")
        check_port_free(cfg.server.host, cfg.server.metrics_port, "metrics (server.metrics_port)")
        self.engine_died = asyncio.get_running_loop().create_future()  # whichever doors are open
        if not is_loopback(cfg.server.host) and not cfg.server.auth_token:
            log.warning("server.host %s accepts connections from other machines and server.auth_token is not set: "
                        "anyone who reaches the port can synthesize and register or delete speakers; set "
                        "server.auth_token (env ASYNC_COSYVOICE__SERVER__AUTH_TOKEN) or bind 127.0.0.1",
                        cfg.server.host)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if cfg.server.port is not None:
            await self._start_grpc()
        if cfg.server.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(cfg.server.metrics_port, cfg.server.host)
        try:
            await self._start_http()
        except BaseException:
            if self._server is not None:
                await self._server.stop(0)
            self.metrics.close()
            raise
        self._loader = asyncio.create_task(self._load())
        return self.port

    async def _start_grpc(self) -> None:
        cfg = self.config
        limits = cfg.limits
        interceptors = [BearerAuthInterceptor(cfg.server.auth_token)] if cfg.server.auth_token else []
        self._server = grpc.aio.server(interceptors=[*interceptors, UndecodableRequests()], options=[
            ("grpc.max_receive_message_length", limits.max_message_bytes),
            ("grpc.max_send_message_length", limits.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ])
        pb2_grpc.add_CosyVoiceServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self._server)
        address = f"{cfg.server.host}:{cfg.server.port}"
        creds = server_credentials(cfg)
        self.port = (self._server.add_secure_port(address, creds) if creds
                     else self._server.add_insecure_port(address))
        if not self.port:
            raise RuntimeError(f"cannot bind {address}")
        await self._server.start()
        log.info("listening on %s:%d (%s%s)", cfg.server.host, self.port, "TLS" if creds else "plaintext",
                 ", bearer auth" if interceptors else "")

    # ---- the HTTP front door (http_api): same loop, synthesizer, limiter, token and metrics ----

    async def _start_http(self) -> None:
        cfg = self.config
        if cfg.server.http_port is None:
            return
        # http_api needs the optional `http` extra (fastapi, uvicorn); imported only when asked for
        from http_api import Backend, HttpFrontDoor

        backend = Backend(config=cfg, metrics=self.metrics, limiter=self.servicer.limiter,
                          synthesizer=self.servicer._synth)
        self.http = HttpFrontDoor(backend, cfg.server.host, cfg.server.http_port)
        self.http_port = await self.http.start()

    async def _stop_http(self, grace: float) -> None:
        if self.http is not None:
            await self.http.stop(grace)

    async def _check_store_durability(self) -> None:
        """Log (or, speakers.redis_durability: require, refuse to start over) how acknowledged
        registrations could be lost if the store's server crashed. Checked before the model loads,
        on a store opened for the check; the folder store writes fsynced files and has nothing to say."""
        if self.config.speakers.backend == "directory":
            return

        def problem() -> str | None:
            store = open_speaker_store(self.config.speakers)
            try:
                return store.persistence_problem()
            finally:
                store.close()

        required = self.config.speakers.redis_durability == "require"
        try:
            found = await asyncio.to_thread(problem)
        except StoreUnavailable as e:
            if required:
                raise Unsupported(f"{e}; speakers.redis_durability is require, so its persistence must be "
                                  "checked before serving") from None
            log.warning("cannot check the speaker store's persistence: %s", e)
            return
        if found is None:
            return
        if required:
            raise Unsupported(f"{found} (speakers.redis_durability: require; warn starts anyway)")
        log.warning("%s (set speakers.redis_durability: require to refuse to start)", found)

    async def _store_reachable(self, reachable: bool) -> None:
        """The store watch: health follows the store while the server is otherwise ready."""
        if self.servicer.closing or self.servicer.engine_failure is not None or self.synthesizer is None:
            return
        await self._set_health(health_pb2.HealthCheckResponse.SERVING if reachable
                               else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _load(self) -> None:
        t0 = time.perf_counter()
        await self._check_store_durability()
        synth = self._given
        if synth is None:
            if self._factory is not None:
                synth = await self._factory(self.config)
            else:
                # one device, or several (model.devices); the servicer's Startup follows the steps
                synth = await create_synthesizer(self.config, startup=self.servicer.startup)
        self.servicer.synth = synth
        log.info("speaker store: %r", synth.speakers)
        self.metrics.bind_engine(synth.engine_stats)
        self.metrics.bind_stages(synth.stage_stats)
        self.metrics.registry.register(DeviceCollector(synth))
        try:
            await asyncio.to_thread(synth.speakers.unreadable_records)  # logs each one
        except StoreUnavailable as e:
            log.warning("cannot check the stored speakers: %s", e)
        if self.servicer.closing:
            return
        self._engine_watch = asyncio.create_task(self._watch_engine(synth))
        self.metrics.record_startup(self.servicer.startup.finish())
        self.metrics.ready.set(1)
        self._store_watch = StoreWatch(synth.speakers, self._store_reachable)
        if synth.speakers.reachable:
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._store_watch.start()  # an unreachable store: NOT_SERVING until it answers
        log.info("model ready in %.1f s; health %s", time.perf_counter() - t0,
                 "SERVING" if synth.speakers.reachable else "NOT_SERVING until the speaker store answers")

    async def _watch_engine(self, synth: "Synthesizer") -> None:
        reason = await synth.wait_dead()  # "the speech-token engine died (…)", "the token2wav process … exited …"
        log.critical("%s: health NOT_SERVING, requests get UNAVAILABLE, the server exits with code %d", reason,
                     ENGINE_DEAD_EXIT_CODE)
        self.servicer.engine_failure = reason
        self.metrics.ready.set(0)
        self.metrics.engine_alive.set(0)
        await self.health.enter_graceful_shutdown()  # NOT_SERVING for good
        # streams still rendering tokens generated before the death would run on for a while
        left = self.servicer.end_streams(str(self.servicer.engine_dead()))
        if left:
            await asyncio.wait(left, timeout=_END_STREAMS_WAIT)
        await asyncio.sleep(min(_DEAD_LINGER_SECONDS, self.config.server.grace_seconds))
        self.engine_died.set_result(reason)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the model is loaded (re-raises a loading failure)."""
        assert self._loader is not None, "start() first"
        await asyncio.wait_for(asyncio.shield(self._loader), timeout)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown: NOT_SERVING, refuse new streams, drain in-flight ones for `grace`
        seconds (config server.grace_seconds), then cancel what is left and close the model."""
        if self._loader is None or self.servicer.closing:
            await self._stopped.wait()
            return
        grace = self.config.server.grace_seconds if grace is None else grace
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        # 1. Health NOT_SERVING and UNAVAILABLE ("shutting down", retryable) for new synthesis
        #    while the in-flight streams finish; 2. then grpc's own stop with what is left of the
        #    grace (other RPCs finish, the rest is cancelled, which aborts their engine requests).
        self.servicer.closing = True
        self.metrics.ready.set(0)
        await self.health.enter_graceful_shutdown()
        log.info("shutting down: draining %d stream(s) for up to %.1f s", self.servicer.active, grace)
        try:
            if not self.servicer.idle.is_set():  # wait_for(…, 0) times out even on a set event
                await asyncio.wait_for(self.servicer.idle.wait(), timeout=grace)
        except asyncio.TimeoutError:
            message = (f"the server shut down before this stream finished (the drain grace of {grace:g} s "
                       "ran out); retry on another instance")
            left = self.servicer.end_streams(message)
            if self.http is not None:
                left += self.http.end_sessions(message)
            log.warning("drain grace of %.1f s is over: ending %d stream(s) with UNAVAILABLE", grace, len(left))
            if left:
                await asyncio.wait(left, timeout=_END_STREAMS_WAIT)
        await self._stop_http(max(0.0, deadline - loop.time()))
        if self._server is not None:
            await self._server.stop(max(0.0, deadline - loop.time()))
        if self._engine_watch is not None:
            self._engine_watch.cancel()
        if self._store_watch is not None:
            self._store_watch.close()
        if self._loader is not None and not self._loader.done():
            self._loader.cancel()
        if self._loader is not None:
            with contextlib.suppress(BaseException):
                await self._loader
        await self.servicer.heap.close()
        if self.servicer.synth is not None:
            await self.servicer.synth.close()
        self.metrics.close()
        self._stopped.set()
        log.info("stopped")

    async def serve_until(self, stop: asyncio.Event) -> int:
        """After start(): serve until `stop` is set (0) or the LM engine dies
        (ENGINE_DEAD_EXIT_CODE), then shut down. A loading failure is raised."""
        waiter = asyncio.ensure_future(stop.wait())
        try:
            done, _ = await asyncio.wait({waiter, self._loader}, return_when=asyncio.FIRST_COMPLETED)
            if self._loader in done and self._loader.exception() is not None:
                raise self._loader.exception()
            done, _ = await asyncio.wait({waiter, self.engine_died}, return_when=asyncio.FIRST_COMPLETED)
            return ENGINE_DEAD_EXIT_CODE if self.engine_died in done else 0
        finally:
            waiter.cancel()
            await self.stop()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()


class ServerThread:
    """A CosyVoiceServer on its own event loop in a daemon thread, for synchronous programs
    (notebooks, tests): `with ServerThread(config) as st: ... st.port ...`."""

    def __init__(self, config: Config, ready_timeout: float | None = 600.0, **server_kwargs):
        self.config = config
        self._loop_thread = LoopThread("cosyvoice-server")
        self.loop = self._loop_thread.loop
        try:
            self.server: CosyVoiceServer = self.call(self._make(server_kwargs))
            self.port: int = self.call(self.server.start())
            if ready_timeout is not None:
                self.call(self.server.wait_ready(), timeout=ready_timeout)
        except BaseException:
            self.close(grace=0)
            raise

    async def _make(self, kwargs) -> CosyVoiceServer:
        return CosyVoiceServer(self.config, **kwargs)

    @property
    def target(self) -> str:
        return f"{self.config.server.host}:{self.port}"

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's loop and return its result."""
        return self._loop_thread.call(coro, timeout)

    def close(self, grace: float | None = 0) -> None:
        if self.loop.is_closed():
            return
        server = getattr(self, "server", None)
        if server is not None and server._loader is not None:
            with contextlib.suppress(Exception):
                self.call(server.stop(grace), timeout=120)
        self._loop_thread.close()

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def serve(config: Config, *, install_signal_handlers: bool = True) -> int:
    """Run the service until SIGINT/SIGTERM, then shut down gracefully (returns 0), or until the
    LM engine dies (returns ENGINE_DEAD_EXIT_CODE). A loading failure is raised."""
    server = CosyVoiceServer(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if install_signal_handlers:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
    return await server.serve_until(stop)


def run(config: Config) -> int:
    """Blocking entry point for `async-cosyvoice serve`; returns the process exit code."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # process-wide malloc policy, so it belongs to the process's entry point (see async_cosyvoice.heap)
    fix_mmap_threshold(config.server.heap_mmap_threshold_kib * 1024)
    return asyncio.run(serve(config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpc_async.server", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config (default: built-in defaults + env overrides)")
    parser.add_argument("--model-dir", help="CosyVoice2 model directory (overrides model.dir)")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    config = Config.load(args.config)
    if args.model_dir:
        config.model.dir = Path(args.model_dir)
    if args.host:
        config.server.host = args.host
    if args.port is not None:
        config.server.port = args.port
    try:
        return run(config)
    except (CosyVoiceError, ModelDirError) as e:  # one clear line, no traceback
        log.error("cannot start: %s", e)
        return STARTUP_ERROR_EXIT_CODE


if __name__ == "__main__":
    raise SystemExit(main())
