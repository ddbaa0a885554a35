"""run: one chaos cluster (a store, a publisher process, 2 regions x 2 agents behind TCP relays) and
its rounds: publish versions while faults hit, heal, converge, check; then a summary.

Not here: the faults' actions (faults.py), the invariants (monitor.py, checks.py), the command line
(__main__.py).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path

from bench.chaos.checks import Checks
from bench.chaos.config import (
    ARCH,
    FAULT_KINDS,
    GENERATION_PROMPT,
    GENERATION_TOKENS,
    MODEL,
    REGIONS,
    REPO,
    ChaosConfig,
)
from bench.chaos.faults import Faults
from bench.chaos.monitor import Monitor
from bench.chaos.processes import AgentProc, PublisherProc, free_port, http_json
from bench.chaos.publisher import expected_digest, fake_trainer
from harness.moto import MotoServer
from harness.tcp_relay import TcpRelay


class Run(Faults, Checks):
    """One cluster and its rounds."""

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.work = Path(config.workdir or tempfile.mkdtemp(prefix=f"chaos-{config.store}-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.round = 0
        self.step = 0
        self.faults: collections.Counter[str] = collections.Counter()
        self.details: collections.Counter[str] = collections.Counter()
        self.violations: list[dict] = []
        self.convergence_s: list[float] = []
        self.expected: dict[int, str] = {}  # trainer step -> digest of its bf16 weights
        self._committed: dict[int, str] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._corrupted: list[tuple[str, bytes]] = []
        self._publishing = False
        self.publisher_worked = 0  # the publisher incarnation that committed last
        self.snapshots: dict[str, Path] = {}
        self.agents: dict[str, AgentProc] = {}
        self._clients: dict[tuple[str, int], object] = {}
        self._closing = threading.Event()
        self.monitor: Monitor | None = None
        self.moto: MotoServer | None = None
        self.s3_proxy = None
        self.proxies: dict[str, TcpRelay] = {}
        self.checks: collections.Counter[str] = collections.Counter()

    # ---------------------------------------------------------------- setup and teardown

    def setup(self) -> None:
        from weightsync.stores import LocalStore
        from weightsync.transport.signing import Signer

        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if self.config.store == "s3":
            self.store_uri, self.direct = self._setup_s3(env)
        else:
            self.store_uri = f"file://{self.work / 'store'}"
            self.direct = LocalStore(self.work / "store")
        signer = Signer.generate()
        signer.write(self.work / "publisher.key", self.work / "publisher.pub")
        self.token = uuid.uuid4().hex
        (self.work / "token").write_text(self.token + "\n")
        ports = {f"{r}-{i}": free_port() for r in REGIONS for i in (1, 2)}
        for region in REGIONS:
            leader, follower = f"{region}-1", f"{region}-2"
            self.proxies[f"publisher->{leader}"] = TcpRelay(
                f"publisher->{leader}", ports[leader], random.Random(self.rng.random())
            )
            self.proxies[f"{leader}->{follower}"] = TcpRelay(
                f"{leader}->{follower}", ports[follower], random.Random(self.rng.random())
            )
            for name in (leader, follower):
                agent = AgentProc(name, region, ports[name], self.work, env)
                peers = [self.proxies[f"{leader}->{follower}"].address] if name == leader else []
                agent.write_config(
                    store=self.store_uri,
                    peers=peers,
                    token_file=self.work / "token",
                    public_key=self.work / "publisher.pub",
                    swap_policy=self.config.policy_of(name),
                )
                self.agents[name] = agent
        spec = {
            "store": self.store_uri,
            "seed": self.config.seed,
            "chunk_bytes": self.config.chunk_bytes,
            "rebase_every": self.config.rebase_every,
            "token": self.token,
            "push_give_up_s": 30.0,
            "signing_key": str(self.work / "publisher.key"),
            "targets": [self.proxies[f"publisher->{r}-1"].address for r in REGIONS],
        }
        (self.work / "publisher.json").write_text(json.dumps(spec))
        self.publisher = PublisherProc(self.work / "publisher.json", self.work / "publisher.log", env)
        self.trainer = fake_trainer(self.config.seed)
        # numba compiles the ctx and rans kernels on their first use (~20-25 s per element width on a
        # fresh clone) and caches them on disk: once here, not in five processes at once inside
        # round 1's convergence bound.
        from weightsync.format import codecs
        from weightsync.format.tensors import dtype_of

        codecs.warm_up({dtype_of(t).name for t in self.trainer.published().values()})
        starters = [
            threading.Thread(target=a.start, args=(self.config.start_deadline_s,)) for a in self.agents.values()
        ]
        starters.append(threading.Thread(target=self.publisher.start, args=(self.config.start_deadline_s,)))
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        if not self.publisher.alive() or not all(a.up.is_set() for a in self.agents.values()):
            raise RuntimeError(f"the cluster did not start; logs in {self.work}")
        from weightsync.agents.engines.reference_server import ReferenceServer, ReferenceServerConfig

        self.reference = ReferenceServer(ReferenceServerConfig(model=ARCH, torch_threads=1))
        self.monitor = Monitor(self)
        self.monitor.start()
        self.generations: list[tuple[str, dict]] = []  # (agent, response) of the long generations
        for agent in self.agents.values():
            threading.Thread(target=self._generate_loop, args=(agent,), daemon=True).start()

    def _setup_s3(self, env: dict):
        import boto3

        from harness.fault_proxy import FaultProxy
        from weightsync.stores.s3 import S3Store

        creds = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
        os.environ.update(creds)
        for name in [k for k in os.environ if k.startswith("AWS_") and k not in creds]:
            del os.environ[name]
        self.moto = MotoServer().start()
        endpoint = self.moto.endpoint
        bucket = f"chaos-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        self.s3_proxy = FaultProxy(endpoint)
        self.s3_proxy.start()
        self.s3_proxy.enabled = False
        env.update(creds, AWS_ENDPOINT_URL=self.s3_proxy.endpoint)
        return f"s3://{bucket}/chaos", S3Store(bucket, "chaos", endpoint_url=endpoint)

    def _generate_loop(self, agent: AgentProc) -> None:
        """Keeps a long greedy generation running on `agent`'s engine while faults and swaps happen;
        the end-of-round checks compare every token range of the answers with the weights of its
        version (checks.py). Failures (the agent killed, stalled) are the faults' business."""
        body = {"prompt_ids": [GENERATION_PROMPT], "max_new_tokens": GENERATION_TOKENS, "temperature": 0, "stop": None}
        while not self._closing.is_set():
            if not agent.up.is_set() or agent.engine_url is None:
                self._closing.wait(0.2)
                continue
            try:
                answer = http_json(agent.engine_url + "/v1/generate", body, timeout_s=30)
            except (OSError, ValueError):
                self._closing.wait(0.2)
                continue
            with self._lock:
                self.generations.append((agent.name, answer))

    def close(self) -> None:
        self._closing.set()
        if self.monitor is not None:
            self.monitor.stop()
        for t in self._threads:
            t.join(timeout=60)
        self.publisher.close()
        for agent in self.agents.values():
            agent.terminate()
        for proxy in self.proxies.values():
            proxy.close()
        if self.s3_proxy is not None:
            self.s3_proxy.stop()
        if self.moto is not None:
            self.moto.stop()
        for client in self._clients.values():
            client.close()
        if not self.config.keep_workdir and not self.violations:
            shutil.rmtree(self.work, ignore_errors=True)

    # ---------------------------------------------------------------- shared state

    def violation(self, invariant: str, who: str, detail: str) -> None:
        with self._lock:
            self.violations.append({"round": self.round, "invariant": invariant, "who": who, "detail": detail})
        print(f"chaos: VIOLATION round {self.round} {invariant} {who}: {detail}", file=sys.stderr, flush=True)

    def committed_digest(self, version: int) -> str | None:
        with self._lock:
            digest = self._committed.get(version)
        if digest is None:
            self.refresh_committed()
            with self._lock:
                digest = self._committed.get(version)
        return digest

    def refresh_committed(self) -> list[int]:
        from weightsync.errors import WeightsyncError
        from weightsync.versions import list_versions, read_manifest

        versions = list_versions(self.direct, MODEL)
        for v in versions:
            with self._lock:
                if v in self._committed:
                    continue
            try:
                manifest = read_manifest(self.direct, MODEL, v)
            except WeightsyncError:
                continue  # deleted by gc meanwhile
            with self._lock:
                self._committed[v] = manifest.digest
        return versions

    def client(self, agent: AgentProc):
        from weightsync.transport.rpc import AgentClient

        key = (agent.name, agent.incarnation)
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = self._clients[key] = AgentClient(agent.address, token=self.token)
        return client

    def _background(self, target, *args) -> None:
        t = threading.Thread(target=self._guarded, args=(target, *args), daemon=True)
        self._threads.append(t)
        t.start()

    def _guarded(self, target, *args) -> None:
        try:
            target(*args)
        except Exception as e:  # noqa: BLE001 - a fault action that fails is a finding, reported as one
            self.violation("no_hang", getattr(target, "__name__", "?"), f"{type(e).__name__}: {e}")

    # ---------------------------------------------------------------- rounds

    def warm_up(self) -> None:
        """Round 0: one version without faults, served everywhere: the state every round starts from."""
        self._publish(plan={})
        self._converge(record=False)

    def run_round(self, number: int) -> None:
        self.round = number
        plan = self._draw_plan()
        for kind, on in plan.items():
            self.faults[kind] += bool(on)
        print(
            f"chaos: round {number} {self.config.store}: {sorted(k for k, on in plan.items() if on)}",
            file=sys.stderr,
            flush=True,
        )
        if plan.get("s3_faults"):
            self._start_s3_faults()
        if plan.get("partition_leader"):
            leader = f"{self.rng.choice(REGIONS)}-1"
            for name, proxy in self.proxies.items():
                if leader in name:
                    proxy.partitioned = True
        if plan.get("flip_in_flight"):
            for proxy in self.rng.sample(sorted(self.proxies.values(), key=lambda p: p.name), self.rng.randint(1, 2)):
                proxy.flip_rate = self.rng.uniform(0.02, 0.12)
        if plan.get("stale_cache_restart"):
            self._stale_restart()
        n = self.config.versions_per_round
        at = {kind: self.rng.randrange(n) for kind in plan if plan[kind]}
        for i in range(n):
            self._publish(plan={k: on and at[k] == i for k, on in plan.items()})
            if plan.get("flip_store_object") and at["flip_store_object"] == i:
                self._flip_store_object()
            if plan.get("flip_agent_cache") and at["flip_agent_cache"] == i:
                self._flip_agent_cache()
        self._heal()
        self._converge(record=True)
        self._check_round()

    def _publish(self, plan: dict[str, bool]) -> None:
        """One trainer step, published; retried (after restarting a killed publisher) until committed."""
        step = self.step + 1
        self.trainer.advance_to(step)
        self.expected[step] = expected_digest(self.trainer.published(), self.config.chunk_bytes)
        skew_s = 0.0
        if plan.get("clock_skew"):
            skew_s = self.rng.choice(
                [
                    -time.time() + self.rng.uniform(0, 86400),  # near the epoch
                    -self.rng.uniform(1, 20) * 365 * 86400,  # years in the past
                    self.rng.uniform(1, 80) * 365 * 86400,
                ]
            )  # years in the future
            self.details["clock_skew_publishes"] += 1
        estimate_s = 70 * self.config.slow_s + 0.3
        for attempt in range(6):
            if not self.publisher.alive():
                self.publisher.start(self.config.start_deadline_s)
                self.details["publisher_restarts"] += 1
            timers = []
            if attempt == 0:
                for kind, action in (
                    ("kill_publisher", self._kill_publisher),
                    ("kill_agent", self._kill_agent),
                    ("stall_agent", self._stall_agent),
                    ("gc_during_publish", self._gc),
                ):
                    if plan.get(kind):
                        # Each action gets its own generator, drawn here: the plan stays a function
                        # of the seed although actions run on timer threads.
                        timers.append(
                            threading.Timer(
                                self.rng.uniform(0, 1.5 * estimate_s),
                                self._guarded,
                                args=(action, random.Random(self.rng.getrandbits(64))),
                            )
                        )
            self._publishing = True
            self.details["publish_attempts"] += 1
            self.publisher.send({"step": step, "slow_s": self.config.slow_s, "skew_s": skew_s})
            for t in timers:
                t.start()
            event = self.publisher.next_event(self.config.publish_deadline_s)
            self._publishing = False
            for t in timers:
                t.join()
            if event is None:
                self.violation(
                    "no_hang", "publisher", f"step {step}: no outcome within {self.config.publish_deadline_s} s"
                )
                self.publisher.kill()
            elif event["event"] == "committed":
                with self._lock:
                    self._committed[event["version"]] = event["digest"]
                self.details["versions_committed"] += 1
                self.publisher_worked = self.publisher.incarnation
                self.step = step  # a publisher killed right after this commit is restarted by the next publish
                return
            elif event["event"] == "failed":
                self.details["publish_failures"] += 1
                print(f"chaos: publish of step {step} failed: {event['error']}", file=sys.stderr, flush=True)
            # "died": the publisher was killed mid-publish; the loop restarts it and publishes the step again
        self.violation("no_hang", "publisher", f"step {step} never committed in 6 attempts")
        self.step = step

    # ---------------------------------------------------------------- summary

    def summary(self, wall_s: float) -> dict:
        times = sorted(self.convergence_s)
        monitor = self.monitor
        s3 = self.s3_proxy.counts() if self.s3_proxy is not None else {}
        return {
            "store": self.config.store,
            "swap_policies": {name: self.config.policy_of(name) for name in self.agents},
            "rounds": self.round,
            "versions_committed": self.details["versions_committed"],
            "faults": {k: self.faults[k] for k in FAULT_KINDS if k in self.faults},
            "fault_details": dict(sorted(self.details.items()))
            | {
                "flips_in_flight": sum(p.flips for p in self.proxies.values()),
                "s3_injected": s3,
                "stale_windows_max_s": round(max(monitor.stale_windows, default=0.0), 2),
            },
            "violations": len(self.violations),
            "violation_details": self.violations[:50],
            "convergence_s": {
                "p50": round(statistics.median(times), 2) if times else None,
                "p90": round(times[int(0.9 * (len(times) - 1))], 2) if times else None,
                "max": round(times[-1], 2) if times else None,
                "bound": self.config.convergence_bound_s,
            },
            "peak_rss_mb": {k: round(v, 1) for k, v in sorted(monitor.rss_peak.items())},
            "max_rss_growth_mb": {k: round(v, 1) for k, v in sorted(monitor.rss_growth.items())},
            "checks": dict(self.checks)
            | {
                "served_observations": monitor.observations,
                "verify_calls": monitor.verify_calls,
                "verify_races": monitor.verify_races,
            },
            "wall_s": round(wall_s, 1),
            "workdir": str(self.work) if (self.config.keep_workdir or self.violations) else None,
        }


def run_chaos(config: ChaosConfig) -> dict:
    """Runs `config.rounds` rounds on a fresh cluster; returns the summary (see the module docstring)."""
    t0 = time.monotonic()
    run = Run(config)
    try:
        run.setup()
        run.warm_up()
        for number in range(1, config.rounds + 1):
            run.run_round(number)
    except Exception as e:  # noqa: BLE001 - the summary must still be printed, with the failure in it
        run.violation("harness", "driver", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        with contextlib.suppress(Exception):
            run.close()
    return run.summary(time.monotonic() - t0)
