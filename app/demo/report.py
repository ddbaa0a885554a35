"""report: the demo's table per version, headline numbers and plot, from what the run left behind.

Sources: the store (each version's manifest: kind, bytes stored, changed elements, step), the
trainer's publish log (per version: when publish() was called and how long to commit), the
trainer's metrics (staleness per step), the agents' ledgers (when each agent served each version,
its swap pause) and the rollout workers' statistics (reward over time). Times are wall-clock on
one machine, so comparing them across processes is meaningful. Not here: running anything.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def build_report(config, root: Path, store, statuses: dict, queue) -> dict[str, Any]:
    from weightsync.versions import list_versions, read_manifest

    publish_log = {row["version"]: row for row in _jsonl(root / "trainer" / "publish.jsonl")}
    metrics = {row["step"]: row for row in _jsonl(root / "trainer" / "metrics.jsonl")}
    served: dict[int, dict[str, dict]] = {}
    for name, status in statuses.items():
        for entry in status.ledger:
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
                "parity": {name: a["parity"] for name, a in agents.items()},
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
    headline = (
        f"{len(rows)} versions ({len(deltas)} deltas, mean {statistics.fmean(r['ratio'] for r in deltas):.0f}x smaller "
        f"than the model) reached all {len(statuses)} agents in median {statistics.median(synced):.2f} s after "
        f"publish(); reward {first:.2f} -> {last:.2f} over {len(rewards)} sampled groups; rollouts used "
        f"{counts['claimed']}, dropped as stale {counts['dropped']}"
        if deltas and synced and rewards
        else f"{len(rows)} versions published"
    )
    return {
        "versions": rows,
        "rewards": rewards,
        "headline": headline,
        "table": _table(rows, list(statuses)),
        "reward_first": first,
        "reward_last": last,
        "rollout_groups": counts,
        "staleness": _staleness(config, rows, metrics, rewards),
        "parity": _parity_summary(rows),
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


def _parity_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every version and agent: how many probes ran, the worst figures, the breaches."""
    reports = [p for row in rows for p in row["parity"].values() if p is not None]
    mismatch = [p["expert_mismatch"] for p in reports if p["expert_mismatch"] is not None]
    return {
        "probes": len(reports),
        "max_abs_dlogprob": max((p["max_abs_dlogprob"] for p in reports), default=None),
        "mean_kl_max": max((p["mean_kl"] for p in reports), default=None),
        "expert_mismatch_max": max(mismatch, default=None),
        "breaches": sum(p["action"] != "ok" for p in reports),
        "probe_s_median": statistics.median(p["probe_s"] for p in reports) if reports else None,
        "probe_bytes_max": max((row["probe_bytes"] for row in rows), default=0),
    }


def _parity(entry) -> dict[str, Any] | None:
    """A ledger entry's parity report (status proto), as summary.json shows it."""
    if not entry.HasField("parity"):
        return None
    p = entry.parity
    return {
        "engine": p.engine,
        "max_abs_dlogprob": p.max_abs_dlogprob,
        "mean_kl": p.mean_kl,
        "expert_mismatch": p.expert_mismatch if p.HasField("expert_mismatch") else None,
        "tokens": p.tokens,
        "probe_s": p.probe_s,
        "action": p.action,
    }


def write_plot(summary: dict, path: Path) -> Path | None:
    """Reward over time, sync latency per version, stored bytes per version; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows, rewards = summary["versions"], summary["rewards"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 10))
    if rewards:
        t0 = rewards[0]["t"]
        xs = [r["t"] - t0 for r in rewards]
        window = 16
        smooth = [
            statistics.fmean(r["reward"] for r in rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))
        ]
        axes[0].plot(xs, [r["reward"] for r in rewards], ".", alpha=0.25, label="group mean reward")
        axes[0].plot(xs, smooth, "-", label=f"moving mean ({window} groups)")
        axes[0].set_xlabel("seconds since the first rollout")
        axes[0].set_ylabel("reward (exact answers)")
        axes[0].legend(loc="lower right")
    versions = [r["version"] for r in rows]
    axes[1].plot(versions, [r["to_all_agents_s"] for r in rows], "o-", label="publish() -> every agent serving")
    axes[1].plot(versions, [r["commit_s"] for r in rows], "s--", label="publish() -> committed in the store")
    axes[1].set_xlabel("version")
    axes[1].set_ylabel("seconds")
    axes[1].legend()
    axes[2].bar(
        versions,
        [r["stored_bytes"] / 1e3 for r in rows],
        color=["tab:orange" if r["kind"] == "full" else "tab:blue" for r in rows],
    )
    axes[2].set_yscale("log")
    axes[2].set_xlabel("version (orange: full, blue: delta)")
    axes[2].set_ylabel("kB stored")
    fig.suptitle(f"weightsync demo: {summary['headline'][:110]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
