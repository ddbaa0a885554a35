"""The trainer on 4 gloo ranks with tensor and expert parallelism, publishing without a gather.

One torchrun launch (tests/trainer/layout_scenarios.py) trains, per layout, the FSDP-only run and
the parallel one: dp_shard 2 x tp 2 on the tiny dense model, dp_shard 2 x ep 2 on the tiny
Qwen3-MoE. Here:
- the parallel runs follow the FSDP-only loss curves (first loss to 1e-5, every step to 1e-4);
- each rank handed the publisher about a quarter of the model, the four quarters exactly the
  model once; every version equals the run's gathered state bit for bit, and an agent serves the
  last one bit-exactly (its served bytes re-hashing to the version digest);
- DCP resume from the step-10 checkpoint continues bit-identically; LoRA trains the same on
  each layout, and its merged weights are W + scale B A;
- every rank's local tensors are the global tensors at the indices its boxes name (strided and
  uneven shards included), and a two-stage pipeline split of plain tensors publishes every
  tensor once (the ownership exchange).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from harness.bits import assert_bit_equal
from harness.torchrun import run_under_torchrun
from weightsync.agents.config import AgentConfig
from weightsync.agents.server import AgentServer
from weightsync.models import ModelConfig
from weightsync.reader import Reader
from weightsync.stores import LocalStore
from weightsync.transport.rpc import AgentClient
from weightsync.versions import list_versions, read_manifest

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1800)]

SCENARIOS = Path(__file__).with_name("layout_scenarios.py")
REPO = SCENARIOS.parents[2]
STEPS = 20
WAIT_S = 300
LAYOUTS = ("tp", "ep")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    proc = run_under_torchrun(SCENARIOS, str(out), nproc=4, timeout_s=1500, cwd=REPO)
    if proc.returncode != 0:
        pytest.fail(f"layout scenarios failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    handed = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    return out, torch.load(out / "layouts.pt", weights_only=False), handed


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_parallel_run_follows_the_fsdp_loss_curve(layouts, layout):
    _, results, _ = layouts
    fsdp, parallel = results[f"{layout}_fsdp"], results[layout]
    assert len(fsdp) == len(parallel) == STEPS
    assert parallel[0] == pytest.approx(fsdp[0], rel=1e-5)
    assert parallel == pytest.approx(fsdp, rel=1e-4)
    assert parallel[-1] < parallel[0] - 1.0, "the run learns"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_encodes_a_quarter_and_every_version_is_the_gathered_state(layouts, layout):
    out, results, handed = layouts
    model_bytes = sum(t.numel() * 2 for t in results[f"{layout}_final"].values())  # bf16
    per_rank = [ranks[layout] for ranks in handed]
    assert all(len(versions) == STEPS for versions in per_rank)
    for version in range(STEPS):
        shares = [versions[version] for versions in per_rank]
        assert sum(shares) == model_bytes, "every element published once"
        assert max(shares) < 0.3 * model_bytes, f"a rank encoded {shares} of {model_bytes} bytes: not a quarter"
    store = LocalStore(out / layout / "store")
    assert list_versions(store, "tiny") == list(range(1, STEPS + 1))
    reader = Reader(store, model="tiny")
    for version in range(1, STEPS + 1):
        state = reader.read(version)
        assert_bit_equal(state.state_dict(), results[f"{layout}_states"][state.manifest.step])
    # Tensor parallelism's pieces are boxes (manifest format 3); expert parallelism's are whole
    # experts and dim-0 shards, flat ranges every reader reads.
    assert read_manifest(store, "tiny", 1).format == (3 if layout == "tp" else 1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_agent_serves_the_last_version_bit_exactly(layouts, layout, tmp_path):
    out, results, _ = layouts
    table = results[f"{layout}_architecture"]
    architecture = dataclasses.asdict(ModelConfig(**table))
    config = AgentConfig(
        model="tiny",
        cache_dir=str(tmp_path / "cache"),
        name=f"{layout}-agent",
        region="r",
        store=LocalStore(out / layout / "store").uri,
        engine={"type": "reference", "model": architecture, "port": 0},
        poll_interval_s=0.5,
        workers=2,
    )
    server = AgentServer(config).start()
    try:
        assert server.agent.wait_for_version(STEPS, WAIT_S), f"the agent never served v{STEPS}"
        assert_bit_equal(server.engine.served().weights, results[f"{layout}_states"][STEPS])
        status = AgentClient(server.address).status(verify=True)
        assert (
            status.served_digest
            == status.current_digest
            == read_manifest(LocalStore(out / layout / "store"), "tiny", STEPS).digest
        )
    finally:
        server.stop(0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resume_from_a_checkpoint_is_bit_identical(layouts, layout):
    _, results, _ = layouts
    assert results[f"{layout}_resumed"] == results[layout][10:]
    assert_bit_equal(results[f"{layout}_resumed_final"], results[f"{layout}_final"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_trains_alike_and_merges_on_every_layout(layouts, layout):
    _, results, _ = layouts
    fsdp, parallel = results[f"{layout}_lora_fsdp"], results[f"{layout}_lora_parallel"]
    assert parallel[0] == pytest.approx(fsdp[0], rel=1e-5)
    assert parallel == pytest.approx(fsdp, rel=1e-4)
    assert parallel[-1] < parallel[0]
    full, merged = results[f"{layout}_lora_parallel_full"], results[f"{layout}_lora_parallel_merged"]
    targets = results[f"{layout}_lora_parallel_targets"]
    assert targets
    scale = 32.0 / 4  # lora.LORA_ALPHA / rank
    for target in targets:
        want = full[f"{target}.weight"] + scale * (full[f"{target}.lora_B.weight"] @ full[f"{target}.lora_A.weight"])
        torch.testing.assert_close(merged[f"{target}.weight"], want, rtol=1e-6, atol=1e-6)
    assert not any(".lora_" in name for name in merged)


def test_every_piece_is_the_global_tensor_at_its_indices(layouts):
    _, results, _ = layouts
    assert results["tp_pieces"] == {
        "bad": [],
        "forms": ["Replicate", "Shard", "_StridedShard", "boxes", "flat"],
    }, "tp 2 x FSDP 2: column and row blocks, interleaved (strided) and uneven rows"
    assert results["ep_pieces"] == {"bad": [], "forms": ["Shard", "flat"]}
    assert results["ep_experts_on_rank_0"] == [0, 1, 2, 3], "ep 2: half of the 8 experts on each ep rank"
    assert results["tp_experts_on_rank_0"] == []


def test_a_two_stage_pipeline_split_publishes_each_tensor_once(layouts):
    out, results, _ = layouts
    assert results["pipeline_failures"] == 0
    state = Reader(LocalStore(out / "pipeline"), model="pipeline").read(1)
    assert_bit_equal(state.state_dict(), results["pipeline_full"])
