"""server: runs one sync agent — its engine, its SyncAgent and the gRPC server in front of them.

The servicer is thin: it converts protobuf messages to the agent's calls and back, and maps
errors to status codes with the one table in `weightsync.transport.rpc`; it holds no logic. The server
has explicit message limits, a bearer-token interceptor and TLS/mTLS when configured, Prometheus
metrics when a metrics port is set, and the standard gRPC health service (also alone on a
plaintext `health_listen` port for probes that cannot speak TLS) with two names:

    ""           readiness: SERVING while the agent serves a version and its engine serves that
                 version (`SyncAgent.check_health`); NOT_SERVING before the first version, while
                 the engine is paused or unreachable, and while shutting down. A watch thread
                 checks again after every sync and every poll_interval_s.
    SERVICE      ("weightsync.transport.v1.SyncAgent") liveness: SERVING while the process takes
                 calls (it must, to receive its first version); NOT_SERVING while shutting down.

Every port (listen, health_listen, the metrics port) is bound before the engine starts, and one
that is taken is a `ListenError` naming the setting. `AgentServer.stop` drains in-flight calls for
a grace period before closing (what SIGTERM does in `run_agent`).

Not here: what the agent does (`sync.py`), engines (`engines/`), the CLI (app/cli/).
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import faulthandler
import gc
import logging
import signal
import threading
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from weightsync.agents.config import AgentConfig
from weightsync.agents.engines import open_engine
from weightsync.agents.engines.base import Engine
from weightsync.agents.sync import SyncAgent
from weightsync.errors import WeightsyncError
from weightsync.listen import check_bindable, listen_error, split_listen
from weightsync.metrics import NULL_METRICS, PrometheusMetrics
from weightsync.stores import open_store
from weightsync.transport.push import PushConfig, Pusher
from weightsync.transport.rpc import (
    SERVER_OPTIONS,
    SERVICE,
    ObjectFrame,
    TokenAuthInterceptor,
    agent_service_handler,
    read_token,
    server_credentials,
    status_for,
)
from weightsync.transport.signing import Verifier
from weightsync.transport.v1 import sync_pb2

log = logging.getLogger(__name__)


class _Servicer:
    """SyncAgent RPCs -> calls on the agent's intake (offers, objects) and status; weightsync
    errors -> status codes."""

    def __init__(self, agent: SyncAgent) -> None:
        self.agent = agent

    def offer(self, request: sync_pb2.OfferRequest, context: grpc.ServicerContext) -> sync_pb2.OfferReply:
        try:
            wanted, missing = self.agent.intake.offer(
                model=request.model,
                version=request.version,
                manifest=request.manifest,
                signature=request.signature,
                objects=list(request.objects),
                origin=request.origin or context.peer(),
                hops=request.hops,
            )
        except WeightsyncError as e:
            context.abort(status_for(e), str(e))
        decision = sync_pb2.OfferReply.WANTED if wanted else sync_pb2.OfferReply.NOT_NEEDED
        return sync_pb2.OfferReply(decision=decision, missing=missing, current_version=self.agent.served_version)

    def push_objects(self, frames: Iterator[ObjectFrame], context: grpc.ServicerContext) -> sync_pb2.PushReply:
        kept = size = duplicates = 0
        try:
            for frame in frames:
                if self.agent.intake.receive_object(
                    model=frame.model,
                    version=frame.version,
                    address=frame.object,
                    data=frame.data,
                    placement=frame.placement,
                ):
                    kept += 1
                    size += len(frame.data)
                else:
                    duplicates += 1
        except WeightsyncError as e:
            context.abort(status_for(e), str(e))
        return sync_pb2.PushReply(objects=kept, bytes=size, duplicates=duplicates)

    def get_status(self, request: sync_pb2.StatusRequest, context: grpc.ServicerContext) -> sync_pb2.StatusReply:
        # A verify waits for a copying engine's sync to end, within the caller's deadline.
        remaining = context.time_remaining()
        wait_s = 5.0 if remaining is None else max(0.0, remaining - 1.0)
        return status_to_proto(self.agent.status(verify=request.verify, verify_timeout_s=wait_s))


def status_to_proto(status: dict) -> sync_pb2.StatusReply:
    nested = ("ledger", "broken", "engine_state", "verification", "parity")
    reply = sync_pb2.StatusReply(**{k: v for k, v in status.items() if k not in nested})
    for entry in status["ledger"]:
        parity = entry.get("parity")
        reply.ledger.add(**{k: v for k, v in entry.items() if k != "parity"})
        if parity:
            reply.ledger[-1].parity.CopyFrom(sync_pb2.ParityReport(**parity))
    if status.get("parity"):
        reply.parity.CopyFrom(sync_pb2.ParityReport(**status["parity"]))
    for broken in status["broken"]:
        reply.broken.add(**broken)
    reply.engine_state.CopyFrom(sync_pb2.EngineState(**status["engine_state"]))
    if "verification" in status:
        reply.verification.CopyFrom(sync_pb2.Verification(**status["verification"]))
    return reply


class AgentServer:
    """An agent process's parts, started and stopped together."""

    def __init__(self, config: AgentConfig, *, engine: Engine | None = None) -> None:
        self.config = config
        token = read_token(config.token, config.token_file)
        self.metrics = NULL_METRICS
        if config.metrics_port is not None:
            self.metrics = PrometheusMetrics(agent=config.name, region=config.region)
            self.metrics.start_counters("agent")  # at 0 from the first scrape, not from the first event
        self.engine: Engine | None = None
        self._health = health.HealthServicer()
        self._health_server: grpc.Server | None = None
        self.health_address: str | None = None
        self.metrics_port: int | None = None
        interceptors = [TokenAuthInterceptor(token)] if token else []
        self._server = grpc.server(
            cf.ThreadPoolExecutor(max_workers=16, thread_name_prefix="ws-rpc"),
            options=SERVER_OPTIONS,
            interceptors=interceptors,
        )
        try:
            # Ports first: a taken one fails in a line naming its setting before the engine starts.
            tls = config.tls if config.tls is not None and config.tls.enabled else None
            port = bind_port(self._server, config.listen, "listen", "--listen", tls=tls)
            self.address = f"{config.listen.rsplit(':', 1)[0]}:{port}"
            # Kubernetes grpc probes speak neither TLS nor tokens: the health service alone, in
            # plaintext, on a port of its own (it tells only whether the agent serves).
            if config.health_listen is not None:
                self._health_server = grpc.server(cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ws-health"))
                health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
                health_port = bind_port(self._health_server, config.health_listen, "health_listen", "--health-listen")
                self.health_address = f"{config.health_listen.rsplit(':', 1)[0]}:{health_port}"
            if isinstance(self.metrics, PrometheusMetrics):
                address = f"{config.metrics_host}:{config.metrics_port}"
                try:
                    self.metrics_port = self.metrics.serve(config.metrics_port, config.metrics_host)
                except OSError as e:  # Prometheus' own "[Errno 98] Address already in use" names no port
                    raise listen_error("metrics_port", address, e, flag="--metrics-port") from None
            self.engine = engine if engine is not None else open_engine(config.engine)
            relay = None
            if config.peers:
                relay = Pusher(
                    PushConfig(
                        targets=config.peers,
                        model=config.model,
                        tls=config.client_tls,
                        token=token,
                        origin=config.name,
                        hops=1,
                        max_buffered_bytes=config.relay_buffer_bytes,
                    ),
                    metrics=self.metrics,
                )
            self.agent = SyncAgent(
                config,
                self.engine,
                upstream=open_store(config.store) if config.store else None,
                verifier=Verifier.from_pem(config.trusted_keys) if config.trusted_keys else None,
                relay=relay,
                metrics=self.metrics,
            )
        except BaseException:
            self._close_parts(engine_given=engine is not None)
            raise
        servicer = _Servicer(self.agent)
        self._server.add_generic_rpc_handlers(
            (agent_service_handler(servicer.offer, servicer.push_objects, servicer.get_status),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._stopped = threading.Event()
        self._watch: threading.Thread | None = None

    def _close_parts(self, *, engine_given: bool) -> None:
        """What __init__ opened before it failed: ports, metrics, the engine it started."""
        self._server.stop(0)
        if self._health_server is not None:
            self._health_server.stop(0)
        if isinstance(self.metrics, PrometheusMetrics):
            self.metrics.close()
        if self.engine is not None and not engine_given:
            self.engine.close()

    def start(self) -> AgentServer:
        self.agent.start()  # serves the cached version before taking calls
        self._set_health()  # NOT_SERVING (and a warning saying why) until a version is served
        self._server.start()
        if self._health_server is not None:
            self._health_server.start()
        self._health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)  # liveness: it takes calls
        self._watch = threading.Thread(target=self._watch_health, name=f"ws-health-{self.config.name}", daemon=True)
        self._watch.start()
        log.info(
            "agent %s (%s) listening on %s, serving %s",
            self.config.name,
            self.config.region,
            self.address,
            self.config.model,
        )
        return self

    def _set_health(self) -> None:
        serving = not self.agent.check_health()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if not self._stopped.is_set():
            self._health.set("", status)

    def _watch_health(self) -> None:
        """Readiness follows the agent: after every sync attempt, and every poll_interval_s (an
        engine that became unreachable, a store that got the model)."""
        while not self._stopped.is_set():
            self.agent.changed.wait(timeout=self.config.poll_interval_s)
            self.agent.changed.clear()
            if self._stopped.is_set():
                return
            try:
                self._set_health()
            except Exception:  # a bug here must not leave readiness stuck: log, keep watching
                log.exception("agent %s: health check failed", self.config.name)

    def stop(self, grace_s: float = 5.0) -> None:
        """Stops taking calls, lets in-flight ones finish for `grace_s`, then closes everything."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.agent.changed.set()  # the watch thread ends
        self._health.enter_graceful_shutdown()
        self._server.stop(grace_s).wait()
        if self._health_server is not None:
            self._health_server.stop(0).wait()
        if self._watch is not None:
            self._watch.join(timeout=30)
        self.agent.close()
        self.engine.close()
        if isinstance(self.metrics, PrometheusMetrics):
            self.metrics.close()

    def wait(self) -> None:
        self._stopped.wait()


def bind_port(server: grpc.Server, address: str, setting: str, flag: str, *, tls=None) -> int:
    """Binds `address` (host:port) on a gRPC server; the port it got (0: any free one). A port
    that is taken or an address that cannot be bound is a ListenError naming `setting` and its
    `flag`, checked with a plain socket first: gRPC itself would only log a C-level line and raise
    a bare RuntimeError."""
    host, port = split_listen(address, setting)
    check_bindable(host, port, setting, flag=flag)
    try:
        if tls is not None:
            return server.add_secure_port(address, server_credentials(tls))
        return server.add_insecure_port(address)
    except RuntimeError:  # taken between the check and the bind
        raise listen_error(setting, address, OSError(errno.EADDRINUSE, "in use"), flag=flag) from None


SHUTDOWN_S = 120.0
"""How long a graceful shutdown (SIGTERM) may take before the process exits anyway (status 1),
every thread's stack on stderr. Above the bounded waits of `AgentServer.stop` (the calls' grace,
the sync thread's 60 s, the watch's 30 s)."""


def run_agent(config: AgentConfig, *, ready=None, engine: Engine | None = None) -> None:
    """Runs an agent until SIGTERM/SIGINT, then shuts it down gracefully. `ready(server)` is
    called once it listens (the CLI prints the address). `engine`: one already open (closed with the
    agent), instead of the one `config` describes."""
    server = AgentServer(config, engine=engine).start()
    # What starting made (modules, the engine, compiled kernels) lives as long as the process: frozen,
    # the collector's full passes no longer walk it. They did, 0.18-0.25 s each, and one that landed
    # in a sync (parsing a version's manifests allocates enough to trigger it) held up serving by
    # as much: a third of the 1 GiB benchmark's steady versions on 2 cores.
    gc.freeze()
    if ready is not None:
        ready(server)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Timed: Python runs a handler only in the main thread, once it next runs bytecode. A signal that
    # the kernel hands to one of the other threads (gRPC's, the engine's) does not wake a main thread
    # blocked in an untimed wait: seen twice, agents that never stopped on SIGTERM.
    while not stop.wait(1.0):
        pass
    log.info("agent %s: shutting down (at most %.0f s)", config.name, SHUTDOWN_S)
    # Bounded: a call or worker thread that never returns (a stuck engine, a probe) must not keep the
    # process alive, in stop() or in the interpreter's exit, which joins worker threads. Past the
    # deadline every thread's stack goes to stderr and the process exits with 1; what the agent keeps
    # on disk is crash-safe, so exiting anyway loses nothing.
    faulthandler.dump_traceback_later(SHUTDOWN_S, exit=True)
    server.stop()
    log.info("agent %s: stopped", config.name)
