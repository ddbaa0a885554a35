"""report: the demo's table per version, headline numbers and plot, from what the run left behind.

Sources: the store (each version's manifest: kind, bytes stored, changed elements, step), the
trainer's publish log (per version: when publish() was called and how long to commit), the
trainer's metrics (staleness per step), the agents' ledgers (when each agent served each version,
its swap pause) and the rollout workers' statistics (reward over time). Times are wall-clock on
one machine, so comparing them across processes is meaningful. Not here: running anything.
"""

from __future__ import annotations

import bisect
import itertools
import json
import statistics
import textwrap
from pathlib import Path
from typing import Any


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def build_report(config, root: Path, store, statuses: dict, queue, parity_config) -> dict[str, Any]:
    """The report of a finished run; `parity_config`: the [agent.parity] settings the agents ran with."""
    from weightsync.versions import list_versions, read_manifest

    publish_log = {row["version"]: row for row in _jsonl(root / "trainer" / "publish.jsonl")}
    metrics = {row["step"]: row for row in _jsonl(root / "trainer" / "metrics.jsonl")}
    served: dict[int, dict[str, dict]] = {}
    refused: dict[int, dict[str, dict]] = {}
    timeline: dict[str, list[list[float]]] = {}
    for name, status in statuses.items():
        for entry in status.ledger:
            if entry.outcome == "refused":  # the parity probe's refuse rule: never served
                refused.setdefault(entry.version, {})[name] = _parity(entry)
            if entry.outcome == "served" and entry.served_unix_ms:
                timeline.setdefault(name, []).append([entry.served_unix_ms / 1000, entry.version])
            if entry.outcome == "served":
                served.setdefault(entry.version, {})[name] = {
                    "served_unix_ms": entry.served_unix_ms,
                    "swap_pause_s": entry.timings_s.get("swap_pause"),
                    "path": entry.path,
                    "bytes_fetched": entry.bytes_fetched,
                    "timings_s": dict(entry.timings_s),
                    "parity": _parity(entry),
                }
    rows = []
    for version in list_versions(store, config.model):
        manifest = read_manifest(store, config.model, version)
        published = publish_log.get(version, {})
        call_ms = published.get("publish_call_unix_ms")
        agents = served.get(version, {})
        to_agents = {name: (a["served_unix_ms"] - call_ms) / 1000 for name, a in agents.items() if call_ms}
        pauses = [a["swap_pause_s"] for a in agents.values() if a["swap_pause_s"] is not None]
        stats = manifest.stats
        stored = manifest.stored_bytes + len(manifest.to_bytes())
        step = manifest.step or 0
        rows.append(
            {
                "version": version,
                "step": step,
                "phase": "warm-up" if step <= config.warmup_steps else "grpo",
                "kind": manifest.kind,
                "changed_fraction": stats.get("changed_elements", 0) / max(1, stats.get("total_elements", 1)),
                "raw_bytes": manifest.raw_bytes,
                "stored_bytes": stored,
                "ratio": manifest.raw_bytes / stored,
                "commit_s": published.get("latency_s"),
                "to_agents_s": to_agents,
                "to_all_agents_s": max(to_agents.values()) if len(to_agents) == len(statuses) else None,
                "swap_pause_ms_max": 1000 * max(pauses) if pauses else None,
                "staleness_steps": metrics.get(step, {}).get("data/staleness_steps"),
                "fetched_from_store": sum(a["bytes_fetched"] for a in agents.values()),
                # Each agent's ledger timings: drain (waiting for requests on the buffer to be
                # rebuilt), push_wait, fetch, gather, apply, swap, total, since_offer.
                "agent_timings_s": {name: a["timings_s"] for name, a in agents.items()},
                # The parity probe per agent (agents/parity.py): the engine's log-probs for the
                # version's probe prompts against the trainer's; None where it had not run yet.
                "probe_bytes": len(json.dumps(manifest.producer["probe"])) if "probe" in manifest.producer else 0,
                "parity": {name: a["parity"] for name, a in agents.items()} | refused.get(version, {}),
                "refused_by": sorted(refused.get(version, {})),
            }
        )
    rewards = sorted(
        (row for path in sorted((root / "rollouts").glob("stats-w*.jsonl")) for row in _jsonl(path)),
        key=lambda r: r["t"],
    )
    deltas = [r for r in rows if r["kind"] == "delta"]
    synced = [r["to_all_agents_s"] for r in rows if r["to_all_agents_s"] is not None]
    first, last = _reward_window(rewards, head=True), _reward_window(rewards, head=False)
    counts = queue.counts()
    parity = _parity_summary(rows, parity_config, moe=bool(config.architecture.get("num_experts")))
    headline = (
        f"{len(rows)} versions ({len(deltas)} deltas, mean {statistics.fmean(r['ratio'] for r in deltas):.0f}x smaller "
        f"than the model) reached all {len(statuses)} agents in median {statistics.median(synced):.2f} s after "
        f"publish(); reward {first:.2f} -> {last:.2f} over {len(rewards)} sampled groups; rollouts used "
        f"{counts['claimed']}, dropped as stale {counts['dropped']}"
        if deltas and synced and rewards
        else f"{len(rows)} versions published"
    )
    if parity["probes"]:
        headline += f"; parity probe: {parity['breaches']} breaches in {parity['probes']} probes"
    return {
        "versions": rows,
        "rewards": rewards,
        "headline": headline,
        "table": _table(rows, list(statuses)),
        "reward_first": first,
        "reward_last": last,
        "rollout_groups": counts,
        "staleness": _staleness(config, rows, metrics, rewards),
        "parity": parity,
        # Per agent, [unix seconds, version] each time it began serving a version; and the commits.
        "served_timeline": {name: sorted(points) for name, points in timeline.items()},
        "commits": [
            [(row["publish_call_unix_ms"] / 1000 + row["latency_s"]), v]
            for v, row in sorted(publish_log.items())
            if row.get("latency_s") is not None
        ],
    }


