"""The numerical-parity probe (weightsync/format/probe.py, agents/parity.py): its format in the
manifest, the figures, and a sync agent probing its engine after every swap.

- parity holds: on the reference engine in float32, the engine's log-probs equal the trainer's
  (max |dlogprob| <= 1e-6, in practice 0), dense and MoE, expert choices included;
- a real mismatch is caught: an engine that corrupts one tensor after the digest check (dense: the
  output layer; MoE: one layer's router) is flagged under each action: warn (a WARNING), alert (an
  ERROR and the alerts counter), refuse (the agent swaps the previous version back in, bit for bit,
  for a copying and a zero-copy engine, never retries the refused version, and takes the next
  good one);
- a probe never delays a swap under warn: the version is served before its probe has run.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import numpy as np
import pytest
import torch

from harness.bits import assert_bit_equal
from harness.fake_trainer import TINY, FakeTrainer
from weightsync.agents.config import AgentConfig, parse_agent_config
from weightsync.agents.engines.reference import ReferenceEngine, ReferenceEngineConfig
from weightsync.agents.parity import ParityConfig, compare
from weightsync.agents.sync import SyncAgent
from weightsync.errors import ConfigError, FormatError
from weightsync.format.manifest import parse_manifest
from weightsync.format.probe import MAX_PROBE_BYTES, Probe, probe_from_json
from weightsync.metrics import METRICS
from weightsync.models import ModelConfig, build_model
from weightsync.models.probe import default_prompts, greedy_extend, run_probe, to_probe
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.stores import LocalStore
from weightsync.versions import read_manifest_bytes

MODEL = "parity-lm"
WAIT_S = 120.0
MOE = ModelConfig(
    vocab_size=259,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    model_type="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
)
CORRUPT = {"dense": "lm_head.weight", "moe": "model.layers.0.mlp.gate.weight"}


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


class CorruptingEngine(ReferenceEngine):
    """A deliberately wrong engine: for the versions in `corrupt` it serves one tensor scaled
    after the agent's digest check (as a bad fused-layout load would), everything else as handed."""

    def __init__(self, config: ReferenceEngineConfig, *, tensor: str, corrupt: set[int]) -> None:
        super().__init__(config)
        self.tensor, self.corrupt = tensor, corrupt

    def swap(self, version, weights, **kwargs):
        if version in self.corrupt:
            weights = dict(weights)
            weights[self.tensor] = weights[self.tensor] * -3.0
        return super().swap(version, weights, **kwargs)


def trainer_probe(trainer: FakeTrainer, prompts) -> Probe:
    """What the trainer side computes: its forward on the published (bf16-rounded) weights, fp32."""
    rounded = {n: t.to(torch.bfloat16).float() for n, t in trainer.state_dict().items()}
    return to_probe(prompts, run_probe(trainer.model, prompts, weights=rounded))


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
        probe = trainer_probe(self.trainer, self.prompts)
        self.publisher.publish(self.trainer.state_dict(), step=step, probe=probe).result(timeout=WAIT_S)
        return self.trainer.published()


@pytest.fixture
def rig(tmp_path, request):
    """A publisher writing probes, and one agent over the store with a (possibly wrong) engine.
    `request.param`: (architecture, compute dtype, parity settings, versions the engine corrupts)."""
    arch_name, dtype, parity, corrupt = request.param
    arch = TINY if arch_name == "dense" else MOE
    store = LocalStore(tmp_path / "store")
    publisher = Publisher(store, model=MODEL, config=PublisherConfig(workers=2))
    engine = CorruptingEngine(
        ReferenceEngineConfig(model=arch, compute_dtype=dtype), tensor=CORRUPT[arch_name], corrupt=corrupt
    )
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
    prompts = default_prompts(arch.vocab_size, count=3, length=12)
    yield Rig(store, publisher, FakeTrainer(config=arch), agent, engine, metrics, prompts)
    agent.close()
    publisher.close()


