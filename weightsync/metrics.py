"""metrics: counters, gauges and histograms with slash-namespaced names, exported to Prometheus.

Code records `metrics.inc("agent/bytes_received", n, source="push")`,
`metrics.set("agent/version", 7)` or `metrics.observe("agent/swap_pause_s", 0.002)`; the name
`agent/swap_pause_s` becomes the Prometheus metric `weightsync_agent_swap_pause_s`, and its HELP
string is what METRICS says of it: every name recorded anywhere is declared there, once (a name
that is not is refused at its first use, and tests/test_metrics.py finds every name the code
records). Every component takes a `Metrics` and defaults to `NULL_METRICS`, which drops
everything, so no code branches on whether metrics are enabled. Each Prometheus sink has its own
registry (several agents in one test process must not collide) and can serve `/metrics` over HTTP.

Not here: when each is recorded (the agent's, the pusher's, the publisher's code; docs/agents.md
lists the agent's).
"""

from __future__ import annotations

import re
import threading
from typing import Protocol

# Latency buckets from 10 us to ~2 min: swap pauses are tens of microseconds, catch-ups minutes.
DEFAULT_BUCKETS_S = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    120,
)
_NAME = re.compile(r"[a-z][a-z0-9_]*(/[a-z][a-z0-9_]*)+")

METRICS: dict[str, str] = {
    # the sync agent (agents/)
    "agent/version": "The version the agent serves (0: none yet).",
    "agent/serving": "1 while the agent serves a version and its engine serves that version (gRPC health "
    "SERVING), else 0.",
    "agent/swap_pause_s": "Seconds new requests were held back by a swap: the pause clients see.",
    "agent/sync_s": "Seconds from a version's offer (or discovery in the store) to the agent serving it.",
    "agent/versions_served": "Versions served, by path: deltas (applied on the version held) or base "
    "(a base and its deltas).",
    "agent/bytes_received": "Object bytes received, by source: push (from a publisher or an upstream "
    "agent) or store (fetched).",
    "agent/objects_rejected": "Pushed objects refused, by reason: hash (bytes do not match their address) "
    "or quota (max_pending_bytes).",
    "agent/errors": "Sync attempts that failed (verification, a fetch, a refused layout, the engine's swap).",
    "agent/broken_versions": "Versions newer than the served one that failed and wait for a retry.",
    "agent/newest_broken_version": "The newest version that failed and waits for a retry (0: none).",
    "agent/parity_dlogprob_p50": "The newest parity probe's median |engine - trainer| log-prob (an alarm).",
    "agent/parity_dlogprob_p90": "The newest parity probe's 90th percentile |engine - trainer| log-prob (an alarm).",
    "agent/parity_max_abs_dlogprob": "The newest parity probe's max |engine - trainer| log-prob (shown, not an alarm).",
    "agent/parity_gap_kl": "The newest parity probe's training/inference gap: trimmed mean per-position KL(engine || training).",
    "agent/parity_expert_mismatch": "MoE: the newest parity probe's fraction of tokens routed to other experts.",
    "agent/parity_probe_s": "Seconds a parity probe took after its swap: the engine's answer and the comparison.",
    "agent/parity_breaches": "Parity probes that breached a threshold, by the action taken (warn, alert, refuse).",
    "agent/parity_alerts": "Parity probes that breached a threshold under action alert: what an alert rule watches.",
    "agent/parity_rollbacks": "Versions refused by the parity probe and rolled back to the newest that passed.",
    "agent/parity_errors": "Parity probes the engine gave no usable answer to (logged with the reason).",
    # pushing (weightsync/transport/push.py)
    "push/bytes_sent": "Object bytes a pusher sent, by target.",
    "push/errors": "Pushes to a target that failed (each is retried, or left to the store).",
    # publishing (weightsync/publisher.py)
    "publish/versions": "Versions committed, by kind: full or delta.",
    "publish/version": "The version this publisher committed last.",
    "publish/failures": "Versions whose publish failed (nothing was committed for them).",
    "publish/latency_s": "Seconds from a publish() call to its version's commit.",
    "publish/snapshot_s": "Seconds the caller of publish() waited: the snapshot copy.",
    "publish/encode_s": "Seconds a version took to encode and upload.",
    "publish/stored_bytes": "Bytes the versions added to the store (chunk objects and manifests).",
    "publish/ratio": "The last version's compression ratio: the model's bytes over what it added to the store.",
    "publish/changed_fraction": "Fraction of the elements the last version changed.",
}
"""Every metric weightsync records: name -> its Prometheus HELP string (what it measures, its labels)."""

