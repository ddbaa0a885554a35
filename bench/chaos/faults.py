"""faults: what a chaos round does to the cluster (kills, stalls, gc races, S3 faults, flipped
bytes at rest and stale caches), drawn from the run's seed, and the heal that ends them.

A mixin of Run (run.py), whose state it reads and counts into; links are faulted in run.py's round
through harness/tcp_relay.py. Not here: checking what the faults did (monitor.py, checks.py).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import time

from bench.chaos.config import FAULT_KINDS, FAULT_PROBABILITY, MODEL
from bench.chaos.processes import AgentProc


class Faults:
    """The fault actions of Run; each one that runs on a timer gets its own seeded generator."""

    def _draw_plan(self) -> dict[str, bool]:
        kinds = [
            k
            for k in FAULT_KINDS
            if (k != "s3_faults" or self.config.store == "s3") and (k != "stale_cache_restart" or self.snapshots)
        ]
        plan = {k: self.rng.random() < min(1.0, FAULT_PROBABILITY[k] * self.config.fault_scale) for k in kinds}
        if not any(plan.values()):
            plan[self.rng.choice(kinds)] = True
        return plan

    def _kill_publisher(self, rng: random.Random) -> None:
        self.details["kill_publisher_" + ("mid_publish" if self._publishing else "idle")] += 1
        self.publisher.kill()

    def _pick_agent(self, rng: random.Random) -> AgentProc | None:
        candidates = [a for a in self.agents.values() if a.up.is_set() and not a.stopped]
        return rng.choice(sorted(candidates, key=lambda a: a.name)) if candidates else None

    def _kill_agent(self, rng: random.Random) -> None:
        agent = self._pick_agent(rng)
        if agent is None:
            return
        with self._lock:
            latest = max(self._committed, default=0)
        behind = self.monitor.last.get(agent.name, (0, 0))[1] < latest
        phase = "during_publish" if self._publishing else ("mid_sync" if behind else "idle")
        self.details[f"kill_agent_{phase}"] += 1
        self.monitor.agent_killed(agent)
        agent.kill()
        # agent.stale stays as it is: a cache copied in stale is the agent's own only once the
        # monitor has seen it serve what it served before (round 84 of a 100-round S3 run killed
        # an agent right after its stale restart, and its restart served the stale version).
        self._background(self._restart_later, agent, rng.uniform(0.2, 3.0))

    def _restart_later(self, agent: AgentProc, delay_s: float) -> None:
        time.sleep(delay_s)
        agent.start(self.config.start_deadline_s)

    def _stall_agent(self, rng: random.Random) -> None:
        agent = self._pick_agent(rng)
        if agent is None:
            return
        agent.stopped = True
        os.kill(agent.proc.pid, signal.SIGSTOP)

        def resume(seconds: float) -> None:
            time.sleep(seconds)
            if agent.stopped and agent.proc.poll() is None:
                os.kill(agent.proc.pid, signal.SIGCONT)
            agent.stopped = False

        self._background(resume, rng.uniform(1.0, 6.0))

    def _gc(self, rng: random.Random) -> None:
        from weightsync.errors import WeightsyncError
        from weightsync.stores.retention import collect_garbage

        try:
            plan = collect_garbage(self.direct, MODEL, keep=self.config.gc_keep, grace_s=self.config.gc_grace_s)
            self.details["gc_versions_deleted"] += len(plan.delete_versions)
        except WeightsyncError as e:
            self.details["gc_errors"] += 1
            print(f"chaos: gc failed: {e}", file=sys.stderr, flush=True)

    def _start_s3_faults(self) -> None:
        from harness.fault_proxy import DELAY, FaultPlan
        from harness.fault_proxy import FAULT_KINDS as S3_KINDS

        total = self.rng.uniform(0.05, 0.25)
        kinds = self.rng.sample(list(S3_KINDS), self.rng.randint(2, len(S3_KINDS)))
        weights = [self.rng.random() for _ in kinds]
        rates = {k: total * w / sum(weights) for k, w in zip(kinds, weights, strict=True)}
        self.s3_proxy.set_plan(FaultPlan(rates=rates, seed=self.rng.randrange(2**31), delay_s=0.3))
        self.s3_proxy.enabled = True
        if DELAY in rates:
            self.details["s3_delay_rounds"] += 1

    def _stale_restart(self) -> None:
        name = self.rng.choice(sorted(self.snapshots))
        agent = self.agents[name]
        if not agent.up.is_set():
            return
        self.monitor.agent_killed(agent)
        agent.kill()
        shutil.rmtree(agent.cache, ignore_errors=True)
        shutil.copytree(self.snapshots[name], agent.cache)
        agent.stale = True
        self.details["stale_cache_restarts"] += 1
        self._background(self._restart_later, agent, 0.0)

    def _flip_store_object(self) -> None:
        from weightsync.errors import IntegrityError, WeightsyncError
        from weightsync.format.layout import model_prefix
        from weightsync.reader import Reader
        from weightsync.versions import latest_version, read_manifest

        version = latest_version(self.direct, MODEL)
        manifest = read_manifest(self.direct, MODEL, version)
        refs = [c for t in manifest.tensors for c in t.chunks if c.key]
        if not refs:
            return
        ref = self.rng.choice(refs)
        key = model_prefix(MODEL) + ref.key
        original = self.direct.get(key)
        corrupt = bytearray(original)
        corrupt[self.rng.randrange(len(corrupt))] ^= 1 << self.rng.randrange(8)
        self.direct.put(key, bytes(corrupt))
        self._corrupted.append((key, original))
        try:
            Reader(self.direct, model=MODEL, workers=1).verify(version)
        except IntegrityError:
            self.checks["store_corruptions_detected"] += 1
        except WeightsyncError as e:
            self.violation(
                "readable",
                "store",
                f"corrupt {key} of v{version} refused with {type(e).__name__}, not IntegrityError: {e}",
            )
        else:
            self.violation("readable", "store", f"v{version} verified with a flipped byte in {key}")

    def _flip_agent_cache(self) -> None:
        agent = self._pick_agent(self.rng)
        if agent is None:
            return
        files = [p for p in agent.cache.rglob("*") if p.is_file() and not p.name.startswith(".tmp")]
        chunks = [p for p in files if "chunks" in p.parts]
        manifests = [p for p in files if "versions" in p.parts]
        state = [p for p in files if p.name == "agent-state.json"]
        pool = self.rng.choices([chunks, manifests, state], weights=[0.7, 0.2, 0.1])[0] or chunks
        if not pool:
            return
        path = self.rng.choice(sorted(pool))
        try:
            with open(path, "r+b") as f:  # in place, as bit rot would
                size = f.seek(0, os.SEEK_END)
                if size == 0:
                    return
                at = self.rng.randrange(size)
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ (1 << self.rng.randrange(8))]))
        except FileNotFoundError:
            return  # collected by the agent meanwhile
        kind = "chunk" if path in chunks else "manifest" if path in manifests else "state"
        self.details[f"flip_agent_cache_{kind}"] += 1

    def _heal(self) -> None:
        """The faults stop: links heal, the S3 proxy passes through, stalled agents resume, corrupt
        store objects are restored, every killed process is back up."""
        if self.s3_proxy is not None:
            self.s3_proxy.enabled = False
        for proxy in self.proxies.values():
            proxy.partitioned = False
            proxy.flip_rate = 0.0
        for t in self._threads:
            t.join(timeout=self.config.start_deadline_s)
        self._threads = [t for t in self._threads if t.is_alive()]
        for key, original in self._corrupted:
            self.direct.put(key, original)
        self._corrupted.clear()
        for agent in self.agents.values():
            if not agent.up.is_set():
                self.violation("no_hang", agent.name, "still down after the faults stopped")
                agent.kill()
                agent.start(self.config.start_deadline_s)