def _report(rig: Rig, version: int) -> dict:
    """The version's parity report in the ledger, once its probe has run (a deadline, not a timing)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for entry in rig.agent.status()["ledger"]:
            if entry["version"] == version and entry["parity"]:
                return entry["parity"]
        time.sleep(0.05)
    raise AssertionError(f"v{version} was never probed: {rig.agent.status()['ledger']}")


# ----------------------------------------------------------------------------- the format


def test_a_probe_round_trips_through_the_manifest_and_refuses_damage():
    prompts = default_prompts(300, count=2, length=5)
    experts = np.arange(10 * 3 * 2, dtype=np.uint16).reshape(10, 3, 2) % 8
    probe = Probe(prompts=prompts, logprobs=-np.linspace(0.1, 5, 8, dtype=np.float32), experts=experts)
    doc = probe.to_json()
    back = probe_from_json(doc)
    assert back.prompts == probe.prompts and np.array_equal(back.logprobs, probe.logprobs)
    assert np.array_equal(back.experts, experts) and back.compute_dtype == "float32"
    with pytest.raises(FormatError, match="its own xxh3"):
        probe_from_json({**doc, "logprobs": doc["logprobs"][:-4] + "AAAA"})
    with pytest.raises(FormatError, match="fields"):
        probe_from_json({k: v for k, v in doc.items() if k != "top_k"})
    with pytest.raises(FormatError, match="8 log-probs"):
        Probe(prompts=prompts, logprobs=np.zeros(7, np.float32) - 1)
    with pytest.raises(FormatError, match="exceeds"):
        Probe(prompts=[[1] * 4000] * 4, logprobs=-np.ones(4 * 3999, np.float32)).to_json()


def test_expert_choices_of_a_large_moe_are_cut_to_the_bound():
    prompts = default_prompts(1000, count=4, length=32)
    layers, top_k = 48, 8  # Qwen3-30B-A3B's routing per token
    run_experts = [torch.randint(0, 128, (32, layers, top_k)).sort(-1).values for _ in prompts]
    run = type("Run", (), {"logprobs": [-torch.rand(31) for _ in prompts], "experts": run_experts})()
    doc = to_probe(prompts, run).to_json()
    assert 0 < doc["expert_positions"] < 128 and len(repr(doc)) <= MAX_PROBE_BYTES + 1024


def test_trainer_prompts_continue_greedily_from_seeded_start_tokens():
    model = build_model(TINY, seed=3)
    starts = default_prompts(TINY.vocab_size, count=3, length=1)
    assert starts == default_prompts(TINY.vocab_size, count=3, length=1)  # the same every version
    prompts = greedy_extend(model, starts, 10)
    assert [p[:1] for p in prompts] == starts and {len(p) for p in prompts} == {10}
    with torch.no_grad():
        logits = model(torch.tensor(prompts))
    assert torch.equal(logits[:, :-1].argmax(-1), torch.tensor(prompts)[:, 1:])  # each the model's own choice


def test_the_figures():
    probe = Probe(prompts=[[1, 2, 3]], logprobs=np.array([-1.0, -2.0], np.float32))
    max_abs, kl, mismatch, tokens = compare(probe, [torch.tensor([-1.0, -2.5])], None)
    assert max_abs == pytest.approx(0.5) and tokens == 2 and mismatch is None
    assert kl == pytest.approx((np.expm1(-0.5) + 0.5) / 2)
    assert compare(probe, [torch.tensor([-1.0, -2.0])], None)[:2] == (0.0, 0.0)
    with pytest.raises(FormatError, match="1 log-probs for probe prompt 0, not 2"):
        compare(probe, [torch.tensor([-1.0])], None)


def test_parity_settings_are_checked():
    base = {"model": "m", "cache_dir": "agent-cache", "engine": {"type": "reference", "model": {}}}
    assert parse_agent_config({**base, "parity": {"action": "refuse"}}).parity.action == "refuse"
    with pytest.raises(ConfigError, match="action"):
        parse_agent_config({**base, "parity": {"action": "panic"}})
    with pytest.raises(ConfigError, match="max_abs_dlogrob"):
        parse_agent_config({**base, "parity": {"max_abs_dlogrob": 1.0}})


# ------------------------------------------------------------------------- parity holds


@pytest.mark.parametrize(
    "rig", [("dense", "float32", {}, set()), ("moe", "float32", {}, set())], ids=["dense", "moe"], indirect=True
)
def test_the_reference_engine_computes_what_the_trainer_computed(rig):
    for step in (1, 2):
        want = rig.publish(step)
        assert rig.agent.wait_for_version(step, WAIT_S)
        report = _report(rig, step)
        assert report["max_abs_dlogprob"] <= 1e-6 and report["mean_kl"] <= 1e-9, report
        assert report["action"] == "ok" and not report["breaches"]
        if rig.trainer.model.config.is_moe:
            assert report["expert_mismatch"] == 0.0
        else:
            assert report["expert_mismatch"] is None
        assert_bit_equal(rig.engine.served().weights, {n: t.float() for n, t in want.items()})
    status = rig.agent.status()
    assert status["parity"]["version"] == 2
    assert rig.metrics.values["agent/parity_max_abs_dlogprob"] <= 1e-6
    _, data = read_manifest_bytes(rig.store, MODEL, 2)
    assert "probe" in parse_manifest(data).producer  # signed with the rest of the manifest


# -------------------------------------------------------------------- a mismatch caught


@pytest.mark.parametrize(
    "rig",
    [
        ("dense", "float32", {"action": "warn"}, {2}),
        ("moe", "float32", {"action": "alert"}, {2}),
    ],
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
    if rig.trainer.model.config.is_moe:
        # The corrupted router picks other experts for every token, which moves a tiny random
        # model's log-probs by only ~0.02: the routing figure is what catches it.
        assert bad["expert_mismatch"] > 0.5 and bad["max_abs_dlogprob"] > 0
    else:
        assert bad["max_abs_dlogprob"] > 0.1
    assert rig.agent.served_version == 2  # warn and alert never take a version back
    level = logging.WARNING if action == "warn" else logging.ERROR
    assert any(r.levelno == level and "v2 breaches parity" in r.getMessage() for r in caplog.records)
    assert rig.metrics.counts.get("agent/parity_alerts", 0) == (1 if action == "alert" else 0)


@pytest.mark.parametrize(
    "rig",
    [
        ("dense", "float32", {"action": "refuse"}, {2}),
        ("moe", "bfloat16", {"action": "refuse", "max_abs_dlogprob": 0.25, "max_mean_kl": 0.01}, {2}),
    ],
    ids=["copying-dense", "zero-copy-moe"],
    indirect=True,
)
def test_refuse_rolls_back_to_the_previous_version_bit_exactly(rig):
    v1 = rig.publish(1)
    assert rig.agent.wait_for_version(1, WAIT_S)
    assert _report(rig, 1)["action"] == "ok"
    rig.publish(2)
    deadline = time.monotonic() + WAIT_S
    while 2 not in rig.agent.status()["refused"]:
        assert time.monotonic() < deadline, rig.agent.status()
        time.sleep(0.05)
    status = rig.agent.status()
    entry = next(e for e in status["ledger"] if e["version"] == 2)
    assert entry["outcome"] == "refused" and entry["parity"]["action"] == "refuse"
    assert status["current_version"] == 1 and rig.engine.served_version() == 1
    dtype = torch.float32 if rig.engine.config.compute_dtype == "float32" else torch.bfloat16
    assert_bit_equal(rig.engine.served().weights, {n: t.to(dtype) for n, t in v1.items()})
    assert rig.metrics.counts["agent/parity_rollbacks"] == 1
    time.sleep(1.5)  # past the broken-version retry: a refused version is never tried again
    assert rig.engine.served_version() == 1 and rig.metrics.counts["agent/parity_rollbacks"] == 1
    v3 = rig.publish(3)  # the next good version is served (a delta on the refused one)
    assert rig.agent.wait_for_version(3, WAIT_S)
    assert _report(rig, 3)["action"] == "ok"
    assert_bit_equal(rig.engine.served().weights, {n: t.to(dtype) for n, t in v3.items()})


# ------------------------------------------------------------------ never delays a swap


class SlowProbeEngine(ReferenceEngine):
    """Answers the probe only once the test lets it: shows that the swap did not wait for it."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.release = threading.Event()

    def prompt_logprobs(self, prompts, *, timeout_s=60.0):
        assert self.release.wait(WAIT_S)
        return super().prompt_logprobs(prompts, timeout_s=timeout_s)


def test_under_warn_a_swap_is_served_before_its_probe_has_run(tmp_path):
    store = LocalStore(tmp_path / "store")
    engine = SlowProbeEngine(ReferenceEngineConfig(model=TINY, compute_dtype="float32"))
    config = AgentConfig(
        model=MODEL, cache_dir=str(tmp_path / "agent"), store=store.uri, poll_interval_s=0.2, workers=2
    )
    agent = SyncAgent(config, engine, upstream=store)
    agent.start()
    trainer = FakeTrainer(config=TINY)
    prompts = default_prompts(TINY.vocab_size, count=2, length=8)
    try:
        with Publisher(store, model=MODEL, config=PublisherConfig(workers=2)) as publisher:
            trainer.advance_to(1)
            publisher.publish(trainer.state_dict(), step=1, probe=trainer_probe(trainer, prompts)).result(WAIT_S)
            assert agent.wait_for_version(1, WAIT_S)  # served while its probe is held back
            assert agent.status()["parity"] is None
            engine.release.set()
            deadline = time.monotonic() + WAIT_S
            while agent.status()["parity"] is None:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert agent.status()["parity"]["max_abs_dlogprob"] <= 1e-6
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
