"""The FSDP2 trainer on 2 gloo ranks (CPU): equivalence with 1 rank, bit-identical resume,
gradient accumulation and activation checkpointing, GRPO, mixed precision + offload, the
guard, sharded publishing (pulled back bit for bit), a rank killed mid-publish, and the
training engine on its own (one step against plain torch; an old Training API state loads).

Each torchrun launch costs seconds, so one launch runs a whole suite of small jobs
(`tests/trainer/trainer_scenarios.py`) and module-scoped fixtures hand its results to several tests.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.bits import assert_bit_equal
from harness.torchrun import run_under_torchrun
from weightsync.format.probe import probe_from_json
from weightsync.models import ModelConfig
from weightsync.models.probe import run_probe
from weightsync.reader import Reader
from weightsync.stores import LocalStore
from weightsync.versions import list_versions, read_manifest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCENARIOS = Path(__file__).with_name("trainer_scenarios.py")
REPO = SCENARIOS.parents[2]


def launch(suite: str, out: Path, *more: Path, nproc: int, check: bool = True) -> subprocess.CompletedProcess:
    proc = run_under_torchrun(SCENARIOS, suite, str(out), *map(str, more), nproc=nproc, timeout_s=240, cwd=REPO)
    if check and proc.returncode != 0:
        pytest.fail(f"{suite} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    launch("two_ranks", out, nproc=2)
    return out, torch.load(out / "two_ranks.pt", weights_only=False)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, two_ranks):
    out = tmp_path_factory.mktemp("one_rank")
    launch("one_rank", out, two_ranks[0], nproc=1)
    return torch.load(out / "one_rank.pt", weights_only=False)


def losses(history):
    return [m["loss"] for m in history]


def test_two_ranks_match_one_rank(two_ranks, one_rank):
    _, results = two_ranks
    assert len(results["plain"]) == 6
    assert losses(results["plain"]) == pytest.approx(losses(one_rank["plain"]), rel=1e-5)
    grad_norms = [m["grad_norm"] for m in results["plain"]]
    assert grad_norms == pytest.approx([m["grad_norm"] for m in one_rank["plain"]], rel=1e-4)
    assert losses(results["plain"])[-1] < losses(results["plain"])[0]  # it learns


def test_grpo_two_ranks_match_one_rank(two_ranks, one_rank):
    _, results = two_ranks
    grpo = results["grpo"]
    assert losses(grpo) == pytest.approx(losses(one_rank["grpo"]), rel=1e-4, abs=1e-6)
    assert all(m["grpo/kl"] >= 0 for m in grpo)
    assert grpo[0]["grpo/kl"] == pytest.approx(0.0, abs=1e-9)  # the policy starts as the reference
    assert grpo[-1]["grpo/kl"] > 0
    assert all(m["data/staleness_steps"] == m["step"] for m in grpo)  # sampled by version 0


def test_resume_is_bit_identical(two_ranks):
    _, results = two_ranks
    resumed = results["resumed"]
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert losses(resumed) == losses(results["plain"])[3:]  # exact, not approximate
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in results["plain"]][3:]
    assert_bit_equal(results["resumed_state"], results["plain_state"])


def test_two_rank_checkpoint_resumes_on_one_rank(two_ranks, one_rank):
    _, results = two_ranks
    elastic = one_rank["elastic"]
    assert [m["step"] for m in elastic] == [4, 5, 6]
    assert losses(elastic) == pytest.approx(losses(results["plain"])[3:], rel=1e-5)


def test_hsdp_four_ranks_match_one_rank_and_publish(tmp_path, one_rank):
    launch("hsdp", tmp_path, nproc=4)
    results = torch.load(tmp_path / "hsdp.pt", weights_only=False)
    assert losses(results["history"]) == pytest.approx(losses(one_rank["plain"]), rel=1e-5)
    store = LocalStore(tmp_path / "store")
    assert list_versions(store, "tiny") == [1, 2, 3, 4, 5, 6]
    state = Reader(store, model="tiny").read(6)
    assert_bit_equal(state.state_dict(), results["published_states"][6])


def test_initial_weights_from_hf_directory(two_ranks):
    _, results = two_ranks
    assert losses(results["from_hf_dir"]) == losses(results["plain"])[:2]


def test_checkpoints_keep_last(two_ranks):
    out, _ = two_ranks
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["step-00000003", "step-00000006"]
    assert not list((out / "resume").glob(".tmp-*"))


def test_grad_accumulation_matches_plain(two_ranks):
    _, results = two_ranks
    assert losses(results["accum"]) == pytest.approx(losses(results["plain"]), rel=1e-5)


def test_activation_checkpointing_matches_plain(two_ranks):
    _, results = two_ranks
    assert losses(results["ac"]) == pytest.approx(losses(results["plain"]), rel=1e-6)


def test_bf16_with_offload_trains(two_ranks):
    _, results = two_ranks
    mixed = losses(results["bf16_offload"])
    assert all(math.isfinite(x) for x in mixed)
    assert mixed == pytest.approx(losses(results["plain"]), rel=0.05)  # bf16 compute: close, not equal
    assert mixed[-1] < mixed[0]


def test_guard_skips_and_rolls_back(two_ranks):
    _, results = two_ranks
    history = results["guard"]
    assert [m["verdict"] for m in history] == [
        "accept",
        "skip",
        "accept",
        "accept",
        "skip",
        "skip",
        "rollback",
        "accept",
        "accept",
        "accept",
        "accept",
    ]
    assert [m["step"] for m in history] == [1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]
    assert all(torch.isfinite(t).all() for t in results["guard_state"].values())


def test_local_shards_reassemble_to_full_state(two_ranks):
    out, results = two_ranks
    full = results["plain_state"]
    parts = [torch.load(out / f"shards-rank{r}.pt", weights_only=False) for r in range(2)]
    assert "model.embed_tokens.weight" in parts[0]["placements"]  # 259 rows: uneven shards (130 + 129)
    for name, want in full.items():
        flat = torch.full((want.numel(),), float("nan"))
        covered = 0
        for part in parts:
            if name not in part["shards"]:
                continue
            local = part["shards"][name].reshape(-1)
            shape, start = part["placements"].get(name, (tuple(want.shape), 0))
            assert tuple(shape) == tuple(want.shape)
            flat[start : start + local.numel()] = local
            covered += local.numel()
        assert covered == want.numel(), name
        assert torch.equal(flat.reshape(want.shape), want), name


def test_published_versions_equal_gathered_bf16_state(two_ranks):
    out, results = two_ranks
    store = LocalStore(out / "store")
    versions = list_versions(store, "tiny")
    assert versions == [1, 2, 3, 4, 5, 6]
    reader = Reader(store, model="tiny")
    state = None
    for version in versions:
        state = reader.read(version) if state is None else reader.advance(state, version)
        step = read_manifest(store, "tiny", version).step
        assert step == version
        assert_bit_equal(state.state_dict(), results["published_states"][step])


def test_every_version_carries_the_trainers_parity_probe(two_ranks):
    """Each version's parity probe, computed by the 2 ranks on the weights exactly as published
    (each tensor gathered whole), equals what a correct engine computes on the published tensors
    in each recorded dtype, to the last bit; its prompts are distinct tokens, the same for every
    version; it carries the training forward's top-k for the gap figure."""
    out, results = two_ranks
    store = LocalStore(out / "store")
    spec = {k: v for k, v in _scenario_model().items() if k != "init_seed"}
    config = ModelConfig(**spec)
    prompts = None
    for version in list_versions(store, "tiny"):
        manifest = read_manifest(store, "tiny", version)
        probe = probe_from_json(manifest.producer["probe"])
        assert len(probe.prompts) == 4 and {len(set(p)) for p in probe.prompts} == {32}
        assert prompts is None or probe.prompts == prompts
        prompts = probe.prompts
        assert probe.compute_dtypes == ("bfloat16", "float32") and probe.training.k == 8
        published = results["published_states"][manifest.step]
        dtypes = [torch.bfloat16, torch.float32]
        runs = run_probe(config, probe.prompts, published.__getitem__, dtypes=dtypes)
        for dtype in dtypes:
            want = torch.cat(runs[dtype].logprobs).numpy()
            assert np.array_equal(probe.record(str(dtype).removeprefix("torch.")).logprobs, want), (version, dtype)