COUNTERS: dict[str, dict[str, tuple[str, ...]]] = {
    "agent/versions_served": {"path": ("deltas", "base")},
    "agent/bytes_received": {"source": ("push", "store")},
    "agent/objects_rejected": {"reason": ("hash", "quota")},
    "agent/errors": {},
    "agent/parity_breaches": {"action": ("warn", "alert", "refuse")},
    "agent/parity_alerts": {},
    "agent/parity_rollbacks": {},
    "agent/parity_errors": {},
    "push/bytes_sent": {"target": ()},
    "push/errors": {"target": ()},
    "publish/versions": {"kind": ("full", "delta")},
    "publish/failures": {},
    "publish/stored_bytes": {},
}
"""Every counter, with the values each of its labels takes: `start_counters` shows them at 0
before their first increment, so that a rate() has a first sample and an alert on errors reads 0,
not "no data". A label whose values are known only at run time (a pusher's targets) lists none:
the code that knows them starts those series (`metrics.inc(name, 0, target=...)`)."""


class Metrics(Protocol):
    def inc(self, name: str, value: float = 1.0, **labels: str) -> None: ...

    def set(self, name: str, value: float, **labels: str) -> None: ...

    def observe(self, name: str, value: float, **labels: str) -> None: ...


class NullMetrics:
    """Drops everything: the default sink."""

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        pass

    def set(self, name: str, value: float, **labels: str) -> None:
        pass

    def observe(self, name: str, value: float, **labels: str) -> None:
        pass


NULL_METRICS = NullMetrics()


def prometheus_name(name: str) -> str:
    """`agent/swap_pause_s` -> `weightsync_agent_swap_pause_s`."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"metric name {name!r} must be slash-namespaced lowercase, e.g. 'agent/swap_pause_s'")
    return "weightsync_" + name.replace("/", "_")


class PrometheusMetrics:
    """A Prometheus registry filled on first use of each name; `constant_labels` go on every series
    (e.g. agent name and region)."""

    def __init__(self, **constant_labels: str) -> None:
        import prometheus_client

        self._prom = prometheus_client
        self.registry = prometheus_client.CollectorRegistry()
        self._constant = dict(constant_labels)
        self._metrics: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()
        self._server = None

    def _get(self, kind: str, name: str, labels: dict[str, str]):
        key = (kind, name)
        metric = self._metrics.get(key)
        if metric is None:
            with self._lock:
                metric = self._metrics.get(key)
                if metric is None:
                    label_names = sorted({*self._constant, *labels})
                    full = prometheus_name(name)
                    doc = METRICS.get(name)
                    if doc is None:
                        raise ValueError(f"metric {name!r} is not declared: add it, with what it measures, to METRICS")
                    if kind == "counter":
                        metric = self._prom.Counter(full, doc, label_names, registry=self.registry)
                    elif kind == "gauge":
                        metric = self._prom.Gauge(full, doc, label_names, registry=self.registry)
                    else:
                        metric = self._prom.Histogram(
                            full, doc, label_names, registry=self.registry, buckets=DEFAULT_BUCKETS_S
                        )
                    self._metrics[key] = metric
        all_labels = {**self._constant, **labels}
        return metric.labels(**all_labels) if all_labels else metric

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self._get("counter", name, labels).inc(value)

    def start_counters(self, namespace: str) -> None:
        """Every counter of `namespace` ("agent", "publish") at 0, with each value of its labels
        (COUNTERS); those whose label values are known only at run time are left to their code."""
        for name, labels in COUNTERS.items():
            if name.split("/")[0] != namespace or any(not values for values in labels.values()):
                continue
            combos: list[dict[str, str]] = [{}]
            for label, values in labels.items():
                combos = [{**combo, label: value} for combo in combos for value in values]
            for combo in combos:
                self.inc(name, 0, **combo)

    def set(self, name: str, value: float, **labels: str) -> None:
        self._get("gauge", name, labels).set(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._get("histogram", name, labels).observe(value)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (what GET /metrics returns)."""
        return self._prom.generate_latest(self.registry)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serves GET /metrics on `host:port` (0: a free port) in a daemon thread; returns the port."""
        server, _ = self._prom.start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