def _staleness(config, rows: list[dict], metrics: dict[int, dict], rewards: list[dict]) -> dict[str, Any]:
    """How stale what the trainer learned from was under this run's swap policy: the trainer's
    per-step mean staleness (steps between the weights that sampled a rollout and the trainer's
    own), and how long versions took to reach every agent during GRPO (what staleness follows)."""
    steps = [
        m["data/staleness_steps"]
        for step, m in sorted(metrics.items())
        if step > config.warmup_steps and m.get("data/staleness_steps") is not None
    ]
    synced = [r["to_all_agents_s"] for r in rows if r["phase"] == "grpo" and r["to_all_agents_s"] is not None]
    mixed = sum(1 for r in rewards if len(r.get("versions", [])) > 1)
    return {
        "swap_policy": config.swap_policy,
        "rollout_tokens": config.rollout_tokens,
        "mean_steps": statistics.fmean(steps) if steps else None,
        "max_steps": max(steps) if steps else None,
        "grpo_to_all_agents_s": {
            "median": statistics.median(synced) if synced else None,
            "max": max(synced) if synced else None,
        },
        "groups_spanning_versions": mixed,
        "groups_restarted": sum(1 for r in rewards if r.get("restarts")),
    }


def _reward_window(rewards: list[dict], *, head: bool, size: int = 40) -> float:
    window = rewards[:size] if head else rewards[-size:]
    return statistics.fmean(r["reward"] for r in window) if window else float("nan")


def _table(rows: list[dict], agents: list[str]) -> list[str]:
    header = (
        f"{'version':>7} {'step':>4} {'phase':>7} {'kind':>5} {'changed':>8} {'stored':>9} {'ratio':>6} "
        f"{'commit':>7} {'all agents':>10} {'pause':>8} {'stale':>5}"
    )
    lines = [header]
    for r in rows:

        def fmt(value, spec, unit=""):
            return "-" if value is None else f"{value:{spec}}{unit}"

        lines.append(
            f"{r['version']:>7} {r['step']:>4} {r['phase']:>7} {r['kind']:>5} {100 * r['changed_fraction']:>7.2f}% "
            f"{r['stored_bytes'] / 1e3:>7.1f}kB {r['ratio']:>5.1f}x {fmt(r['commit_s'], '.3f', 's'):>7} "
            f"{fmt(r['to_all_agents_s'], '.3f', 's'):>10} {fmt(r['swap_pause_ms_max'], '.2f', 'ms'):>8} "
            f"{fmt(r['staleness_steps'], '.1f'):>5}"
        )
    lines.append(
        f"(all agents: publish() call to the last of {len(agents)} agents serving it; pause: the longest "
        "swap pause any agent's clients saw; stale: mean staleness in steps of the rollouts trained on)"
    )
    return lines


