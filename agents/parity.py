"""parity: after every swap, does the engine compute what the trainer computed?

A version's digest proves its bytes arrived. Its probe (`weightsync.format.probe`: fixed prompts
of distinct tokens, the trainer's per-token log-probs from the weights as published in each
compute dtype engines serve in, for MoE the experts its routers chose, and its training forward's
top-k next tokens) lets the agent check the numbers too. After each swap it asks the engine for
the log-probs of the probe's prompts with its own top-k next tokens (`Engine.prompt_logprobs`,
where the engine has it), holds the engine to the record of the dtype it computes in, and
reports the figures of `parity_figures.py`:

    dlogprob_p50, dlogprob_p90   median and 90th percentile of |engine - trainer| log-prob: alarms
    expert_mismatch              MoE, engines that expose routing: an alarm
    max_abs_dlogprob             shown only
    gap_kl, gap_overlap          the training/inference gap on the tokens the policy would sample:
                                 a figure, an alarm only where max_gap_kl is set

An engine that computes in a dtype the trainer recorded nothing for (`train.publish.probe_dtypes`)
breaches too ("compute_dtype"): it does not compute what the trainer expects engines to. MoE probes
(those with expert choices) are judged by the `moe_` thresholds of the log-prob figures: kernels
that round otherwise flip near-tied router choices now and then, and a flip moves the tokens after it.

What breaching a threshold does is the `[agent.parity]` action:
    warn     a WARNING log line
    alert    an ERROR log line and agent/parity_alerts (a counter an alert rule watches)
    refuse   the version is refused for good, and the agent serves the newest version that
             passed, or nothing (`swap.py`, "refuse"; docs/agents.md says what to do next)
Under warn and alert the probe runs on its own thread after the swap, so it never delays one:
a probe that finds a newer version served by the time it ran is dropped as superseded. Under
refuse it runs in the swap's path (the version only counts as served once it passed), and the
engine serves the version for that one probe's time: engines compute on what they serve.

The figures go in the ledger entry of the version (`parity`), in status (`parity`: the newest
report) and in the metrics agent/parity_dlogprob_p50, agent/parity_dlogprob_p90,
agent/parity_max_abs_dlogprob, agent/parity_expert_mismatch, agent/parity_gap_kl and
agent/parity_probe_s. The defaults are calibrated on measured healthy runs (docs/agents.md,
"Parity probe"): a healthy engine breaches them with probability ~0.

Not here: the probe's format (`weightsync.format.probe`), computing it on the trainer
(`weightsync.trainer.probe`), the figures' arithmetic (`parity_figures.py`), what the agent
serves after a refusal (`swap.py`).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import threading
import time
from typing import Any

from weightsync.agents.parity_figures import Figures, compare
from weightsync.agents.state import AgentState
from weightsync.errors import FormatError, WeightsyncError
from weightsync.format.manifest import Manifest
from weightsync.format.probe import COMPUTE_DTYPES, Probe, probe_from_json
from weightsync.metrics import Metrics

log = logging.getLogger(__name__)

ACTIONS = ("warn", "alert", "refuse")


class ParityRefused(WeightsyncError):
    """A version whose probe breached the `[agent.parity]` thresholds under action "refuse"."""

    def __init__(self, message: str, report: ParityReport | None = None) -> None:
        super().__init__(message)
        self.report = report

    def __reduce__(self):
        return type(self), (str(self), self.report)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParityConfig:
    """`[agent.parity]`: when a probe's figures are a breach, and what a breach does. The
    thresholds' defaults sit far above the healthy runs measured in docs/agents.md ("Parity
    probe") and far below every wrong engine of tests/agents/test_parity_faults.py."""

    enabled: bool = True
    """Run the probe after each swap (when the version has one and the engine can answer it)."""
    action: str = "warn"
    """What a breach does: "warn", "alert" or "refuse" (module docstring)."""
    compute_dtype: str = "auto"
    """Which of the probe's records the engine is held to: "auto" (the dtype the engine says it
    computes in; the probe's first record for an engine that does not say), or a dtype name."""
    max_dlogprob_p50: float = 0.01
    """Dense models: the largest median |engine - trainer| log-prob that is not a breach. Healthy
    (docs/agents.md): 0 on the reference engine (bit for bit), at most 0.003 on vLLM bf16."""
    max_dlogprob_p90: float = 0.25
    """Dense models: the largest 90th percentile of |engine - trainer| log-prob that is not a
    breach: two bf16 rounding steps of a logit up to 32. Healthy: 0 on the reference engine, at
    most 0.034 on vLLM bf16 (one rounding step of the demo model's logits)."""
    moe_max_dlogprob_p50: float = 0.05
    """MoE models (a probe with expert choices): as max_dlogprob_p50. Engines whose MoE kernels
    round otherwise flip near-tied router choices, and a flipped choice moves the tokens after it:
    healthy vLLM bf16 reaches 0.018 (docs/agents.md)."""
    moe_max_dlogprob_p90: float = 0.8
    """MoE models: as max_dlogprob_p90; healthy vLLM bf16 reaches 0.27."""
    max_expert_mismatch: float = 0.05
    """MoE: largest fraction of positions routed to another expert set that is not a breach.
    Healthy: 0 (engines that expose routing hold the same bf16 router logits as the record)."""
    max_gap_kl: float | None = None
    """The training/inference gap (gap_kl) above which a version breaches; None: a figure only."""
    timeout_s: float = 120.0
    """How long the engine may take to answer the probe; longer counts as no answer (logged)."""

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"parity action must be one of {list(ACTIONS)}, got {self.action!r}")
        if self.compute_dtype not in ("auto", *COMPUTE_DTYPES):
            raise ValueError(
                f'parity compute_dtype must be "auto" or one of {list(COMPUTE_DTYPES)}, got {self.compute_dtype!r}'
            )
        thresholds = ("max_dlogprob_p50", "max_dlogprob_p90", "moe_max_dlogprob_p50", "moe_max_dlogprob_p90")
        for name in (*thresholds, "max_expert_mismatch", "max_gap_kl", "timeout_s"):
            value = getattr(self, name)
            if value is None and name == "max_gap_kl":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"parity {name} must be a number >= 0, got {value!r}")
        if self.max_expert_mismatch > 1:
            raise ValueError(f"parity max_expert_mismatch is a fraction in 0..1, got {self.max_expert_mismatch}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParityReport:
    """One probe of one served version: the figures (parity_figures.py) and the verdict."""

    version: int
    engine: str
    compute_dtype: str
    """The record the engine was held to."""
    dlogprob_p50: float | None
    """None (as the two below): the probe has no record of compute_dtype."""
    dlogprob_p90: float | None
    max_abs_dlogprob: float | None
    expert_mismatch: float | None
    """None: a dense model, or an engine that does not expose its routing."""
    expert_positions: int | None = None
    """MoE: the positions expert_mismatch is a fraction of (every prompt token, more than `tokens`)."""
    gap_kl: float | None
    """None: the probe has no training top-k, or the engine gives no top-k."""
    gap_overlap: float | None
    tokens: int
    probe_s: float
    """From the probe's start to the figures: the engine's answer and the comparison."""
    breaches: tuple[str, ...]
    """The thresholds breached, each starting with its figure's name, e.g. "dlogprob_p90 0.31 > 0.25"."""
    action: str
    """What was done: "ok" (no breach), or the configured action."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"breaches": list(self.breaches)}

    def describe(self) -> str:
        """The figures in words, for log lines."""
        parts = [f"held to its {self.compute_dtype} record"]
        if self.dlogprob_p50 is not None:
            parts.append(
                f"|dlogprob| median {self.dlogprob_p50:.3g}, p90 {self.dlogprob_p90:.3g}, max {self.max_abs_dlogprob:.3g}"
            )
        parts[-1] += f" over {self.tokens} tokens"
        if self.expert_mismatch is not None:
            parts.append(f"expert mismatch {self.expert_mismatch:.3g} over {self.expert_positions} positions")
        if self.gap_kl is not None:
            parts.append(f"training/inference gap KL {self.gap_kl:.3g} (top-k overlap {self.gap_overlap:.2f})")
        return "; ".join(parts) + f" in {self.probe_s * 1000:.0f} ms"


def read_probe(manifest: Manifest) -> Probe | None:
    """The version's probe, None when its publisher wrote none; FormatError when it is damaged."""
    doc = manifest.producer.get("probe")
    return None if doc is None else probe_from_json(doc)


def thresholds(config: ParityConfig, probe: Probe) -> dict[str, float | None]:
    """The threshold of each alarm figure for `probe` (MoE probes: the moe_ ones)."""
    moe = probe.records[0].experts is not None
    return {
        "dlogprob_p50": config.moe_max_dlogprob_p50 if moe else config.max_dlogprob_p50,
        "dlogprob_p90": config.moe_max_dlogprob_p90 if moe else config.max_dlogprob_p90,
        "expert_mismatch": config.max_expert_mismatch,
        "gap_kl": config.max_gap_kl,
    }


def judge(config: ParityConfig, figures: Figures, probe: Probe) -> tuple[str, ...]:
    """The breaches of `config`'s thresholds by `figures`, an engine's answer to `probe`."""
    if not figures.recorded:
        return (
            f"compute_dtype {figures.compute_dtype}: the trainer recorded {', '.join(probe.compute_dtypes)} only "
            "(train.publish.probe_dtypes)",
        )
    limits = thresholds(config, probe)
    checks = [(name, getattr(figures, name), limit) for name, limit in limits.items()]
    return tuple(
        f"{name} {value:.4g} > {limit:g}"
        for name, value, limit in checks
        if value is not None and limit is not None and not value <= limit
    )


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
                    f"v{version} failed the parity probe on the {self.engine.name} engine ({'; '.join(report.breaches)})",
                    report,
                )
            return report
        self._pool.submit(self._run, version, probe)
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
            top_k = probe.training.k if probe.training is not None else 0
            answer = self.engine.prompt_logprobs(
                [list(p) for p in probe.prompts], timeout_s=self.config.timeout_s, top_k=top_k
            )
            if answer.version is not None and answer.version != version:
                log.info("%s: parity probe of v%d answered by v%d: dropped", self.name, version, answer.version)
                return None
            dtype = self.config.compute_dtype
            if dtype == "auto":
                dtype = answer.compute_dtype or probe.compute_dtypes[0]
            figures = compare(probe, dtype, answer.logprobs, answer.experts, answer.top_ids, answer.top_logprobs)
        except Exception as e:  # a probe must never take the agent down; it says why it has no figures
            log.warning(
                "%s: parity probe of v%d got no answer from the %s engine: %s", self.name, version, self.engine.name, e
            )
            self.metrics.inc("agent/parity_errors")
            return None
        breaches = judge(self.config, figures, probe)
        report = ParityReport(
            version=version,
            engine=self.engine.name,
            compute_dtype=figures.compute_dtype,
            dlogprob_p50=figures.dlogprob_p50,
            dlogprob_p90=figures.dlogprob_p90,
            max_abs_dlogprob=figures.max_abs_dlogprob,
            expert_mismatch=figures.expert_mismatch,
            expert_positions=figures.expert_positions,
            gap_kl=figures.gap_kl,
            gap_overlap=figures.gap_overlap,
            tokens=figures.tokens,
            probe_s=time.monotonic() - started,
            breaches=breaches,
            action=self.config.action if breaches else "ok",
        )
        self._publish(report)
        return report

    def _publish(self, report: ParityReport) -> None:
        with self._lock:
            self.last = report
        m = self.metrics
        if report.dlogprob_p50 is not None:  # None: no record of the engine's dtype, nothing compared
            m.set("agent/parity_dlogprob_p50", report.dlogprob_p50)
            m.set("agent/parity_dlogprob_p90", report.dlogprob_p90)
            m.set("agent/parity_max_abs_dlogprob", report.max_abs_dlogprob)
        if report.expert_mismatch is not None:
            m.set("agent/parity_expert_mismatch", report.expert_mismatch)
        if report.gap_kl is not None:
            m.set("agent/parity_gap_kl", report.gap_kl)
        m.observe("agent/parity_probe_s", report.probe_s)
        with self.state.cond:  # the figures go into the version's ledger entry (status shows the newest too)
            self.state.ledger.entry(report.version).parity = report.to_json()
        if not report.breaches:
            log.info(
                "%s: v%d parity ok on the %s engine: %s", self.name, report.version, report.engine, report.describe()
            )
            return
        what = (
            f"{self.name}: v{report.version} breaches parity on the {report.engine} engine "
            f"({'; '.join(report.breaches)}): {report.describe()}"
        )
        m.inc("agent/parity_breaches", action=report.action)
        if report.action == "warn":
            log.warning("%s", what)
        elif report.action == "alert":
            m.inc("agent/parity_alerts")
            log.error("%s", what)
        else:  # what the agent serves instead is logged by its refuse rule (swap.py)
            log.error("%s; refused", what)
