"""monitor: a thread that watches every agent while faults happen: what it serves, whether the
served bytes re-hash to the version's digest, whether versions go backwards, process RSS.

Not here: the checks at the end of a round (checks.py), injecting faults (faults.py).
"""

from __future__ import annotations

import collections
import os
import threading
import time
import traceback
from typing import TYPE_CHECKING

from bench.chaos.processes import AgentProc, http_json, rss_mb

if TYPE_CHECKING:
    from bench.chaos.run import Run


class Monitor:
    """Watches every agent while faults happen: what it serves (engine /v1/version), whether the
    served bytes re-hash to the version's digest (GetStatus verify), and process RSS."""

    def __init__(self, run: Run, interval_s: float = 0.3, verify_every_s: float = 1.5) -> None:
        self.run = run
        self.interval_s = interval_s
        self.verify_every_s = verify_every_s
        self.observations = 0
        self.verify_calls = 0
        self.verify_races = 0
        self.last: dict[str, tuple[int, int]] = {}  # agent -> (incarnation, version) last seen
        self.versions_served: dict[tuple[str, int], int] = {}  # (agent, incarnation) -> versions seen served
        self.max_seen: dict[str, int] = collections.defaultdict(int)  # agent -> highest version, this incarnation
        self.before_restart: dict[str, int] = {}  # agent -> highest version of the previous incarnation
        self.stale_windows: list[float] = []
        self._stale_since: dict[str, float] = {}
        self._unknown_since: dict[tuple[str, int], float] = {}
        self._next_verify: dict[str, float] = collections.defaultdict(float)
        self.rss_first: dict[tuple[str, str, int], float] = {}
        self.rss_peak: dict[str, float] = collections.defaultdict(float)
        self.rss_growth: dict[str, float] = collections.defaultdict(float)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def agent_killed(self, agent: AgentProc) -> None:
        self.before_restart[agent.name] = max(self.before_restart.get(agent.name, 0), self.max_seen[agent.name])

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            for agent in list(self.run.agents.values()):
                if agent.up.is_set() and not agent.stopped:
                    try:
                        self._observe(agent)
                    except Exception as e:  # noqa: BLE001 - a checker bug must be reported, not end the monitor
                        self.run.violation("monitor", agent.name, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            self._sample_rss()

    def _observe(self, agent: AgentProc) -> None:
        incarnation, url = agent.incarnation, agent.engine_url
        try:
            info = http_json(url + "/v1/version", timeout_s=2.0)
        except OSError:
            return  # killed, stopped or restarting: nothing is served by this process now
        version, digest = info.get("weight_version"), info.get("weight_digest")
        if version is None or incarnation != agent.incarnation:
            return
        self.observations += 1
        name = agent.name
        committed = self.run.committed_digest(version)
        if committed is None:  # not (yet) seen in the store: allowed only for the instant of a commit race
            first = self._unknown_since.setdefault((name, version), time.monotonic())
            if time.monotonic() - first > 15:
                self.run.violation("served_digest", name, f"serves v{version}, which the store never committed")
        elif committed != digest:
            self.run.violation("served_digest", name, f"serves v{version} with digest {digest}, committed {committed}")
        seen_incarnation, seen_version = self.last.get(name, (0, 0))
        if seen_incarnation == incarnation and version < seen_version:
            self.run.violation("monotonic", name, f"went back from v{seen_version} to v{version} in one process")
        if seen_incarnation != incarnation:  # the first version a restarted process serves
            self.max_seen[name] = 0
            before = self.before_restart.get(name, 0)
            if version < before:
                if agent.stale:
                    self._stale_since.setdefault(name, time.monotonic())
                else:
                    self.run.violation(
                        "monotonic",
                        name,
                        f"restarted on its own cache serving v{version}, "
                        f"older than the v{before} it served before it died",
                    )
            else:
                agent.stale = False  # caught up before we looked: its cache is its own from here
        if name in self._stale_since and version >= self.before_restart.get(name, 0):
            self.stale_windows.append(time.monotonic() - self._stale_since.pop(name))
            agent.stale = False
        if (incarnation, version) != self.last.get(name):
            self.versions_served[(name, incarnation)] = self.versions_served.get((name, incarnation), 0) + 1
        self.last[name] = (incarnation, version)
        self.max_seen[name] = max(self.max_seen[name], version)
        if time.monotonic() >= self._next_verify[name]:
            self._next_verify[name] = time.monotonic() + self.verify_every_s
            self.verify(agent)

    def verify(self, agent: AgentProc, *, final: bool = False) -> bool:
        """The agent re-hashes what it serves; a mismatch that persists on one version is a violation
        (one that goes away as the version changes is the re-hash racing a swap)."""
        from weightsync.errors import WeightsyncError

        mismatches = []
        for attempt in range(4):
            try:
                reply = self.run.client(agent).status(timeout_s=5, verify=True)
            except WeightsyncError:
                return False
            self.verify_calls += 1
            if not reply.served_digest:
                return False
            committed = self.run.committed_digest(reply.current_version)
            ok = reply.served_digest == reply.current_digest and committed in (None, reply.current_digest)
            if ok:
                if attempt:
                    self.verify_races += 1
                return True
            mismatches.append((reply.current_version, reply.current_digest, reply.served_digest, committed))
            if len({m[0] for m in mismatches}) > 1:  # the version changed under the re-hash: retry
                mismatches = mismatches[-1:]
            time.sleep(0.2)
        self.run.violation(
            "served_digest",
            agent.name,
            f"served bytes do not hash to the version digest (version, digest, re-hash, committed): {mismatches}",
        )
        return False

    def _sample_rss(self) -> None:
        # Only agents that are up: a restarted agent has its new pid from the moment it is spawned,
        # but its new incarnation only from its ready line; sampled in between, the new process
        # (still importing) would be measured against the old incarnation's baseline.
        processes = [("agent", a.name, a.incarnation, a.pid) for a in self.run.agents.values() if a.up.is_set()]
        publisher = self.run.publisher
        processes.append(("publisher", "publisher", publisher.incarnation, publisher.pid))
        processes.append(("driver", "driver", 0, os.getpid()))
        for kind, name, incarnation, pid in processes:
            if pid is None:
                continue
            rss = rss_mb(pid)
            if rss is None:
                continue
            self.rss_peak[kind] = max(self.rss_peak[kind], rss)
            # The baseline is taken once the process has done its first pieces of work: an agent
            # served two versions (the second a delta: the codec kernels, numba and LLVM are
            # loaded by then, a one-time ~100 MB that is no leak), the publisher committed one
            # (before that it is still importing).
            if kind == "agent":
                serving = self.versions_served.get((name, incarnation), 0) >= 2
            elif kind == "publisher":
                serving = self.run.publisher_worked == incarnation
            else:
                serving = True
            if not serving:
                continue
            key = (kind, name, incarnation)
            first = self.rss_first.setdefault(key, rss)
            self.rss_growth[kind] = max(self.rss_growth[kind], rss - first)
            if kind != "driver" and rss - first > self.run.config.rss_growth_bound_mb:
                self.run.violation(
                    "memory",
                    name,
                    f"RSS grew from {first:.0f} to {rss:.0f} MB (bound +{self.run.config.rss_growth_bound_mb:.0f} MB)",
                )
                self.rss_first[key] = rss  # report each excursion once
