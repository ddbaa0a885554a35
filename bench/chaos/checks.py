"""checks: what must hold once a round's faults stop: every agent converges on the latest version
within the bound, every version in the store verifies with the trainer's digest, each agent's
greedy completion equals the one computed here from the published weights, and so does every token
range of the long generations that ran during the round (per token step, per version).

A mixin of Run (run.py). Not here: the checks made while faults happen (monitor.py).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time

from bench.chaos.config import GENERATION_PROMPT, GENERATION_TOKENS, MODEL, PROMPT
from bench.chaos.processes import http_json


class Checks:
    """The end-of-round checks of Run."""

    def _check_generations(self, reader) -> None:
        """Every token range of the long generations that ran during the round's faults and swaps is
        what the published weights of its version generate (greedy) from the prompt and the tokens
        before it: the served bytes were a committed version's at every token step, whatever the
        swap policy (under drain and abort a response has one range)."""
        from weightsync.errors import WeightsyncError

        with self._lock:
            generations, self.generations = self.generations, []
        alone: dict[int, list[int]] = {}  # version -> what it generates from the prompt alone
        for name, answer in generations:
            completion = answer["completions"][0]
            tokens, ranges = completion["token_ids"], completion["versions"]
            policy = self.config.policy_of(name)
            if len(ranges) > 1:
                self.checks["generations_spanning_versions"] += 1
                if policy != "in_flight":
                    self.violation("served_digest", name, f"a {policy} response mixes versions {ranges}")
            for r in ranges:
                version, start, stop = r["version"], r["start"], r["stop"]
                expected = alone.get(version) if start == 0 else None
                if expected is None:
                    try:
                        state = reader.read(version)
                    except WeightsyncError:
                        self.checks["generation_ranges_unreadable"] += 1  # collected by gc meanwhile
                        continue
                    self.reference.swap(version, state.state_dict(), digest=state.manifest.digest)
                    body = {
                        "prompt_ids": [GENERATION_PROMPT + tokens[:start]],
                        "temperature": 0,
                        "stop": None,
                        "max_new_tokens": GENERATION_TOKENS - start,
                    }
                    expected = self.reference.handle_generate(json.dumps(body).encode())["completions"][0]["token_ids"]
                    if start == 0:
                        alone[version] = expected
                self.checks["generation_ranges_checked"] += 1
                self.checks[f"generation_ranges_checked_{policy}"] += 1
                if tokens[start:stop] != expected[: stop - start]:
                    self.violation(
                        "served_digest",
                        name,
                        f"tokens {start}..{stop} said to be v{version}'s are "
                        f"{tokens[start:stop]}; its published weights give "
                        f"{expected[: stop - start]}",
                    )

    def _converge(self, *, record: bool) -> None:
        latest = max(self.refresh_committed(), default=0)
        digest = self.committed_digest(latest)
        t0 = time.monotonic()
        deadline = t0 + self.config.convergence_bound_s
        pending = set(self.agents)
        while pending and time.monotonic() < deadline:
            for name in sorted(pending):
                with contextlib.suppress(OSError, ValueError):
                    info = http_json(self.agents[name].engine_url + "/v1/version", timeout_s=2.0)
                    if info["weight_version"] == latest and info["weight_digest"] == digest:
                        pending.discard(name)
            if pending:
                time.sleep(0.1)
        elapsed = time.monotonic() - t0
        if pending:
            errors = {}
            for name in pending:
                with contextlib.suppress(Exception):
                    errors[name] = self.client(self.agents[name]).status(timeout_s=5).last_error
            self.violation(
                "convergence",
                ",".join(sorted(pending)),
                f"not serving v{latest} {self.config.convergence_bound_s} s after the faults stopped; "
                f"last errors: {errors}",
            )
        elif record:
            self.convergence_s.append(elapsed)

    def _check_round(self) -> None:
        from weightsync.errors import WeightsyncError
        from weightsync.reader import Reader
        from weightsync.stores.retention import collect_garbage

        reader = Reader(self.direct, model=MODEL, workers=1)
        versions = self.refresh_committed()
        for version in versions:
            try:
                manifest = reader.verify(version)
            except WeightsyncError as e:
                if version in self.refresh_committed():  # not deleted by gc while we read it
                    self.violation("readable", "store", f"v{version}: {type(e).__name__}: {e}")
                continue
            self.checks["versions_verified"] += 1
            if self.expected.get(manifest.step) not in (None, manifest.digest):
                self.violation(
                    "readable",
                    "store",
                    f"v{version} (step {manifest.step}) has digest {manifest.digest}, "
                    f"the trainer's weights {self.expected[manifest.step]}",
                )
        for agent in self.agents.values():
            self.monitor.verify(agent, final=True)
        # What each agent's model answers, against the same engine code run here on the store's bytes
        # of the version it serves (whether it serves the latest is the convergence check's business).
        body = {"prompts": [PROMPT], "max_new_tokens": 8, "temperature": 0}
        expected: dict[int, list[int]] = {}
        for agent in self.agents.values():
            try:
                got = http_json(agent.engine_url + "/v1/generate", body, timeout_s=30)
            except OSError as e:
                self.violation("served_digest", agent.name, f"generate failed after convergence: {e}")
                continue
            version = got["weight_version"]
            if version not in expected:
                try:
                    state = reader.read(version)
                except WeightsyncError:
                    continue  # collected meanwhile: served_digest has checked it against its digest already
                self.reference.swap(version, state.state_dict(), digest=state.manifest.digest)
                expected[version] = self.reference.handle_generate(json.dumps(body).encode())["completions"][0][
                    "token_ids"
                ]
            self.checks["generation_checks"] += 1
            if got["completions"][0]["token_ids"] != expected[version]:
                self.violation(
                    "served_digest",
                    agent.name,
                    f"greedy completion {got['completions'][0]['token_ids']} "
                    f"on v{version}; its published weights give "
                    f"{expected[version]}",
                )
        self._check_generations(reader)
        try:
            collect_garbage(self.direct, MODEL, keep=self.config.gc_keep + 1, grace_s=self.config.gc_grace_s)
        except WeightsyncError as e:
            print(f"chaos: gc failed: {e}", file=sys.stderr, flush=True)
        if self.rng.random() < 0.35:  # a copy of some agent's cache, for a later stale-cache restart
            agent = self._pick_agent(self.rng)
            if agent is not None:
                target = self.work / "snapshots" / agent.name
                shutil.rmtree(target, ignore_errors=True)
                with contextlib.suppress(OSError, shutil.Error):  # files the agent deletes while we copy
                    shutil.copytree(agent.cache, target)
                    self.snapshots[agent.name] = target
