"""sync_report: the sync latency benchmark's record as JSON, markdown tables per theme, and PNG plots.

Reads only the record `bench/sync_latency.py` builds (see there for what each cell holds); writes
`<dir>/sync-latency[-quick]-<cores>cpu-<arch>-<date>.{json,md}` and `...-<plot>.png`. Not here:
measuring anything.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

_BASELINES = (
    ("full_store", "full safetensors via store"),
    ("shardcast", "shardcast"),
    ("zstd_patch", "zstd --patch-from"),
)


def _cores(hardware: dict) -> int:
    """Records written before harness.describe_machine() named the core count "cpus"; re-rendering them still works."""
    return hardware.get("cores", hardware.get("cpus"))


def stem(record: dict, directory: Path) -> Path:
    hw = record["hardware"]
    label = record.get("label") or ("quick" if record.get("quick") else "")
    kind = f"sync-latency-{label}" if label else "sync-latency"
    return directory / f"{kind}-{_cores(hw)}cpu-{hw['machine']}-{record['date']}"


def _done(record: dict) -> list[dict]:
    return [c for c in record["cells"] if "ours" in c]


def _s(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else "—"


def _baseline_cell(cell: dict, name: str) -> str:
    b = cell.get("baselines", {}).get(name, {})
    if "all_s" in b:
        return f"{b['all_s']:.2f} ({cell['speedup'][name]:.1f}x)"
    return "skipped" if "skipped" in b else "error" if "error" in b else "—"


def _cpus(plan) -> str:
    """The run's CPU split (bench/sync_latency.py `--cpus-per-agent`), in words."""
    if not isinstance(plan, dict):
        return "every process may run on every CPU (agents, publisher and baselines share them)."
    each = plan["per_receiver"]
    return (
        f"each agent (and each baseline receiver) on {len(each[0])} CPU(s) of its own, as on its own machine "
        f"({', '.join(str(c) for c in each)}); the publisher's site (driver, publisher, store server, baseline "
        f"sender, shardcast's origin and middle nodes) on CPUs {plan['trainer_site']}."
    )


def headline(record: dict) -> list[str]:
    cells = _done(record)
    if not cells:
        return ["No cell finished yet."]
    lr0, store0 = record["config"]["lrs"][0], record["config"]["stores"][0]
    lines = []
    big = max(c["size_gib"] for c in cells)
    ours = {}  # agents -> median steady time, per size (repeated cells count once, by their median)
    for size in sorted({c["size_gib"] for c in cells}, reverse=True):
        for n in sorted({c["agents"] for c in cells if c["size_gib"] == size}):
            runs = [c for c in cells if (c["size_gib"], c["lr"], c["agents"], c["store"]) == (size, lr0, n, store0)]
            if not runs:
                continue
            ours[size, n] = statistics.median(c["ours"]["steady"]["all_agents_s"] for c in runs)
            if size != big:
                continue
            parts = []
            for name, label in _BASELINES:
                times = [c["baselines"][name]["all_s"] for c in runs if "all_s" in c.get("baselines", {}).get(name, {})]
                if times:
                    parts.append(
                        f"{label} {statistics.median(times):.2f} s ({statistics.median(times) / ours[size, n]:.1f}x)"
                    )
            loads = ", ".join(f"{c['load_avg_start'][0]:.1f}->{c['load_avg_end'][0]:.1f}" for c in runs)
            runs_note = f" (medians of {len(runs)} runs)" if len(runs) > 1 else ""
            lines.append(
                f"- {big:g} GiB, lr {lr0:g} ({runs[0]['changed_fraction']:.2%} changed), {n} agent(s), "
                f"{store0} store{runs_note}: weightsync {ours[size, n]:.2f} s"
                + "".join(f"; {part}" for part in parts)
                + f". Load avg {loads}."
            )
    for size in sorted({s for s, _ in ours}, reverse=True):
        counts = sorted(n for s, n in ours if s == size)
        if counts[0] == 1 and len(counts) > 1:
            one, many = ours[size, 1], ours[size, counts[-1]]
            lines.append(
                f"- {size:g} GiB: {counts[-1]} agents take {many / one:.2f}x the time of 1 "
                f"({many:.2f} s vs {one:.2f} s)."
            )
    return lines


