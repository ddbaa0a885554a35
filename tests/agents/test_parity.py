"""The numerical-parity probe (weightsync/format/probe.py, models/probe.py, agents/parity.py):
its format in the manifest, its prompts, the figures, and a sync agent probing its engine after
every swap.

- the format: round trip, damage refused, format 1 still read, the size bound;
- prompts: drawn with distinct tokens, degenerate ones refused; the staged forward the trainer and
  the reference engine share equals the model's own forward, bit for bit;
- the figures: quantiles no single token can swing, the gap KL;
- parity holds: the reference engine matches the trainer's record of its dtype to the last bit
  (dense and MoE, bf16 and fp32, expert choices included), under the default thresholds;
- a wrong engine is flagged under warn (a WARNING) and alert (an ERROR and the alerts counter);
- the refuse rule: the agent serves the newest version that passed, or nothing, and says which —
  a rollback bit for bit (a copying and a zero-copy engine), a fresh agent that serves nothing
  (logs, status, health, --verify's exit code and agent/serving agree) and takes the next version
  that passes, a restart that probes the restored version;
- a probe never delays a swap under warn.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time

import numpy as np
import pytest
import torch

from harness.bits import assert_bit_equal
from harness.fake_trainer import TINY, TINY_MOE, FakeTrainer
from weightsync.agents.config import AgentConfig, parse_agent_config
from weightsync.agents.engines.reference import ReferenceEngine, ReferenceEngineConfig
from weightsync.agents.parity import ParityConfig, ParityRefused
from weightsync.agents.parity_figures import compare, gap_per_position, trimmed_mean
from weightsync.agents.sync import SyncAgent
from weightsync.app.demo.parity_fault import with_layers_0_and_1_swapped
from weightsync.errors import ConfigError, FormatError
from weightsync.format.manifest import parse_manifest
from weightsync.format.probe import MAX_PROBE_BYTES, Probe, ProbeRecord, TrainingTopK, probe_from_json
from weightsync.metrics import METRICS
from weightsync.models import ModelConfig, build_model
from weightsync.models.probe import ProbeError, check_prompts, draw_prompts, run_probe, to_probe
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.stores import LocalStore
from weightsync.versions import read_manifest_bytes

MODEL = "parity-lm"
WAIT_S = 120.0
MOE = TINY_MOE
ARCH = {"dense": TINY, "moe": MOE}


class Recorder:
    """Metrics that remember what was set and counted (weightsync.metrics.Metrics), refusing
    names that are not declared, as the Prometheus exporter does."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.counts: dict[str, float] = {}
        self.lock = threading.Lock()

    def inc(self, name, value=1.0, **labels):
        assert name in METRICS, name
        with self.lock:
            self.counts[name] = self.counts.get(name, 0.0) + value

    def set(self, name, value, **labels):
        assert name in METRICS, name
        with self.lock:
            self.values[name] = value

    def observe(self, name, value, **labels):
        self.set(name, value)


class SwappedLayersEngine(ReferenceEngine):
    """A wrong engine: for the versions in `wrong` it serves decoder layers 0 and 1 swapped after the
    agent's digest check (as a loader that numbers layers wrongly would); the rest as handed."""

    def __init__(self, config: ReferenceEngineConfig, *, wrong: set[int]) -> None:
        super().__init__(config)
        self.wrong = wrong

    def swap(self, version, weights, **kwargs):
        if version in self.wrong:
            weights = with_layers_0_and_1_swapped(weights)
        return super().swap(version, weights, **kwargs)


def prompts_for(arch: ModelConfig, count: int = 3, length: int = 12) -> list[list[int]]:
    return list(itertools.islice(draw_prompts(arch.vocab_size, length=length), count))


@dataclasses.dataclass
class Rig:
    store: LocalStore
    publisher: Publisher
    trainer: FakeTrainer
    agent: SyncAgent
    engine: ReferenceEngine
    metrics: Recorder
    prompts: list

    def publish(self, step: int) -> dict[str, torch.Tensor]:
        self.trainer.advance_to(step)
        probe = self.trainer.probe(self.prompts)
        self.publisher.publish(self.trainer.state_dict(), step=step, probe=probe).result(timeout=WAIT_S)
        return self.trainer.published()