PARITY_FIGURES = ("dlogprob_p50", "dlogprob_p90", "max_abs_dlogprob", "expert_mismatch", "gap_kl")
"""The figures of a parity report (agents/parity_figures.py) the summary gives distributions of."""


def _parity_summary(rows: list[dict[str, Any]], config, *, moe: bool) -> dict[str, Any]:
    """Over every version and agent: how many probes ran, each figure's distribution (median, p99,
    max), the thresholds they were judged by (`config`'s, the moe_ ones for a MoE model), and every breach."""
    reports = [(row["version"], name, p) for row in rows for name, p in row["parity"].items() if p is not None]
    figures = {}
    for figure in PARITY_FIGURES:
        values = sorted(p[figure] for _, _, p in reports if p.get(figure) is not None)
        if values:
            figures[figure] = {
                "median": statistics.median(values),
                "p99": values[min(len(values) - 1, int(0.99 * len(values)))],
                "max": values[-1],
            }
    return {
        "probes": len(reports),
        "breaches": sum(p["action"] != "ok" for _, _, p in reports),
        "breached": [
            {"version": v, "agent": n, "breaches": p["breaches"], "action": p["action"]}
            for v, n, p in reports
            if p["action"] != "ok"
        ],  # fmt: skip
        "compute_dtypes": sorted({p["compute_dtype"] for _, _, p in reports}),
        "figures": figures,
        "thresholds": {
            "dlogprob_p50": config.moe_max_dlogprob_p50 if moe else config.max_dlogprob_p50,
            "dlogprob_p90": config.moe_max_dlogprob_p90 if moe else config.max_dlogprob_p90,
            "expert_mismatch": config.max_expert_mismatch,
            "gap_kl": config.max_gap_kl,
        },
        "probe_s_median": statistics.median(p["probe_s"] for _, _, p in reports) if reports else None,
        "probe_bytes_max": max((row["probe_bytes"] for row in rows), default=0),
    }


def _parity(entry) -> dict[str, Any] | None:
    """A ledger entry's parity report (status proto), as summary.json shows it."""
    if not entry.HasField("parity"):
        return None
    p = entry.parity
    optional = ("dlogprob_p50", "dlogprob_p90", "max_abs_dlogprob", "expert_mismatch", "gap_kl", "gap_overlap")
    return {
        "engine": p.engine,
        "compute_dtype": p.compute_dtype,
        **{name: getattr(p, name) if p.HasField(name) else None for name in optional},
        "tokens": p.tokens,
        "probe_s": p.probe_s,
        "breaches": list(p.breaches),
        "action": p.action,
    }


