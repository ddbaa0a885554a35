"""parity: after every swap, does the engine compute what the trainer computed?

A version's digest proves its bytes arrived. Its probe (`weightsync.format.probe`: fixed prompts,
the trainer's per-token log-probs, for MoE the experts its routers chose) lets the agent check the
numbers too: after each swap it asks the engine for the log-probs of the probe's prompts
(`Engine.prompt_logprobs`, where the engine has it) and reports

    max_abs_dlogprob   max over the probe's tokens of |engine log-prob - trainer log-prob|
    mean_kl            mean over the tokens of exp(d) - 1 - d, d = engine - trainer log-prob:
                       the k3 estimate of KL(trainer || engine) that RL libraries use for the
                       training/inference mismatch (>= 0, ~ d^2/2 for small d; exact KL needs
                       whole distributions, which engines do not return for every position)
    expert_mismatch    MoE: the fraction of tokens for which some sparse layer's top-k expert set
                       differs from the trainer's (engines that expose routing: the reference one)

What breaching a threshold does is the `[agent.parity]` action:
    warn     a WARNING log line
    alert    an ERROR log line and agent/parity_alerts (a counter an alert rule watches)
    refuse   the agent rolls back to the previous version (which it still holds), bit for bit,
             and never serves this one again (a newer version is tried as it comes)
Under warn and alert the probe runs on its own thread after the swap, so it never delays one:
a probe that finds a newer version served by the time it ran is dropped as superseded. Under
refuse it runs in the swap's path (the version only counts as served once it passed), and the
engine serves the version for that one probe's time: engines compute on what they serve.

The figures go in the ledger entry of the version (`parity`), in status (`parity`: the newest
report) and in the metrics agent/parity_max_abs_dlogprob, agent/parity_mean_kl,
agent/parity_expert_mismatch and agent/parity_probe_s.

Not here: the probe's format (`weightsync.format.probe`), computing it on the trainer
(`weightsync.models.probe`, `trainer/engine.py`), the rollback itself (`swap.py`).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import math
import threading
import time
from typing import Any

import numpy as np

from weightsync.agents.state import AgentState
from weightsync.errors import FormatError, WeightsyncError
from weightsync.format.manifest import Manifest
from weightsync.format.probe import Probe, probe_from_json
from weightsync.metrics import Metrics

log = logging.getLogger(__name__)

ACTIONS = ("warn", "alert", "refuse")


class ParityRefused(WeightsyncError):
    """A version whose probe breached the `[agent.parity]` thresholds under action "refuse"."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParityConfig:
    """`[agent.parity]`: when a probe's figures are a breach, and what a breach does."""

    enabled: bool = True
    """Run the probe after each swap (when the version has one and the engine can answer it)."""
    action: str = "warn"
    """What a breach does: "warn", "alert" or "refuse" (module docstring)."""
    max_abs_dlogprob: float = 0.5
    """Largest |engine - trainer| log-prob over the probe's tokens that is not a breach. bf16
    engines differ from an fp32 trainer by a few hundredths (docs/agents.md, "Parity probe")."""
    max_mean_kl: float = 0.01
    """Largest mean KL (k3 estimate) that is not a breach."""
    max_expert_mismatch: float = 0.1
    """MoE: largest fraction of tokens routed to another expert set that is not a breach."""
    timeout_s: float = 120.0
    """How long the engine may take to answer the probe; longer counts as no answer (logged)."""

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"parity action must be one of {list(ACTIONS)}, got {self.action!r}")
        for name in ("max_abs_dlogprob", "max_mean_kl", "max_expert_mismatch", "timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"parity {name} must be a number >= 0, got {value!r}")
        if self.max_expert_mismatch > 1:
            raise ValueError(f"parity max_expert_mismatch is a fraction in 0..1, got {self.max_expert_mismatch}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParityReport:
    """One probe of one served version."""

    version: int
    engine: str
    max_abs_dlogprob: float
    mean_kl: float
    expert_mismatch: float | None
    """None: a dense model, or an engine that does not expose its routing."""
    tokens: int
    probe_s: float
    """From the probe's start to the figures: the engine's answer and the comparison."""
    breaches: tuple[str, ...]
    """The thresholds breached, e.g. "max_abs_dlogprob 0.31 > 0.25"."""
    action: str
    """What was done: "ok" (no breach), or the configured action."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"breaches": list(self.breaches)}


def read_probe(manifest: Manifest) -> Probe | None:
    """The version's probe, None when its publisher wrote none; FormatError when it is damaged."""
    doc = manifest.producer.get("probe")
    return None if doc is None else probe_from_json(doc)


def compare(probe: Probe, logprobs: list[Any], experts: list[Any] | None) -> tuple[float, float, float | None, int]:
    """(max |d|, mean k3 KL, expert mismatch fraction or None, tokens compared) of an engine's
    answer against the probe; FormatError when the answer does not fit the prompts."""
    ours = probe.split_logprobs()
    if len(logprobs) != len(ours):
        raise FormatError(f"the engine answered {len(logprobs)} prompts of the probe's {len(ours)}")
    diffs = []
    for i, (theirs, mine) in enumerate(zip(logprobs, ours, strict=True)):
        theirs = np.asarray(_numpy(theirs), dtype=np.float64).reshape(-1)
        if theirs.size != mine.size:
            raise FormatError(f"the engine answered {theirs.size} log-probs for probe prompt {i}, not {mine.size}")
        diffs.append(theirs - mine.astype(np.float64))
    d = np.concatenate(diffs)
    if not np.isfinite(d).all():
        return math.inf, math.inf, _mismatch(probe, experts), int(d.size)
    return float(np.abs(d).max(initial=0.0)), float(np.mean(np.expm1(d) - d)), _mismatch(probe, experts), int(d.size)


def _mismatch(probe: Probe, experts: list[Any] | None) -> float | None:
    """The fraction of the probe's expert-recorded positions where any layer's expert set differs."""
    if probe.experts is None or experts is None:
        return None
    theirs = np.concatenate([np.asarray(_numpy(e)).reshape(-1, *probe.experts.shape[1:]) for e in experts])
    covered = probe.experts.shape[0]
    if theirs.shape[0] < covered or theirs.shape[1:] != probe.experts.shape[1:]:
        raise FormatError(f"the engine's expert choices have shape {theirs.shape}, the probe's {probe.experts.shape}")
    if covered == 0:
        return None
    differs = (np.sort(theirs[:covered], axis=-1) != probe.experts).any(axis=(1, 2))
    return float(differs.mean())


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        return value.detach().float().cpu().numpy() if value.is_floating_point() else value.detach().cpu().numpy()
    return np.asarray(value)


class ParityChecker:
    """Runs the probes of one agent (see the module docstring)."""

    def __init__(
        self,
        config: ParityConfig,
        engine: Any,
        state: AgentState,
        *,
        name: str,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.engine = engine
        self.state = state
        self.name = name
        self.metrics = metrics
        self.available = config.enabled and callable(getattr(engine, "prompt_logprobs", None))
        """Whether probes run at all: enabled, and the engine can answer one."""
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix=f"ws-agent-parity-{name}") if self.available else None
        self._lock = threading.Lock()
        self.last: ParityReport | None = None
        self.pending: cf.Future | None = None

    @property
    def blocking(self) -> bool:
        """Under "refuse" the probe runs in the swap's path (it decides whether the version stays)."""
        return self.available and self.config.action == "refuse"

    def after_swap(self, version: int, manifest: Manifest) -> ParityReport | None:
        """Probes `version`, just swapped in. Under refuse: now, raising ParityRefused on a breach.
        Otherwise: on the probe thread, returning None at once."""
        if not self.available:
            return None
        try:
            probe = read_probe(manifest)
        except FormatError as e:
            log.warning("%s: v%d carries a probe this agent cannot read (%s); no parity check", self.name, version, e)
            return None
        if probe is None:
            return None
        if self.blocking:
            report = self._run(version, probe)
            if report is not None and report.breaches:
                raise ParityRefused(
                    f"v{version} failed the parity probe on the {self.engine.name} engine "
                    f"({'; '.join(report.breaches)}): refused, the previous version is served again"
                )
            return report
        self.pending = self._pool.submit(self._run, version, probe)
        return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, version: int, probe: Probe) -> ParityReport | None:
        started = time.monotonic()
        if self.state.served_version > version:
            log.info("%s: parity probe of v%d skipped: a newer version is served", self.name, version)
            return None
        try:
            answer = self.engine.prompt_logprobs([list(p) for p in probe.prompts], timeout_s=self.config.timeout_s)
            if answer.version is not None and answer.version != version:
                log.info("%s: parity probe of v%d answered by v%d: dropped", self.name, version, answer.version)
                return None
            figures = compare(probe, answer.logprobs, answer.experts)
        except Exception as e:  # a probe must never take the agent down; it says why it has no figures
            log.warning(
                "%s: parity probe of v%d got no answer from the %s engine: %s", self.name, version, self.engine.name, e
            )
            self.metrics.inc("agent/parity_errors")
            return None
        report = self._judge(version, figures, time.monotonic() - started)
        self._publish(report)
        return report

    def _judge(self, version: int, figures: tuple[float, float, float | None, int], probe_s: float) -> ParityReport:
        max_abs, mean_kl, mismatch, tokens = figures
        c = self.config
        breaches = []
        if not max_abs <= c.max_abs_dlogprob:
            breaches.append(f"max_abs_dlogprob {max_abs:.4g} > {c.max_abs_dlogprob:g}")
        if not mean_kl <= c.max_mean_kl:
            breaches.append(f"mean_kl {mean_kl:.4g} > {c.max_mean_kl:g}")
        if mismatch is not None and not mismatch <= c.max_expert_mismatch:
            breaches.append(f"expert_mismatch {mismatch:.4g} > {c.max_expert_mismatch:g}")
        return ParityReport(
            version=version,
            engine=self.engine.name,
            max_abs_dlogprob=max_abs,
            mean_kl=mean_kl,
            expert_mismatch=mismatch,
            tokens=tokens,
            probe_s=probe_s,
            breaches=tuple(breaches),
            action=c.action if breaches else "ok",
        )

    def _publish(self, report: ParityReport) -> None:
        with self._lock:
            self.last = report
        m = self.metrics
        m.set("agent/parity_max_abs_dlogprob", report.max_abs_dlogprob)
        m.set("agent/parity_mean_kl", report.mean_kl)
        if report.expert_mismatch is not None:
            m.set("agent/parity_expert_mismatch", report.expert_mismatch)
        m.observe("agent/parity_probe_s", report.probe_s)
        with self.state.cond:  # the figures go into the version's ledger entry (status shows the newest too)
            self.state.ledger.entry(report.version).parity = report.to_json()
        figures = (
            f"max |dlogprob| {report.max_abs_dlogprob:.3g}, mean KL {report.mean_kl:.3g}"
            + (f", expert mismatch {report.expert_mismatch:.3g}" if report.expert_mismatch is not None else "")
            + f" over {report.tokens} tokens in {report.probe_s * 1000:.0f} ms"
        )
        if not report.breaches:
            log.info("%s: v%d parity ok on the %s engine: %s", self.name, report.version, report.engine, figures)
            return
        what = f"{self.name}: v{report.version} breaches parity on the {report.engine} engine ({'; '.join(report.breaches)}): {figures}"
        m.inc("agent/parity_breaches", action=report.action)
        if report.action == "warn":
            log.warning("%s", what)
        elif report.action == "alert":
            m.inc("agent/parity_alerts")
            log.error("%s", what)
        else:
            log.error("%s; refused, rolling back to the previous version", what)