def _rig(tmp_path, arch_name: str, dtype: str, parity: dict, wrong: set[int], store: LocalStore | None = None) -> Rig:
    arch = ARCH[arch_name]
    store = store or LocalStore(tmp_path / "store")
    publisher = Publisher(store, model=MODEL, config=PublisherConfig(workers=2))
    engine = SwappedLayersEngine(ReferenceEngineConfig(model=arch, compute_dtype=dtype), wrong=wrong)
    metrics = Recorder()
    config = AgentConfig(
        model=MODEL,
        cache_dir=str(tmp_path / "agent"),
        name="parity-agent",
        store=store.uri,
        poll_interval_s=0.2,
        workers=2,
        parity=ParityConfig(**parity),
    )
    agent = SyncAgent(config, engine, upstream=store, metrics=metrics)
    agent.start()
    return Rig(store, publisher, FakeTrainer(config=arch), agent, engine, metrics, prompts_for(arch))


@pytest.fixture
def rig(tmp_path, request):
    """A publisher writing probes, and one agent over the store with a (possibly wrong) engine.
    `request.param`: (architecture, compute dtype, parity settings, versions the engine gets wrong)."""
    rig = _rig(tmp_path, *request.param)
    yield rig
    rig.agent.close()
    rig.publisher.close()


def _report(rig: Rig, version: int) -> dict:
    """The version's parity report in the ledger, once its probe has run (a deadline, not a timing)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for entry in rig.agent.status()["ledger"]:
            if entry["version"] == version and entry["parity"]:
                return entry["parity"]
        time.sleep(0.05)
    raise AssertionError(f"v{version} was never probed: {rig.agent.status()['ledger']}")


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# ----------------------------------------------------------------------------- the format


def _probe(prompts, experts=None, training=True) -> Probe:
    predicted = sum(len(p) - 1 for p in prompts)
    records = [
        ProbeRecord(compute_dtype=d, logprobs=-np.linspace(0.1, 5, predicted, dtype=np.float32) - i, experts=experts)
        for i, d in enumerate(("bfloat16", "float32"))
    ]
    top = None
    if training:
        ids = np.tile(np.arange(4), (predicted, 1))
        top = TrainingTopK(compute_dtype="float32", ids=ids, logprobs=-np.ones((predicted, 4), np.float32))
    return Probe(prompts=prompts, records=records, training=top)


def test_a_probe_round_trips_through_the_manifest_and_refuses_damage():
    prompts = prompts_for(TINY, count=2, length=5)
    experts = np.arange(10 * 3 * 2, dtype=np.uint16).reshape(10, 3, 2) % 8
    probe = _probe(prompts, experts)
    doc = probe.to_json()
    back = probe_from_json(doc)
    assert back.prompts == probe.prompts and back.compute_dtypes == ("bfloat16", "float32")
    for mine, theirs in zip(probe.records, back.records, strict=True):
        assert np.array_equal(mine.logprobs, theirs.logprobs) and np.array_equal(mine.experts, theirs.experts)
    assert np.array_equal(back.training.ids, probe.training.ids) and back.training.k == 4
    with pytest.raises(FormatError, match="its own xxh3"):
        probe_from_json({**doc, "prompts": [[1, 2]]})
    with pytest.raises(FormatError, match="fields"):
        probe_from_json({k: v for k, v in doc.items() if k != "records"})
    with pytest.raises(FormatError, match="8 log-probs"):
        Probe(prompts=prompts, records=[ProbeRecord(compute_dtype="bfloat16", logprobs=np.zeros(7) - 1)])
    with pytest.raises(FormatError, match="one record per compute dtype"):
        Probe(prompts=prompts, records=[probe.records[0], probe.records[0]])
    with pytest.raises(FormatError, match="exceeds"):
        _probe([[1] * 4000] * 4, training=False).to_json()


def test_a_format_1_probe_is_still_read_as_one_record():
    """Issue 34's probes (one fp32 record at the top level) stay readable in old stores."""
    from weightsync.format.hashing import xxh3_hex
    from weightsync.format.manifest import canonical_json

    doc = {"format": 1, "prompts": [[1, 2, 3]], "logprobs": "AACAvwAAAMA=", "compute_dtype": "float32"}
    doc["xxh3"] = xxh3_hex(canonical_json(doc))
    probe = probe_from_json(doc)
    assert probe.compute_dtypes == ("float32",) and probe.training is None
    assert probe.records[0].logprobs.tolist() == [-1.0, -2.0]


