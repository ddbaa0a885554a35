"""`weightsync demo` end to end, short: the FSDP2 trainer (2 ranks under torchrun), 2 regions x 2
agents with reference servers, rollout workers; a few warm-start and GRPO steps, with long rollouts
under the in_flight swap policy, and a parity fault injected into one agent. Every agent must end on
the last version bit for bit (each re-hashes what it serves), rollouts must carry weight versions
that increase (per server, never backwards), summary.json reports the staleness of what the trainer
learned from, the agents' logs say what they served, the healthy agents' parity probes match the
trainer's record to the last bit, and the faulty agent's breaches are caught, refused and rolled
back.

One run for all of it (a demo run is minutes on a loaded machine): the healthy agents are the
healthy demo, the fourth is the fault."""

from __future__ import annotations

import json

import pytest

from weightsync.app.demo import DemoConfig, run_demo

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.timeout(900)
def test_the_demo_loop_runs_every_agent_ends_bit_exact_and_an_injected_parity_fault_is_refused(tmp_path):
    lines: list[str] = []
    # What `weightsync demo --quick` runs, with five GRPO steps: enough warm start that some samples
    # are right (a group teaches something only then). Warm-up steps are cheap (~0.3 s); a GRPO step
    # waits for groups whose rewards differ: after 30 warm-up steps (reward ~0.03) ~13 groups were
    # sampled per group used, after 60 (reward ~0.07) ~3.5. Long rollouts under the in_flight swap
    # policy: generations run past the answer, swaps meet them, and the trainer learns from what the
    # versions that made the answer sampled. `--inject-parity-fault`: one agent's engine serves two
    # layers swapped for three GRPO versions (every byte verifies).
    config = DemoConfig(
        out_dir=str(tmp_path / "demo"),
        warmup_steps=60,
        rl_steps=5,
        group_size=4,
        groups_per_step=2,
        timeout_s=850,
        swap_policy="in_flight",
        rollout_tokens=48,
        inject_parity_fault=True,
    )
    faulty, first, last_faulty = config.parity_fault
    summary = run_demo(config, echo=lines.append)

    last = summary["last_version"]
    assert last > last_faulty >= 62 and summary["all_bit_exact"]
    assert {a["version"] for a in summary["agents"].values()} == {last}
    assert all(a["bit_exact"] for a in summary["agents"].values())
    rows = summary["versions"]
    assert [r["version"] for r in rows] == list(range(1, last + 1))
    assert {r["phase"] for r in rows} == {"warm-up", "grpo"}
    assert rows[-1]["to_all_agents_s"] is not None, "the last version reached every agent"
    healthy_agents = set(summary["agents"]) - {faulty}
    # The fault held no healthy agent back: each only ever moved forward, to the last version. (Not
    # "each served each of the last versions": an agent still busy when two versions land takes the
    # newer one, as a loaded machine showed.)
    for name in healthy_agents:
        served = [version for _, version in summary["served_timeline"][name]]
        assert served == sorted(set(served)) and served[-1] == last, (name, served)

    # Rollouts record the version that produced them: for each worker (a client whose requests to a
    # server follow one another) never backwards, and rising overall. Across workers, a request
    # that began before a swap may end after one that began after it: order holds per client.
    by_client: dict[tuple[str, str], list[int]] = {}
    for row in sorted(summary["rewards"], key=lambda r: r["t"]):
        by_client.setdefault((row["worker"], row["server"]), []).append(row["version"])
    assert len({server for _, server in by_client}) == 4
    for versions in by_client.values():
        assert versions == sorted(versions)
    assert max(max(v) for v in by_client.values()) > min(min(v) for v in by_client.values())
    assert summary["rollout_groups"]["claimed"] > 0, "the trainer trained on rollouts"

    staleness = summary["staleness"]
    assert staleness["swap_policy"] == "in_flight" and staleness["rollout_tokens"] == 48
    assert staleness["mean_steps"] is not None and staleness["max_steps"] >= staleness["mean_steps"] >= 0
    assert all(set(r["agent_timings_s"]) >= set(r["to_agents_s"]) for r in rows), "ledger timings per agent"
    for name in summary["agents"]:  # the agents log each version they serve at the default level
        assert "serving v" in (tmp_path / "demo" / "logs" / f"{name}.log").read_text(), name

    # Each version carries a parity probe; the healthy agents' reference engines (bf16) are held to
    # the trainer's bf16 record of the published weights and match it to the last bit: 0 breaches.
    assert all(r["probe_bytes"] > 0 for r in rows)
    assert all(p is not None and p["action"] == "ok" for p in rows[-1]["parity"].values()), rows[-1]["parity"]
    healthy = [p for r in rows for name, p in r["parity"].items() if name != faulty and p is not None]
    assert healthy and all(p["action"] == "ok" for p in healthy)
    for figure in ("dlogprob_p90", "max_abs_dlogprob"):
        assert any(p[figure] is not None for p in healthy) and all(p[figure] in (0, None) for p in healthy), figure
    parity = summary["parity"]
    assert parity["probes"] >= len(rows) and parity["compute_dtypes"] == ["bfloat16"]
    assert summary["headline"].endswith(f"parity probe: {parity['breaches']} breaches in {parity['probes']} probes")

    # The faulty agent: its probe breaches, the refuse rule keeps the newest version that passed
    # served, the demo prints the agent's own log lines about it, and the agent ends on the last
    # version bit for bit like every other (above).
    breached = parity["breached"]
    assert breached and len(breached) == parity["breaches"]
    assert {b["agent"] for b in breached} == {faulty} and {b["action"] for b in breached} == {"refuse"}
    assert {b["version"] for b in breached} <= set(range(first, last_faulty + 1))
    refused = [r["version"] for r in rows if faulty in r["refused_by"]]
    assert refused and set(refused) <= set(range(first, last_faulty + 1))
    said = "\n".join(lines)
    assert f"injected parity fault: {faulty}" in said and "breaches parity" in said
    assert "the newest version that passed" in said

    written = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert written["last_version"] == last
    assert (tmp_path / "demo" / "summary.png").stat().st_size > 0
    assert any(line.startswith("every agent serves") for line in lines)
