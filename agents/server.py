"""server: runs one sync agent — its engine, its SyncAgent and the gRPC server in front of them.

The servicer is thin: it converts protobuf messages to the agent's calls and back, and maps
errors to status codes with the one table in `weightsync.transport.rpc`; it holds no logic. The server
has explicit message limits, a bearer-token interceptor and TLS/mTLS when configured, the
standard gRPC health service (SERVING once the agent runs, NOT_SERVING while it shuts down; also
alone on a plaintext `health_listen` port for probes that cannot speak TLS), and Prometheus
metrics when a metrics port is set. `AgentServer.stop` drains in-flight calls for a grace period
before closing (what SIGTERM does in `run_agent`).

Not here: what the agent does (`sync.py`), engines (`engines/`), the CLI (app/cli.py).
"""

from __future__ import annotations

import concurrent.futures as cf
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
    """SyncAgent RPCs -> SyncAgent calls; weightsync errors -> status codes."""

    def __init__(self, agent: SyncAgent) -> None:
        self.agent = agent

    def offer(self, request: sync_pb2.OfferRequest, context: grpc.ServicerContext) -> sync_pb2.OfferReply:
        try:
            wanted, missing = self.agent.offer(
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
                if self.agent.receive_object(
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
        return status_to_proto(self.agent.status(verify=request.verify))


def status_to_proto(status: dict) -> sync_pb2.StatusReply:
    reply = sync_pb2.StatusReply(**{k: v for k, v in status.items() if k not in ("ledger", "broken")})
    for entry in status["ledger"]:
        reply.ledger.add(**entry)
    for broken in status["broken"]:
        reply.broken.add(**broken)
    return reply


class AgentServer:
    """An agent process's parts, started and stopped together."""

    def __init__(self, config: AgentConfig, *, engine: Engine | None = None) -> None:
        self.config = config
        token = read_token(config.token, config.token_file)
        self.metrics = (
            PrometheusMetrics(agent=config.name, region=config.region)
            if config.metrics_port is not None
            else NULL_METRICS
        )
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
        interceptors = [TokenAuthInterceptor(token)] if token else []
        self._server = grpc.server(
            cf.ThreadPoolExecutor(max_workers=16, thread_name_prefix="ws-rpc"),
            options=SERVER_OPTIONS,
            interceptors=interceptors,
        )
        servicer = _Servicer(self.agent)
        self._server.add_generic_rpc_handlers(
            (agent_service_handler(servicer.offer, servicer.push_objects, servicer.get_status),)
        )
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        if config.tls is not None and config.tls.enabled:
            port = self._server.add_secure_port(config.listen, server_credentials(config.tls))
        else:
            port = self._server.add_insecure_port(config.listen)
        if port == 0:
            raise OSError(f"cannot listen on {config.listen}")
        self.address = f"{config.listen.rsplit(':', 1)[0]}:{port}"
        # Kubernetes grpc probes speak neither TLS nor tokens: the health service alone, in
        # plaintext, on a port of its own (it tells only whether the agent runs).
        self._health_server: grpc.Server | None = None
        self.health_address: str | None = None
        if config.health_listen is not None:
            self._health_server = grpc.server(cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ws-health"))
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
            health_port = self._health_server.add_insecure_port(config.health_listen)
            if health_port == 0:
                raise OSError(f"cannot listen on {config.health_listen}")
            self.health_address = f"{config.health_listen.rsplit(':', 1)[0]}:{health_port}"
        self.metrics_port: int | None = None
        self._stopped = threading.Event()

    def start(self) -> AgentServer:
        self.agent.start()  # serves the cached version before taking calls
        self._server.start()
        if self._health_server is not None:
            self._health_server.start()
        if isinstance(self.metrics, PrometheusMetrics):
            self.metrics_port = self.metrics.serve(self.config.metrics_port)
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "agent %s (%s) listening on %s, serving %s",
            self.config.name,
            self.config.region,
            self.address,
            self.config.model,
        )
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        """Stops taking calls, lets in-flight ones finish for `grace_s`, then closes everything."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._health.enter_graceful_shutdown()
        self._server.stop(grace_s).wait()
        if self._health_server is not None:
            self._health_server.stop(0).wait()
        self.agent.close()
        self.engine.close()
        if isinstance(self.metrics, PrometheusMetrics):
            self.metrics.close()

    def wait(self) -> None:
        self._stopped.wait()


def run_agent(config: AgentConfig, *, ready=None) -> None:
    """Runs an agent until SIGTERM/SIGINT, then shuts it down gracefully. `ready(server)` is
    called once it listens (the CLI prints the address)."""
    server = AgentServer(config).start()
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
    stop.wait()
    log.info("agent %s: shutting down", config.name)
    server.stop()