def _scenario_model() -> dict:
    spec = importlib.util.spec_from_file_location("trainer_scenarios", SCENARIOS)
    scenarios = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scenarios)
    return dict(scenarios.BASE["train"]["model"])


def test_killed_rank_leaves_no_partial_version_and_restart_resumes(tmp_path):
    from weightsync.trainer.checkpoint import list_checkpoints

    killed = launch("kill", tmp_path, nproc=2, check=False)
    assert killed.returncode != 0
    store = LocalStore(tmp_path / "store")
    before = list_versions(store, "tiny")
    steps_before = [read_manifest(store, "tiny", v).step for v in before]
    # Rank 1 waited for version 4 to commit, then died writing version 5, whose other part
    # (rank 0's) is durable: the version does not exist.
    assert before == [1, 2, 3, 4] and steps_before == [1, 2, 3, 4]
    assert list((tmp_path / "store").glob("models/tiny/parts/000000000005/*/rank-00000.json"))
    reader = Reader(store, model="tiny")
    for version in before:  # every committed version is whole and verifies
        reader.read(version)
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")] == [3]

    launch("restart", tmp_path, nproc=2)
    results = torch.load(tmp_path / "restart.pt", weights_only=False)
    assert [m["step"] for m in results["history"]] == list(range(4, 11))
    after = list_versions(store, "tiny")
    new = after[len(before) :]
    assert [read_manifest(store, "tiny", v).step for v in new] == list(range(4, 11))
    assert read_manifest(store, "tiny", new[0]).kind == "full"  # a new session starts with a full version
    state = reader.read(after[-1])
    assert_bit_equal(state.state_dict(), results["published_states"][10])


