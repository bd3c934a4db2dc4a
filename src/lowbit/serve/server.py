"""Put it together and listen: Runtime -> Engine + FastAPI app -> uvicorn on a socket we bind ourselves.

We bind the socket before handing it to uvicorn so that a port in use is a clear LowbitError
(not a uvicorn log line and exit 1), and so port 0 can pick a free port whose number we know.
`BackgroundServer` runs the same thing in a thread (tests, the load test).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time

from lowbit.core.errors import LowbitError
from lowbit.serve.app import ServedModel, build_app
from lowbit.serve.batch_engine import BatchEngine
from lowbit.serve.engine import DEFAULT_MAX_ACTIVE, DEFAULT_PREFILL_CHUNK, Engine
from lowbit.serve.kvcache import CacheFactory, served_scheme
from lowbit.serve.metrics import Metrics

log = logging.getLogger("lowbit.serve")


ENGINES = ("auto", "batch", "single")


def build(runtime, *, max_active: int = DEFAULT_MAX_ACTIVE, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
          engine: str = "auto", decode_path: str = "auto", when_full: str = "wait", batch_invariant: bool = False,
          compile: bool | str = False, decode_ahead: bool | None = None):
    """(engine, app) for a lowbit.serve.loader.Runtime; the engine is not started yet.

    engine: "batch" (lowbit.serve.batch_engine: continuous batching over one static cache of
    `max_active` slots; decode_path "graphs" | "eager" | "auto", when_full "wait" | "reject",
    batch_invariant: every step at full width, so tokens do not depend on the load; compile: the captured
    step torch.compile'd first, True or "whole" as one graph, "layers" per decoder layer (DecodeGraphs regions);
    decode_ahead: queue the next step before reading this one's tokens while the batch is steady
    (lowbit.serve.batch_engine; None: the engine's default, on)),
    "single" (lowbit.serve.engine: one cache and one forward per request), or "auto": batch when the
    model is on CUDA, single on CPU (its per-request caches hold only what is used)."""
    if max_active < 1:
        raise LowbitError(f"--max-active {max_active}: need at least 1")
    if prefill_chunk < 1:
        raise LowbitError(f"--prefill-chunk {prefill_chunk}: need at least 1")
    if engine not in ENGINES:
        raise LowbitError(f"--engine {engine!r} unknown; use one of {', '.join(ENGINES)}")
    if engine == "auto":
        from lowbit.runtime.cache import model_device

        engine = "batch" if str(model_device(runtime.model)).startswith("cuda") else "single"
    if engine == "batch":
        return _build_batch(runtime, max_active, prefill_chunk, decode_path, when_full, batch_invariant, compile,
                            decode_ahead)
    if compile:
        raise LowbitError("--compile needs the batching engine on CUDA; use --engine batch on a GPU")
    if batch_invariant:
        raise LowbitError("--batch-invariant needs the batching engine; use --engine batch")
    if decode_ahead:
        raise LowbitError("--decode-ahead is a mode of the batching engine; use --engine batch")
    if decode_path == "graphs":
        raise LowbitError("--decode-path graphs needs the batching engine; use --engine batch")
    factory = CacheFactory(runtime.model, runtime.scheme, runtime.geometry)
    scheme = served_scheme(factory)
    engine = Engine(runtime.model, runtime.tokenizer, factory, Metrics(scheme), max_context=runtime.max_context,
                    eos_token_ids=runtime.eos_token_ids, max_active=max_active, prefill_chunk=prefill_chunk)
    app = build_app(engine, ServedModel(id=runtime.name, scheme=scheme, max_context=runtime.max_context,
                                        weights=runtime.weights))
    return engine, app


def _build_batch(runtime, slots: int, prefill_chunk: int, decode_path: str, when_full: str, batch_invariant: bool,
                 compile: bool | str = False, decode_ahead: bool | None = None):
    engine = BatchEngine(runtime, slots=slots, prefill_chunk=prefill_chunk, mode=decode_path, when_full=when_full,
                         batch_invariant=batch_invariant, compile=compile,
                         decode_ahead=True if decode_ahead is None else decode_ahead)
    scheme = engine.metrics.scheme
    app = build_app(engine, ServedModel(id=runtime.name, scheme=scheme, max_context=runtime.max_context,
                                        weights=runtime.weights))
    return engine, app


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one. Port in use -> LowbitError."""
    if not 0 <= port <= 65535:
        raise LowbitError(f"--port {port} is not a TCP port; use 1-65535, or 0 for any free port")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise LowbitError(f"--host {host!r} cannot be resolved ({e.strerror}); use e.g. 127.0.0.1") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    # REUSEADDR lets a restart bind over connections in TIME_WAIT; a live listener still refuses (Linux).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise LowbitError(
                f"port {port} on {host} is already in use; stop what holds it or pick another --port (0 = any free port)"
            ) from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise LowbitError(f"not allowed to listen on {host}:{port}; use a port above 1024") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise LowbitError(f"--host {host} is not an address of this machine; use e.g. 127.0.0.1") from None
        raise LowbitError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    # listen now: clients that connect before uvicorn runs wait in the backlog instead of being refused
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


DEFAULT_SHUTDOWN_GRACE = 5.0  # seconds in-flight requests get to finish after SIGTERM / Ctrl-C


def _uvicorn_server(app, log_level: str, grace: float = DEFAULT_SHUTDOWN_GRACE):
    import uvicorn

    class _DrainingServer(uvicorn.Server):
        """uvicorn's shutdown, after ours: stop accepting, let the live requests finish within `grace`
        and end the rest through the app (lowbit.serve.app.InFlight: 503 / a final stream event).
        uvicorn alone waited 5 s and then cancelled the handlers: HTTP 500 and two tracebacks."""

        drained: dict | None = None

        async def shutdown(self, sockets=None):
            for server in self.servers:
                server.close()  # stop accepting first (uvicorn does it again, harmlessly)
            inflight = getattr(app.state, "inflight", None)
            if inflight is not None:
                self.drained = await inflight.drain(grace)
            await super().shutdown(sockets=sockets)

    # uvicorn's own deadline only backs ours up: by then every handler has answered
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug", lifespan="off",
                            timeout_graceful_shutdown=grace + 5)
    return _DrainingServer(config)