def markdown(record: dict) -> str:
    hw, net = record["hardware"], record.get("network", {})
    lines = [
        f"# sync latency: publish() -> every agent serving, {record['date']}",
        "",
        f"Machine: {_cores(hw)} CPUs ({hw['cpu']}, {hw['machine']}), "
        f"{hw.get('memory_GiB', hw.get('mem_total_gib'))} GiB RAM, shared with "
        f"other work; load average per cell below. torch {hw['torch']}, weightsync {hw['weightsync']}; "
        f"tools: " + ", ".join(f"{k} {v}" for k, v in record["versions"].items()) + ".",
        "",
        "Network: " + ", ".join(f"{k}: {v}" for k, v in net.items()) + ".",
        "",
        "CPUs: " + _cpus(record["config"].get("cpus")),
        "",
        "Checkpoints: weightsync.models.CausalLM trained with AdamW on fp32 masters (bench/checkpoints.py); "
        "the measured pair's changed fraction per size and lr: "
        + "; ".join(
            f"{s} GiB " + ", ".join(f"lr {lr} {f:.2%}" for lr, f in c["changed_fraction"].items())
            for s, c in record["config"]["checkpoints"].items()
        )
        + ".",
        "",
        (
            "Times are seconds from the trainer having the new bf16 weights (publish() call; for baselines the "
            "start of writing the safetensors file) to the last receiver holding them (agents: serving, from the "
            "ledgers; baselines: loaded as torch tensors). `ours` is the steady state (third delta); `first` the "
            "base version. (Nx) = baseline time / ours."
        ),
        "",
        "## Headline",
        "",
        *headline(record),
        "",
    ]
    for theme, title in (
        ("agents", "agents (scaling with receivers)"),
        ("change", "change rate"),
        ("store", "store: local directory vs S3 (moto)"),
    ):
        rows = [c for c in record["cells"] if theme in c["themes"]]
        if not rows:
            continue
        lines += [
            f"## {title}",
            "",
            (
                "| size GiB | lr | changed | agents (regions) | store | ours s | first s | "
                "commit s | delta MB | full via store s | shardcast s | zstd patch s | load avg |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in rows:
            head = (
                f"| {c['size_gib']:g} | {c['lr']:g} | {c.get('changed_fraction', 0):.2%} | {c['agents']} "
                f"({c['regions']}) | {c['store']} |"
            )
            if "ours" not in c:
                lines.append(head + f" {c.get('skipped') or c.get('error')} |" + " |" * 7)
                continue
            o, f = c["ours"]["steady"], c["ours"]["first"]
            lines.append(
                head + f" **{o['all_agents_s']:.2f}** | {f['all_agents_s']:.2f} | {o['commit_s']:.2f} | "
                f"{o['stored_bytes'] / 1e6:.1f} | "
                + " | ".join(_baseline_cell(c, n) for n, _ in _BASELINES)
                + f" | {c['load_avg_start'][0]:.1f}-{c['load_avg_end'][0]:.1f} |"
            )
        lines.append("")
    done = _done(record)
    if done:
        lines += [
            "## where weightsync's time goes (steady state, seconds)",
            "",
            (
                "snapshot = publish() copying the weights (the caller's wait); encode = encode + store writes, "
                "from the version's start (it starts on each tensor as soon as it is copied, so it overlaps the "
                "snapshot); manifest = waiting for earlier versions + the commit; commit = publish() -> committed: "
                "snapshot + encode + manifest above it is the overlap; agents = commit -> last agent serving "
                "(offer, relay, verify + apply into the spare buffer, swap); apply = the slowest agent's apply after the "
                "offer; early = chunks every agent applied as they arrived, before the offer, of the version's "
                "chunk objects (agents/early_apply.py), and how long the sync waited after the offer for the "
                "last early decodes (they run at a lower CPU priority, so on a shared machine the encoder comes "
                "first); "
                "route = how it applied the delta(s): chain or folded; objects = store objects the version wrote "
                "besides its manifest (chunk objects or packs: its PUTs)."
            ),
            "",
            (
                "| size GiB | lr | agents | store | total | snapshot | encode | manifest | commit | overlap | "
                "agents | apply | early | route | objects | pushed MB | fetched MB |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in done:
            o = c["ours"]["steady"]
            apply = max((a.get("apply", 0.0) for a in o["per_agent"]), default=0.0)
            stages = [o.get(k) for k in ("snapshot_s", "encode_upload_s", "manifest_s")]
            overlap = sum(stages) - o["commit_s"] if None not in stages else None
            routes = sorted({a.get("route") or "-" for a in o["per_agent"]})
            early = min((a.get("applied_early", 0) for a in o["per_agent"]), default=0)
            early_wait = max((a.get("early_wait", 0.0) for a in o["per_agent"]), default=0.0)
            early_cell = f"{early}/{o['object_chunks']}, waited {early_wait:.2f}" if "object_chunks" in o else "—"
            lines.append(
                f"| {c['size_gib']:g} | {c['lr']:g} | {c['agents']} | {c['store']} | {o['all_agents_s']:.2f} | "
                f"{_s(o.get('snapshot_s'))} | {_s(o.get('encode_upload_s'))} | {_s(o.get('manifest_s'))} | "
                f"{o['commit_s']:.2f} | {_s(overlap)} | "
                f"{o['all_agents_s'] - o['commit_s']:.2f} | {apply:.2f} | {early_cell} | {'/'.join(routes)} | "
                f"{o.get('store_objects', '—')} | "
                f"{o['pushed_bytes'] / 1e6:.1f} | {o['fetched_bytes'] / 1e6:.1f} |"
            )
        lines.append("")
    problems = [
        (c, n, b) for c in record["cells"] for n, b in c.get("baselines", {}).items() if "error" in b or "skipped" in b
    ]
    if problems:
        lines += ["## Baselines skipped or failed", ""]
        lines += [
            f"- {c['size_gib']:g} GiB, {c['agents']} agents, {c['store']}: {n}: {b.get('skipped') or b['error']}"
            for c, n, b in problems
        ]
    if record.get("notes"):  # added by hand after a run: what the numbers above need to be read with
        lines += ["", "## Notes", "", *[f"- {note}" for note in record["notes"]]]
    return "\n".join(lines) + "\n"


def plots(record: dict, base: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells, written = _done(record), []
    if not cells:
        return written
    lr0, store0 = record["config"]["lrs"][0], record["config"]["stores"][0]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for size in sorted({c["size_gib"] for c in cells}):
        rows = sorted(
            (c for c in cells if c["size_gib"] == size and c["lr"] == lr0 and c["store"] == store0),
            key=lambda c: c["agents"],
        )
        if len(rows) < 2:
            continue
        n = [c["agents"] for c in rows]
        (line,) = ax.plot(
            n, [c["ours"]["steady"]["all_agents_s"] for c in rows], "o-", label=f"weightsync {size:g} GiB"
        )
        for name, style in (("full_store", "s--"), ("shardcast", "^:")):
            ys = [c["baselines"].get(name, {}).get("all_s") for c in rows]
            if all(y is not None for y in ys):
                ax.plot(n, ys, style, color=line.get_color(), alpha=0.6, label=f"{name} {size:g} GiB")
    if ax.lines:
        ax.set(
            xlabel="agents",
            ylabel="publish -> all serving (s)",
            yscale="log",
            title=f"sync latency vs agents (lr {lr0:g}, {store0} store)",
        )
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(f"{base}-agents.png", dpi=110)
        written.append(f"{base.name}-agents.png")
    plt.close(fig)

    rows = [c for c in cells if c["store"] == store0]
    fig, ax = plt.subplots(figsize=(max(7, 0.7 * len(rows)), 4.5))
    labels = [f"{c['size_gib']:g}G {c['lr']:g}\n{c['agents']}a" for c in rows]
    width = 0.2
    series = [("weightsync", [c["ours"]["steady"]["all_agents_s"] for c in rows])]
    series += [(label, [c["baselines"].get(n, {}).get("all_s", 0) or 0 for c in rows]) for n, label in _BASELINES]
    for k, (label, ys) in enumerate(series):
        ax.bar([i + (k - 1.5) * width for i in range(len(rows))], ys, width, label=label)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set(ylabel="publish -> all serving (s)", yscale="log", title=f"weightsync vs baselines ({store0} store)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{base}-baselines.png", dpi=110)
    written.append(f"{base.name}-baselines.png")
    plt.close(fig)
    return written


def write_report(record: dict, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    base = stem(record, directory)
    record["plots"] = plots(record, base)
    base.with_suffix(".json").write_text(json.dumps(record, indent=1))
    base.with_suffix(".md").write_text(markdown(record))


if __name__ == "__main__":  # re-render a record: python -m bench.sync_report RESULT.json
    import sys

    doc = json.loads(Path(sys.argv[1]).read_text())
    write_report(doc, Path(sys.argv[1]).resolve().parent)
