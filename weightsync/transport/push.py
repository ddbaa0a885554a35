"""push: streams versions to sync agents over gRPC — from the publisher, and from agent to agent.

A `Pusher` is a `PublishListener`: the publisher (or an agent relaying what it receives) hands
it each chunk object as soon as it exists and the manifest once the version is committed. For
each target agent it keeps a worker thread and a bounded buffer, and per version:

    objects   -> streamed as they arrive, in one PushObjects stream per version
    committed -> that stream is closed and the manifest offered at once (not after the stream's
                 reply: that would cost a round trip per version); the stream's reply confirms
                 receipt, and objects the agent still lacks (the offer's answer) that the stream
                 did not deliver are streamed again
    failed    -> the version's buffered objects are dropped

A broken stream or refused connection is retried with backoff; the retry starts with an offer
(the manifest, or before the commit the buffered objects' addresses), so it resumes at chunk
granularity and sends only what did not arrive. Pushing never blocks the caller: a target that
is slow or down lets its buffer fill, then objects for it are dropped and the agent fetches them
from the store; after `give_up_after_s` a version is dropped for that target altogether (the
agent catches up from the store). One target's trouble never delays another's.

Not here: the agent side (agents/), the wire format (`rpc.py`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time

from weightsync.errors import StaleVersion, WeightsyncError
from weightsync.format.manifest import ChunkPlacement, Manifest
from weightsync.metrics import NULL_METRICS, Metrics
from weightsync.retry import FINAL_ERRORS, Backoff
from weightsync.transport.rpc import AgentClient, ObjectFrame, TlsConfig, error_from_rpc, read_token
from weightsync.transport.v1 import sync_pb2

log = logging.getLogger(__name__)

_END = object()  # ends a stream's frame iterator


@dataclasses.dataclass(frozen=True, kw_only=True)
class PushConfig:
    targets: tuple[str, ...]
    """Agents to push to (host:port): one leader per region from a publisher, the downstream
    peers from an agent."""
    model: str
    tls: TlsConfig | None = None
    token: str | None = None
    """Bearer token the agents require; None: $WEIGHTSYNC_TOKEN if set (read when the Pusher starts)."""
    origin: str = "publisher"
    """Who pushes (shown in agents' ledgers)."""
    hops: int = 0
    """Relay depth written into offers: 0 from a publisher, the received hops + 1 from an agent."""
    max_buffered_bytes: int = 512 * 1024 * 1024
    """Per target: object bytes held for sending; beyond it objects are dropped for that target
    (it fetches them from the store) so memory stays bounded whatever the target does."""
    give_up_after_s: float = 120.0
    """Per target and version: stop retrying after this long (the agent catches up from the store)."""
    retry_backoff_s: tuple[float, float] = (0.1, 5.0)
    """First and largest delay between retries to an unreachable target."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.max_buffered_bytes < 0 or self.give_up_after_s <= 0:
            raise ValueError("max_buffered_bytes must be >= 0 and give_up_after_s > 0")
        if not 0 < self.retry_backoff_s[0] <= self.retry_backoff_s[1]:
            raise ValueError("retry_backoff_s must be (first, largest) with 0 < first <= largest")


@dataclasses.dataclass
class _Version:
    """What one target still has to get of one version."""

    version: int
    started: float
    objects: dict[str, bytes] = dataclasses.field(default_factory=dict)  # buffered, by address
    placements: dict[str, ChunkPlacement] = dataclasses.field(default_factory=dict)  # where known, by address
    unsent: collections.deque = dataclasses.field(default_factory=collections.deque)  # addresses
    offer: sync_pb2.OfferRequest | None = None
    failed: bool = False
    resume: bool = False  # a stream broke: ask the agent what it lacks before sending more


class _Target:
    """One target agent: a worker thread that drains per-version work in version order."""

    def __init__(self, address: str, config: PushConfig, metrics: Metrics) -> None:
        self.address = address
        self.config = config
        self.metrics = metrics
        for counter in ("push/bytes_sent", "push/errors"):  # this target's series, at 0 before its first push
            metrics.inc(counter, 0, target=address)
        self.client = AgentClient(address, tls=config.tls, token=read_token(config.token))
        self._cond = threading.Condition()
        self._versions: dict[int, _Version] = {}
        self._finished = 0  # the newest version done with: later objects or offers for it are dropped
        self._buffered = 0
        self._closed = False
        self.sent_bytes = 0
        self.dropped_objects = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"ws-push-{address}", daemon=True)
        self._thread.start()

    # -- producer side (publisher / relay threads): never blocks on the network

    def add_object(self, version: int, address: str, obj: bytes, placement: ChunkPlacement | None) -> None:
        with self._cond:
            if version <= self._finished:  # late (e.g. relayed after a store fetch): the agent has its path
                return
            state = self._versions.get(version)
            if state is not None and (state.failed or address in state.objects):
                return
            if self._buffered + len(obj) > self.config.max_buffered_bytes:
                self.dropped_objects += 1  # the agent will fetch it from the store
                return
            if state is None:  # only now: a version with nothing buffered would wait for an offer alone
                state = self._versions[version] = _Version(version, time.monotonic())
            state.objects[address] = obj
            if placement is not None:
                state.placements[address] = placement
            state.unsent.append(address)
            self._buffered += len(obj)
            self._cond.notify()

    def add_offer(self, offer: sync_pb2.OfferRequest) -> None:
        with self._cond:
            if offer.version <= self._finished:
                return
            state = self._versions.setdefault(offer.version, _Version(offer.version, time.monotonic()))
            state.offer = offer
            self._cond.notify()

    def fail(self, version: int) -> None:
        with self._cond:
            state = self._versions.get(version)
            if state is not None:
                state.failed = True
                self._cond.notify()

    def idle(self) -> bool:
        with self._cond:
            return not self._versions

    def close(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._versions and time.monotonic() < deadline:
                self._cond.wait(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
        self.client.close()

    # -- worker

    def _run(self) -> None:
        backoff = Backoff(first_s=self.config.retry_backoff_s[0], max_s=self.config.retry_backoff_s[1])
        failures = 0
        while True:
            with self._cond:
                while not self._closed and not self._ready():
                    self._cond.wait(timeout=0.5)
                if self._closed:
                    return
                state = self._versions[min(self._versions)]
            try:
                self._work(state)
                failures = 0
            except StaleVersion as e:  # the agent is past this version (it caught up elsewhere): next one
                log.info("push to %s: v%d is stale there (%s); moving on", self.address, state.version, e)
                self._finish(state)
            except FINAL_ERRORS as e:  # a retry cannot fix a wrong token or a refused signature
                self.last_error = str(e) or type(e).__name__
                self.metrics.inc("push/errors", target=self.address)
                log.error(
                    "push to %s refused v%d: %s (the agent's token or trusted keys and this publisher's do not "
                    "match; not retried, the agent catches up from the store once they do)",
                    self.address,
                    state.version,
                    e,
                )
                self._finish(state)
            except Exception as e:  # whatever goes wrong, the worker must live on and retry
                if not isinstance(e, WeightsyncError):
                    log.warning("push to %s: unexpected %s", self.address, type(e).__name__, exc_info=True)
                self.last_error = str(e) or type(e).__name__
                self.metrics.inc("push/errors", target=self.address)
                state.resume = True
                if time.monotonic() - state.started > self.config.give_up_after_s:
                    log.warning(
                        "push to %s: giving up on v%d after %.0f s (%s); it will catch up from the store",
                        self.address,
                        state.version,
                        self.config.give_up_after_s,
                        e,
                    )
                    self._finish(state)
                else:
                    failures += 1
                    pause = backoff.pause_s(failures)
                    log.info("push to %s failed (%s); retrying in %.1f s", self.address, e, pause)
                    time.sleep(pause)

    def _ready(self) -> bool:
        if not self._versions:
            return False
        state = self._versions[min(self._versions)]
        if not state.unsent and state.offer is None and not state.failed and self._waiting_is_pointless(state):
            # Nothing to send and no offer coming: a relay got objects of a version whose commit
            # failed upstream (no failure reaches it), or a broken stream's resume found nothing
            # missing. Waiting on it would hold back every later version for good.
            state.failed = True
        return bool(state.unsent) or state.offer is not None or state.failed

    def _work(self, state: _Version) -> None:
        if state.failed:
            self._finish(state)
            return
        if state.resume:
            self._resume(state)
        reply = self._stream(state, offer=True) if state.unsent else None
        if reply is None:
            with self._cond:
                offer = state.offer if not state.unsent else None
            if offer is None:
                return
            reply = self.client.offer(offer)
        if reply.decision == sync_pb2.OfferReply.WANTED and reply.missing:
            with self._cond:  # what the stream delivered has left state.objects: only the rest again
                state.unsent.extend(a for a in reply.missing if a in state.objects)
            if state.unsent:
                self._stream(state, offer=False)
        self._finish(state)

    def _resume(self, state: _Version) -> None:
        """After a broken stream: ask which buffered objects the agent still lacks."""
        with self._cond:
            offer = state.offer
            addresses = list(state.objects)
        if offer is None:
            offer = sync_pb2.OfferRequest(
                model=self.config.model,
                version=state.version,
                objects=addresses,
                origin=self.config.origin,
                hops=self.config.hops,
            )
        reply = self.client.offer(offer)
        with self._cond:
            state.unsent.clear()
            if reply.decision == sync_pb2.OfferReply.WANTED:
                state.unsent.extend(a for a in reply.missing if a in state.objects)
            state.resume = False

    def _waiting_is_pointless(self, state: _Version) -> bool:
        """Called under the lock: no offer will make this version worth more pushing — a newer
        version's offer is queued (the agent goes straight there), or it is past its time."""
        newer_offer = any(v > state.version and s.offer is not None for v, s in self._versions.items())
        return newer_offer or time.monotonic() - state.started > self.config.give_up_after_s

    def _stream(self, state: _Version, *, offer: bool) -> sync_pb2.OfferReply | None:
        """One PushObjects stream: sends unsent objects of `state` while more keep arriving,
        until the version's offer is known and nothing is left to send. Objects the stream's
        reply confirms leave the buffer at once (the agent has them).

        With `offer`, a stream that ends because the version is committed sends the offer before
        it waits for the stream's reply, and returns the offer's reply. Waiting first cost a round
        trip per version (the half-close out, the reply back) before the agent even learnt of the
        commit. The offer can then overtake the last objects, so its reply may list them as
        missing; the caller resends only what the stream's reply did not confirm."""
        frames: queue.Queue = queue.Queue()
        call = self.client.push_future(iter(frames.get, _END))
        sent: list[str] = []
        reply = None
        try:
            while True:
                with self._cond:
                    while (
                        not state.unsent
                        and state.offer is None
                        and not state.failed
                        and not self._closed
                        and not self._waiting_is_pointless(state)
                        and not call.done()
                    ):  # done: it broke
                        self._cond.wait(timeout=0.5)
                    if not state.unsent:
                        if state.offer is None and not state.failed and self._waiting_is_pointless(state):
                            state.failed = True  # finished without an offer: the agent fetches what it lacks
                        break
                    address = state.unsent.popleft()
                    obj = state.objects[address]
                    placement = state.placements.get(address)
                if call.done():  # the stream broke; its error surfaces below
                    break
                frames.put(ObjectFrame(self.config.model, state.version, address, obj, placement))
                sent.append(address)
                self.sent_bytes += len(obj)
                self.metrics.inc("push/bytes_sent", len(obj), target=self.address)
        finally:
            frames.put(_END)
        try:
            with self._cond:
                pending_offer = state.offer if offer and not state.failed and not call.done() else None
            if pending_offer is not None:
                reply = self.client.offer(pending_offer)
        finally:  # the stream's outcome, whatever the offer's
            try:
                call.result()
            except Exception as e:  # noqa: BLE001 - grpc.RpcError or a cancelled future: map it like any call failure
                raise error_from_rpc(e, f"push of v{state.version} to {self.address}") from None
        with self._cond:
            for address in sent:
                obj = state.objects.pop(address, None)
                if obj is not None:
                    self._buffered -= len(obj)
            self._cond.notify_all()
        return reply

    def _finish(self, state: _Version) -> None:
        with self._cond:
            self._versions.pop(state.version, None)
            self._finished = max(self._finished, state.version)
            self._buffered -= sum(len(o) for o in state.objects.values())
            state.objects.clear()
            self._cond.notify_all()


class Pusher:
    """Pushes versions to a set of agents; a `PublishListener` for `Publisher(listeners=...)`."""

    def __init__(self, config: PushConfig, *, metrics: Metrics = NULL_METRICS) -> None:
        self.config = config
        self._targets = [_Target(address, config, metrics) for address in config.targets]

    def on_object(self, version: int, object_xxh3: str, obj: bytes, placement: ChunkPlacement | None = None) -> None:
        """An object of `version` to push, and where it goes when known (a relay of an object
        fetched from the store knows it from the manifest, which the peers get anyway)."""
        for target in self._targets:
            target.add_object(version, object_xxh3, obj, placement)

    def on_commit(self, manifest: Manifest, manifest_bytes: bytes, signature: bytes | None) -> None:
        self.offer(manifest.version, manifest_bytes, signature)

    def offer(self, version: int, manifest_bytes: bytes, signature: bytes | None, hops: int | None = None) -> None:
        offer = sync_pb2.OfferRequest(
            model=self.config.model,
            version=version,
            manifest=manifest_bytes,
            signature=signature or b"",
            origin=self.config.origin,
            hops=self.config.hops if hops is None else hops,
        )
        for target in self._targets:
            target.add_offer(offer)

    def on_failure(self, version: int, error: BaseException) -> None:
        for target in self._targets:
            target.fail(version)

    def idle(self) -> bool:
        """True when every target has nothing left to send."""
        return all(t.idle() for t in self._targets)

    def stats(self) -> dict[str, dict]:
        return {
            t.address: {"sent_bytes": t.sent_bytes, "dropped_objects": t.dropped_objects, "last_error": t.last_error}
            for t in self._targets
        }

    def close(self, timeout_s: float = 30.0) -> None:
        """Waits up to `timeout_s` for pending versions, then stops."""
        deadline = time.monotonic() + timeout_s
        for target in self._targets:
            target.close(max(0.0, deadline - time.monotonic()))