def write_plot(summary: dict, path: Path) -> Path | None:
    """Reward over time, each agent's served version over time, sync latency per version, the
    parity probe per version with its thresholds, stored bytes per version; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows, rewards = summary["versions"], summary["rewards"]
    fig, axes = plt.subplots(5, 1, figsize=(10, 19))
    commits = summary.get("commits") or []
    t0 = min([c[0] for c in commits] + [r["t"] for r in rewards[:1]], default=0.0)
    if rewards:
        xs = [r["t"] - t0 for r in rewards]
        window = 16
        smooth = [
            statistics.fmean(r["reward"] for r in rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))
        ]
        axes[0].plot(xs, [r["reward"] for r in rewards], ".", alpha=0.25, label="group mean reward")
        axes[0].plot(xs, smooth, "-", label=f"moving mean ({window} groups)")
        axes[0].set_xlabel("seconds since the first commit")
        axes[0].set_ylabel("reward (exact answers)")
        axes[0].legend(loc="lower right")
    _plot_served(axes[1], summary, t0)
    _plot_latency(axes[2], rows)
    _plot_parity(axes[3], rows, summary["parity"])
    versions = [r["version"] for r in rows]
    axes[4].bar(
        versions,
        [r["stored_bytes"] / 1e3 for r in rows],
        color=["tab:orange" if r["kind"] == "full" else "tab:blue" for r in rows],
    )
    axes[4].set_yscale("log")
    axes[4].set_xlabel("version (orange: full, blue: delta)")
    axes[4].set_ylabel("kB stored")
    title = textwrap.wrap(f"weightsync demo: {summary['headline']}", width=120)
    fig.suptitle("\n".join(title), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.007 * len(title)))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_served(ax, summary: dict, t0: float) -> None:
    """Each agent's served version over time, as how many versions it was behind the newest
    commit (0: the newest); the legend counts the versions it skipped (never served)."""
    commits = sorted(summary.get("commits") or [])
    if not commits:
        return
    newest = [c[1] for c in commits]
    times = [c[0] for c in commits]
    for name, points in sorted(summary.get("served_timeline", {}).items()):
        events = sorted([(t, "commit", v) for t, v in commits] + [(t, "served", v) for t, v in points])
        served, xs, lags = 0, [], []
        for t, kind, version in events:
            if kind == "served":
                served = version
            committed = newest[max(0, bisect.bisect_right(times, t) - 1)] if t >= times[0] else 0
            xs.append(t - t0)
            lags.append(max(0, committed - served))
        versions = [v for _, v in points]
        skipped = sum(b - a - 1 for a, b in itertools.pairwise(versions) if b > a + 1)
        ax.step(xs, lags, where="post", lw=0.8, alpha=0.8, label=f"{name} (skipped {skipped} of {newest[-1]})")
    ax.set_xlabel("seconds since the first commit")
    ax.set_ylabel("versions behind the newest commit")
    ax.set_title("each agent's served version over time (a drop of more than one: versions skipped)", fontsize=9)
    ax.legend(loc="upper left", fontsize=8, ncol=2)


def _plot_latency(ax, rows: list[dict]) -> None:
    """publish() -> served per agent for every version it served, every agent's, and the commit."""
    agents = sorted({name for r in rows for name in r["to_agents_s"]})
    for name in agents:
        points = [(r["version"], r["to_agents_s"][name]) for r in rows if name in r["to_agents_s"]]
        ax.plot([v for v, _ in points], [s for _, s in points], ".", ms=3, alpha=0.5, label=f"-> {name} serving")
    ax.plot(
        [r["version"] for r in rows], [r["to_all_agents_s"] for r in rows], "o-", ms=3, label="-> every agent serving"
    )
    ax.plot([r["version"] for r in rows], [r["commit_s"] for r in rows], "s--", ms=3, label="-> committed in the store")
    ax.set_xlabel("version (an agent that skipped a version has no point for it)")
    ax.set_ylabel("seconds after publish()")
    ax.legend(fontsize=8, ncol=2)


def _plot_parity(ax, rows: list[dict], parity: dict) -> None:
    """Per version, the worst of each parity figure over the agents, with its threshold; breaches in red."""
    colors = {"dlogprob_p50": "tab:blue", "dlogprob_p90": "tab:green", "expert_mismatch": "tab:purple"}
    thresholds = parity.get("thresholds", {})
    for figure, color in colors.items():
        points = [
            (r["version"], max(values))
            for r in rows
            if (values := [p[figure] for p in r["parity"].values() if p and p.get(figure) is not None])
        ]
        if not points:
            continue
        ax.plot([v for v, _ in points], [x for _, x in points], ".-", ms=3, lw=0.8, color=color, label=figure)
        if thresholds.get(figure) is not None:
            ax.axhline(thresholds[figure], color=color, ls="--", lw=1, label=f"{figure} threshold")
    gap = [(r["version"], max(v)) for r in rows if (v := [p["gap_kl"] for p in r["parity"].values() if p and p.get("gap_kl") is not None])]  # fmt: skip
    if gap:
        ax.plot([v for v, _ in gap], [x for _, x in gap], ".", ms=3, color="tab:gray", label="gap_kl (a figure)")
    breached = [b["version"] for b in parity.get("breached", [])]
    if breached:
        ax.plot(breached, [max(thresholds.get("dlogprob_p90") or 1, 1)] * len(breached), "rx", ms=8, label="breach")
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_xlabel("version")
    ax.set_ylabel("engine vs trainer (worst agent)")
    ax.set_title(
        f"parity probe: {parity.get('breaches', 0)} breaches in {parity.get('probes', 0)} probes "
        f"(records: {', '.join(parity.get('compute_dtypes', [])) or '-'})",
        fontsize=9,
    )
    ax.legend(fontsize=7, ncol=3, loc="upper left")