def test_expert_choices_of_a_large_moe_are_cut_to_the_bound():
    prompts = list(itertools.islice(draw_prompts(1000, length=32), 4))
    layers, top_k = 48, 8  # Qwen3-30B-A3B's routing per token
    experts = [torch.randint(0, 128, (32, layers, top_k)).sort(-1).values for _ in prompts]
    run = type("Run", (), {"logprobs": [-torch.rand(31) for _ in prompts], "experts": experts})()
    training = type(
        "Run", (), {"top_ids": [torch.zeros(31, 8, dtype=torch.long)] * 4, "top_logprobs": [-torch.ones(31, 8)] * 4}
    )()
    doc = to_probe(prompts, {"bfloat16": run, "float32": run}, training=training).to_json()
    assert 0 < doc["expert_positions"] < 128 and len(repr(doc)) <= MAX_PROBE_BYTES + 1024


# ------------------------------------------------------------------------------ prompts


def test_prompts_hold_distinct_tokens_and_degenerate_ones_are_refused():
    prompts = list(itertools.islice(draw_prompts(259, length=32), 4))
    assert prompts == list(itertools.islice(draw_prompts(259, length=32), 4))  # the same for every version
    assert all(len(set(p)) == 32 for p in prompts) and len({tuple(p) for p in prompts}) == 4
    check_prompts(prompts, 259)
    with pytest.raises(ProbeError, match="distinct tokens"):
        check_prompts([[208] * 32], 259)  # a small model's greedy continuation
    with pytest.raises(ProbeError, match="token ids in"):
        check_prompts([[1, 300]], 259)
    small = next(draw_prompts(5, length=12))  # a vocabulary smaller than a prompt: every token, reshuffled
    assert set(small) == set(range(5))
    check_prompts([small], 5)


@pytest.mark.parametrize("arch", [TINY, MOE], ids=["dense", "moe"])
def test_the_staged_forward_is_the_models_forward_bit_for_bit(arch):
    """What the trainer and the reference engine run (layer by layer, each tensor fetched once)
    equals CausalLM.forward on the whole weights, in each dtype, expert choices included."""
    model = build_model(arch, seed=1)
    weights = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}
    prompts = prompts_for(arch, count=3, length=12)
    asked = []

    def fetch(name):
        asked.append(name)
        return weights[name]

    runs = run_probe(arch, prompts, fetch, dtypes=[torch.bfloat16, torch.float32], top_k=4)
    assert sorted(asked) == sorted(weights) and len(asked) == len(set(asked))
    ids = torch.tensor(prompts)
    for dtype, run in runs.items():
        router = [] if arch.is_moe else None
        logits = model(ids, weights={n: t.to(dtype) for n, t in weights.items()}, router_logits=router)
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        assert torch.equal(torch.stack(run.logprobs), logp.gather(-1, ids[:, 1:, None]).squeeze(-1))
        assert torch.equal(torch.stack(run.top_logprobs), logp.topk(4, dim=-1).values)
        if arch.is_moe:
            chosen = [r.reshape(3, 12, -1).topk(2, dim=-1).indices.sort(-1).values for r in router]
            assert torch.equal(torch.stack(run.experts), torch.stack(chosen, dim=2))


# ------------------------------------------------------------------------------ figures


def test_the_figures_are_quantiles_that_no_single_token_can_swing():
    prompts = [list(range(11))]
    probe = _probe(prompts, training=False)
    mine = probe.record("bfloat16").logprobs.astype(np.float64)
    one_off = mine.copy()
    one_off[3] -= 5.0  # one token whose near-tie flipped
    figures = compare(probe, "bfloat16", [torch.tensor(one_off)])
    assert figures.dlogprob_p50 == 0 and figures.dlogprob_p90 == 0 and figures.max_abs_dlogprob == pytest.approx(5)
    everywhere = compare(probe, "bfloat16", [torch.tensor(mine + 0.02)])
    assert everywhere.dlogprob_p50 == pytest.approx(0.02, abs=1e-6)
    unrecorded = compare(probe, "float16", [torch.tensor(mine)])
    assert not unrecorded.recorded and unrecorded.dlogprob_p50 is None
    with pytest.raises(FormatError, match="9 log-probs for probe prompt 0, not 10"):
        compare(probe, "bfloat16", [torch.tensor(mine[:9])])