def test_train_entry_point_runs_the_example_config_on_two_ranks(tmp_path):
    """What `weightsync train --config FILE --nproc 2` runs: torchrun, the example config."""
    from weightsync.trainer.checkpoint import list_checkpoints

    code = (
        "import sys; from weightsync.trainer.launch import run_train; "
        "sys.exit(run_train(sys.argv[1], nproc=2, overrides=sys.argv[2:], log_level='WARNING'))"
    )
    overrides = [
        "train.steps=3",
        "train.schedule.warmup_steps=1",
        "train.checkpoint.every_steps=2",
        f"train.checkpoint.dir={tmp_path}/ckpt",
        f"train.publish.store={tmp_path}/store",
        f"train.metrics_path={tmp_path}/metrics.jsonl",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "trainer" / "configs" / "sft_tiny.toml"), *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3] and all(m["verdict"] == "accept" for m in lines)
    assert [m["publish/version"] for m in lines] == [1, 2, 3]  # the step's own version, not the last commit
    assert [json.loads(line)["step"] for line in proc.stdout.splitlines() if line.startswith("{")] == [1, 2, 3]
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")] == [2, 3]
    assert list_versions(LocalStore(tmp_path / "store"), "sft-tiny") == [1, 2, 3]


def test_the_engine_steps_like_plain_torch_and_loads_old_api_states(tmp_path):
    """2 ranks, each with half the batch: the engine's gradient is that of the whole batch's
    loss / divisor, so one AdamW step lands where plain torch on one process lands. A state saved
    in the Training API's earlier format (step count inside DCP) resumes exactly."""
    from weightsync.models import CausalLM, token_logprobs

    launch("engine", tmp_path, nproc=2)
    results = torch.load(tmp_path / "engine.pt", weights_only=False)
    model = CausalLM(results["architecture"])
    model.load_state_dict(results["initial"])
    tokens, adamw = results["tokens"], results["adamw"]
    loss = -token_logprobs(model(tokens[:, :-1]), tokens[:, 1:]).sum() / tokens[:, 1:].numel()
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=adamw.lr, betas=adamw.betas, eps=adamw.eps, weight_decay=adamw.weight_decay
    )
    optimizer.step()
    assert results["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(results["after_one"][name], tensor, rtol=0, atol=1e-5, msg=name)
    assert results["legacy_optim_steps"] == 1
    assert_bit_equal(results["legacy_after_two"], results["after_two"])