def serve_forever(engine: Engine, app, sock: socket.socket, *, log_level: str = "warning",
                  grace: float = DEFAULT_SHUTDOWN_GRACE, report: dict | None = None) -> None:
    """Run until interrupted (Ctrl-C / SIGTERM); stops the engine on the way out. On a signal uvicorn
    drains (see _uvicorn_server) and then re-raises it here. report: filled with the drain's counts
    ({"finished", "ended", "seconds"}), for the caller's one line."""
    server = _uvicorn_server(app, log_level, grace)
    engine.start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()
        if report is not None:
            report.update(server.drained or {"finished": 0, "ended": 0, "seconds": 0.0})


class BackgroundServer:
    """`lowbit serve` in a background thread on 127.0.0.1 (port 0 = free): .url, .stop(). A context manager."""

    def __init__(self, engine: Engine, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 grace: float = DEFAULT_SHUTDOWN_GRACE):
        self.engine = engine
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        self._server = _uvicorn_server(app, log_level, grace)
        self._server.install_signal_handlers = lambda: None  # not the main thread
        self._thread = threading.Thread(target=self._run, name="lowbit-http", daemon=True)

    def _run(self):
        asyncio.run(self._server.serve(sockets=[self.sock]))

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.engine.start()
        self._thread.start()
        t0 = time.time()
        while not self._server.started:
            if time.time() - t0 > timeout or not self._thread.is_alive():
                raise LowbitError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    @property
    def drained(self) -> dict | None:
        """What the shutdown's drain did ({"finished", "ended"}), once stop() has run."""
        return self._server.drained

    def stop(self) -> None:
        """What SIGTERM does to `lowbit serve`: stop accepting, drain (the grace period), stop."""
        self._server.should_exit = True
        self._thread.join(10 + self._server.config.timeout_graceful_shutdown)
        self.engine.stop()
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