def test_the_gap_is_the_kl_from_the_engine_to_the_training_forward_on_their_top_k():
    logp = np.log(np.array([[0.5, 0.3, 0.1, 0.05]]))
    training = TrainingTopK(compute_dtype="float32", ids=np.array([[1, 2, 3, 4]]), logprobs=logp)
    kl, overlap = gap_per_position(training, np.array([[1, 2, 3, 4]]), logp)
    assert kl[0] == pytest.approx(0, abs=1e-12) and overlap[0] == 1
    kl, overlap = gap_per_position(training, np.array([[2, 1, 3, 4]]), logp)  # tokens 1 and 2 trade places
    want = 0.5 * np.log(0.5 / 0.3) + 0.3 * np.log(0.3 / 0.5)
    assert kl[0] == pytest.approx(want) and overlap[0] == 1
    kl, overlap = gap_per_position(training, np.array([[9, 1, 2, 3]]), logp)  # the engine's best: not ranked
    assert kl[0] > 0.1 and overlap[0] == 0.75
    assert trimmed_mean(np.array([0.0] * 9 + [100.0]), 0.1) == 0.0  # one position does not decide it


def test_parity_settings_are_checked():
    base = {"model": "m", "cache_dir": "agent-cache", "engine": {"type": "reference", "model": {}}}
    assert parse_agent_config({**base, "parity": {"action": "refuse"}}).parity.action == "refuse"
    assert parse_agent_config({**base, "parity": {"max_gap_kl": 0.01}}).parity.max_gap_kl == 0.01
    with pytest.raises(ConfigError, match="action"):
        parse_agent_config({**base, "parity": {"action": "panic"}})
    with pytest.raises(ConfigError, match="compute_dtype"):
        parse_agent_config({**base, "parity": {"compute_dtype": "int8"}})
    with pytest.raises(ConfigError, match="max_dlogprob_p50"):
        parse_agent_config({**base, "parity": {"max_dlogprob_p5": 1.0}})


# ------------------------------------------------------------------------- parity holds


@pytest.mark.parametrize(
    "rig",
    [("dense", "bfloat16", {}, set()), ("moe", "bfloat16", {}, set()), ("dense", "float32", {}, set())],
    ids=["dense-bf16", "moe-bf16", "dense-fp32"],
    indirect=True,
)
def test_the_reference_engine_computes_what_the_trainer_recorded_to_the_last_bit(rig):
    for step in (1, 2):
        want = rig.publish(step)
        assert rig.agent.wait_for_version(step, WAIT_S)
        report = _report(rig, step)
        assert report["compute_dtype"] == rig.engine.config.compute_dtype
        assert report["max_abs_dlogprob"] == 0.0 and report["dlogprob_p50"] == 0.0, report
        assert report["action"] == "ok" and not report["breaches"]
        assert report["expert_mismatch"] == (0.0 if rig.trainer.model.config.is_moe else None)
        # The training forward (fp32, unrounded weights) against the engine: a small, honest gap.
        assert 0 <= report["gap_kl"] < 1e-3 and report["gap_overlap"] > 0.8, report
        dtype = getattr(torch, rig.engine.config.compute_dtype)
        assert_bit_equal(rig.engine.served().weights, {n: t.to(dtype) for n, t in want.items()})
    assert rig.agent.status()["parity"]["version"] == 2
    assert rig.metrics.values["agent/parity_dlogprob_p90"] == 0.0 and "agent/parity_gap_kl" in rig.metrics.values
    _, data = read_manifest_bytes(rig.store, MODEL, 2)
    assert "probe" in parse_manifest(data).producer  # signed with the rest of the manifest


# -------------------------------------------------------------------- a mismatch caught


@pytest.mark.parametrize(
    "rig",
    [("dense", "bfloat16", {"action": "warn"}, {2}), ("moe", "bfloat16", {"action": "alert"}, {2})],
    ids=["dense-warn", "moe-alert"],
    indirect=True,
)
def test_a_wrong_engine_is_flagged_and_served_on_under_warn_and_alert(rig, caplog):
    action = rig.agent.config.parity.action
    with caplog.at_level(logging.INFO, logger="weightsync.agents.parity"):
        for step in (1, 2):
            rig.publish(step)
            assert rig.agent.wait_for_version(step, WAIT_S)
        good, bad = _report(rig, 1), _report(rig, 2)
    assert good["action"] == "ok"
    assert bad["action"] == action and bad["breaches"], bad
    assert rig.agent.served_version == 2  # warn and alert never take a version back
    level = logging.WARNING if action == "warn" else logging.ERROR
    assert any(r.levelno == level and "v2 breaches parity" in r.getMessage() for r in caplog.records)
    assert rig.metrics.counts.get("agent/parity_alerts", 0) == (1 if action == "alert" else 0)


# ---------------------------------------------------------------------- the refuse rule


@pytest.mark.parametrize(
    "rig",
    [("dense", "float32", {"action": "refuse"}, {2}), ("moe", "bfloat16", {"action": "refuse"}, {2})],
    ids=["copying-dense", "zero-copy-moe"],
    indirect=True,
)
def test_refuse_serves_the_newest_version_that_passed_bit_for_bit(rig, caplog):
    v1 = rig.publish(1)
    assert rig.agent.wait_for_version(1, WAIT_S)
    assert _report(rig, 1)["action"] == "ok"
    with caplog.at_level(logging.ERROR, logger="weightsync.agents"):
        rig.publish(2)
        _wait(lambda: 2 in rig.agent.status()["refused"], "v2 was never refused")
    status = rig.agent.status()
    entry = next(e for e in status["ledger"] if e["version"] == 2)
    assert entry["outcome"] == "refused" and entry["parity"]["action"] == "refuse"
    assert status["current_version"] == 1 and rig.engine.served_version() == 1 and not status["unhealthy"]
    assert not status["broken"]  # refused is not broken: never retried
    said = [r.getMessage() for r in caplog.records if r.name == "weightsync.agents.swap" and "v2" in r.getMessage()]
    assert len(said) == 1 and "serving v1 again, the newest version that passed" in said[0], said  # says which
    dtype = getattr(torch, rig.engine.config.compute_dtype)
    assert_bit_equal(rig.engine.served().weights, {n: t.to(dtype) for n, t in v1.items()})
    assert rig.metrics.counts["agent/parity_rollbacks"] == 1
    time.sleep(1.5)  # past the broken-version retry: a refused version is never tried again
    assert rig.engine.served_version() == 1 and rig.metrics.counts["agent/parity_rollbacks"] == 1
    v3 = rig.publish(3)  # the next good version is served (a delta on the refused one)
    assert rig.agent.wait_for_version(3, WAIT_S)
    assert _report(rig, 3)["action"] == "ok"
    assert_bit_equal(rig.engine.served().weights, {n: t.to(dtype) for n, t in v3.items()})


def _serving_metric(server) -> float:
    """weightsync_agent_serving as Prometheus scrapes it from the agent."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return float(next(line for line in text.splitlines() if line.startswith("weightsync_agent_serving")).split()[-1])


def test_refuse_on_a_fresh_agent_serves_nothing_and_every_signal_says_so(tmp_path, caplog, capsys):
    """Nothing passed yet: the engine is withdrawn, the agent serves nothing (version 0, not
    healthy, weightsync_agent_serving 0, `status --verify` fails naming the refused version) and
    never walks back to older versions; the next version that passes is served."""
    from weightsync.agents.server import AgentServer
    from weightsync.app.cli import main

    store = LocalStore(tmp_path / "store")
    trainer = FakeTrainer(config=TINY)
    prompts = prompts_for(TINY)
    engine = SwappedLayersEngine(ReferenceEngineConfig(model=TINY), wrong={1, 2, 3})
    config = AgentConfig(
        model=MODEL,
        cache_dir=str(tmp_path / "agent"),
        name="fresh",
        store=store.uri,
        poll_interval_s=0.2,
        workers=2,
        listen="127.0.0.1:0",
        metrics_port=0,
        parity=ParityConfig(action="refuse"),
    )
    with Publisher(store, model=MODEL, config=PublisherConfig(workers=2)) as publisher:
        for step in (1, 2, 3):  # three versions before the agent starts: it takes the newest
            trainer.advance_to(step)
            publisher.publish(trainer.state_dict(), step=step, probe=trainer.probe(prompts)).result(WAIT_S)
        with caplog.at_level(logging.INFO):
            server = AgentServer(config, engine=engine).start()
            try:
                agent = server.agent
                _wait(lambda: 3 in agent.status()["refused"], "v3 was never refused")
                time.sleep(1.0)  # a fallback would start within the poll interval: none may
                status = agent.status()
                assert status["refused"] == [3] and status["current_version"] == 0
                assert "v3 failed the parity probe" in status["unhealthy"] and "serving nothing" in status["unhealthy"]
                assert engine.state().state == "paused" and engine.served_version() is None
                assert agent.check_health() and _serving_metric(server) == 0
                assert main(["status", "--agent", server.address, "--verify"]) != 0
                out = capsys.readouterr()
                assert "serves no version" in out.err + out.out and "v3 failed the parity probe" in out.err + out.out
                said = [r.getMessage() for r in caplog.records if "serving nothing until" in r.getMessage()]
                assert said and all("v3" in line for line in said), said
                assert not any("falling back" in r.getMessage() for r in caplog.records)
                assert {e["version"] for e in status["ledger"]} == {3}  # v1, v2: never tried
                trainer.advance_to(4)  # a version the engine computes right: served
                publisher.publish(trainer.state_dict(), step=4, probe=trainer.probe(prompts)).result(WAIT_S)
                assert agent.wait_for_version(4, WAIT_S)
                assert not agent.check_health() and _serving_metric(server) == 1
                assert main(["status", "--agent", server.address, "--verify"]) == 0
            finally:
                server.stop()


def test_refuse_probes_the_version_a_restarted_agent_restores(tmp_path):
    """The engine may have changed across a restart: the restored version is probed again, and a
    breach leaves the agent serving nothing."""
    rig = _rig(tmp_path, "dense", "bfloat16", {"action": "refuse"}, set())
    try:
        rig.publish(1)
        assert rig.agent.wait_for_version(1, WAIT_S)
    finally:
        rig.agent.close()
        rig.publisher.close()
    engine = SwappedLayersEngine(ReferenceEngineConfig(model=TINY), wrong={1})
    agent = SyncAgent(rig.agent.config, engine, upstream=rig.store)
    agent.start()
    try:
        status = agent.status()
        assert status["current_version"] == 0 and status["refused"] == [1]
        assert "since the agent started" in status["unhealthy"] and engine.state().state == "paused"
    finally:
        agent.close()


def test_a_refusal_carries_its_report():
    from weightsync.agents.parity import ParityReport

    report = ParityReport(
        version=3, engine="e", compute_dtype="bfloat16", dlogprob_p50=1.0, dlogprob_p90=2.0, max_abs_dlogprob=3.0,
        expert_mismatch=None, gap_kl=None, gap_overlap=None, tokens=10, probe_s=0.1, breaches=("x",), action="refuse",
    )  # fmt: skip
    import pickle

    back = pickle.loads(pickle.dumps(ParityRefused("v3 failed", report)))
    assert str(back) == "v3 failed" and back.report == report


# ------------------------------------------------------------------ never delays a swap


class SlowProbeEngine(ReferenceEngine):
    """Answers the probe only once the test lets it: shows that the swap did not wait for it."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.release = threading.Event()

    def prompt_logprobs(self, prompts, **kwargs):
        assert self.release.wait(WAIT_S)
        return super().prompt_logprobs(prompts, **kwargs)


def test_under_warn_a_swap_is_served_before_its_probe_has_run(tmp_path):
    store = LocalStore(tmp_path / "store")
    engine = SlowProbeEngine(ReferenceEngineConfig(model=TINY))
    config = AgentConfig(
        model=MODEL, cache_dir=str(tmp_path / "agent"), store=store.uri, poll_interval_s=0.2, workers=2
    )
    agent = SyncAgent(config, engine, upstream=store)
    agent.start()
    trainer = FakeTrainer(config=TINY)
    prompts = prompts_for(TINY, count=2, length=8)
    try:
        with Publisher(store, model=MODEL, config=PublisherConfig(workers=2)) as publisher:
            trainer.advance_to(1)
            publisher.publish(trainer.state_dict(), step=1, probe=trainer.probe(prompts)).result(WAIT_S)
            assert agent.wait_for_version(1, WAIT_S)  # served while its probe is held back
            assert agent.status()["parity"] is None
            engine.release.set()
            _wait(lambda: agent.status()["parity"] is not None, "the probe never reported")
            assert agent.status()["parity"]["max_abs_dlogprob"] == 0.0
    finally:
        engine.release.set()
        agent.close()


def test_a_version_without_a_probe_is_served_unprobed(tmp_path):
    store = LocalStore(tmp_path / "store")
    engine = ReferenceEngine(ReferenceEngineConfig(model=TINY, compute_dtype="float32"))
    parity = ParityConfig(action="refuse")
    config = AgentConfig(
        model=MODEL, cache_dir=str(tmp_path / "a"), store=store.uri, poll_interval_s=0.2, parity=parity
    )
    agent = SyncAgent(config, engine, upstream=store)
    agent.start()
    try:
        with Publisher(store, model=MODEL, config=PublisherConfig(workers=2)) as publisher:
            publisher.publish(build_model(TINY, seed=1).state_dict(), step=1).result(WAIT_S)
        assert agent.wait_for_version(1, WAIT_S)
        assert agent.status()["parity"] is None
    finally:
        agent.close()
