"""Single-process tests of the trainer's pieces: config validation, data and collation (the
loop's examples and the Training API's datums), both front ends' losses against hand
computations, the guard's decisions, the LR schedule, shard placement math, and checkpoint
discovery. No process group, no torchrun."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from weightsync.errors import ConfigError
from weightsync.format.boxes import Box
from weightsync.models import ModelConfig
from weightsync.trainer.checkpoint import list_checkpoints
from weightsync.trainer.config import (
    DataConfig,
    GuardConfig,
    LossConfig,
    ParallelConfig,
    PublishConfig,
    ScheduleConfig,
    apply_override,
    load_job_config,
    parse_job_config,
)
from weightsync.trainer.data import (
    ArithmeticSource,
    Datum,
    Example,
    JsonlSource,
    ReverseSource,
    collate,
    collate_datums,
)
from weightsync.trainer.guard import SpikeGuard, Verdict
from weightsync.trainer.losses import LOSSES, compute_loss, grpo_loss, mean_over_weights, sft_loss, sum_datum_losses
from weightsync.trainer.optim import lr_at
from weightsync.trainer.parallel import check_tp_fits
from weightsync.trainer.pieces import boxes_of

EXAMPLE_CONFIG = Path(__file__).parents[2] / "trainer" / "configs" / "sft_tiny.toml"
TINY = {
    "train": {
        "model": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        }
    }
}


# ---------------------------------------------------------------------------------- config


def test_example_config_loads():
    job = load_job_config(EXAMPLE_CONFIG)
    assert job.parallel.dp_shard == -1 and job.parallel.mixed_precision == "none"
    assert job.train.model.architecture.vocab_size == 259
    assert job.train.data.grad_accum_steps(2) == 2
    assert job.train.publish.publisher.max_in_flight == 2


def test_overrides_use_toml_values():
    job = load_job_config(EXAMPLE_CONFIG, ["train.steps=7", "parallel.cpu_offload=true", "train.publish.store=/x"])
    assert job.train.steps == 7 and job.parallel.cpu_offload is True and job.train.publish.store == "/x"
    with pytest.raises(ValueError, match="section.key=value"):
        apply_override({}, "no-equals-sign")


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"parallel": {"dp_shards": 2}}, r"unknown key \[parallel\] 'dp_shards'; did you mean 'dp_shard'\?"),
        ({"train": {"optimizer": {"lr": "fast"}}}, r"\[train.optimizer\] lr must be a number, got 'fast'"),
        ({"train": {"optimizer": {"lr": -1.0}}}, "positive"),
        ({"parallel": {"mixed_precision": "fp8"}}, r"must be one of \['none', 'bf16'\]"),
        ({"train": {"data": {"global_batch_size": 6, "micro_batch_size": 4}}}, "multiple of micro_batch_size"),
        ({"train": {"loss": {"kind": "grpo"}}}, "synthetic source"),
        ({"train": {"loss": {"kl_coef": 0.1}}}, "applies to kind"),
        ({"train": {"model": {"init_dir": "/some/dir"}}}, "exactly one of"),
        ({"train": {"model": {"hidden_sise": 32}}}, "hidden_sise"),
        ({"train": {"steps": 3, "schedule": {"warmup_steps": 5}}}, "longer than the run"),
        ({"train": {"data": {"source": "jsonl"}}}, r'\[train.data\] source = "jsonl" needs path'),
        ({"train": {"steps": -1}}, r"\[train\] steps must be >= 1, got -1"),
        ({"train": {"log_every": 0}}, r"\[train\] log_every must be >= 1, got 0"),
        ({"train": {"model": {"mlp_only_layers": ["1"]}}}, r"mlp_only_layers must be an array of integers"),
        ({"trian": {"steps": 1}}, r"unknown key 'trian'; did you mean 'train'\?"),
    ],
)
def test_invalid_configs_say_how_to_fix(patch, message):
    """Each a ConfigError (`weightsync train` exits 2) naming the setting, its value and the fix;
    `steps = -1` said "train.steps and train.log_every must be >= 1", naming neither which nor the value."""
    doc = json.loads(json.dumps(TINY))
    for section, table in patch.items():
        for key, value in table.items():
            target = doc.setdefault(section, {})
            if isinstance(value, dict):
                target.setdefault(key, {}).update(value)
            else:
                target[key] = value
    with pytest.raises(ConfigError, match=message):
        parse_job_config(doc)


def test_mesh_shape_and_accumulation_checks():
    assert ParallelConfig().mesh_shape(4) == (1, 4)
    assert ParallelConfig(dp_replicate=2).mesh_shape(4) == (2, 2)
    with pytest.raises(ValueError, match="must equal the world size"):
        ParallelConfig(dp_shard=3).mesh_shape(4)
    with pytest.raises(ValueError, match="data-parallel ranks"):
        DataConfig(global_batch_size=8, micro_batch_size=4).grad_accum_steps(4)
    assert DataConfig(global_batch_size=16, micro_batch_size=2).grad_accum_steps(2) == 4


def test_tensor_and_expert_parallel_degrees_are_checked():
    assert ParallelConfig(tp=2).mesh_shape(4) == (1, 2)
    assert ParallelConfig(ep=2, dp_shard=2).mesh_shape(4) == (1, 2)
    with pytest.raises(ValueError, match=r"x parallel.tp \(2\) .* must equal the world size \(6\)"):
        ParallelConfig(tp=2, dp_shard=2).mesh_shape(6)
    for fields, match in (
        ({"tp": 0}, "tp must be an integer >= 1"),
        ({"ep": True}, "ep must be an integer >= 1"),
        ({"tp": 2, "ep": 2}, "cannot both be > 1"),
        ({"tp": 2, "dp_replicate": 2}, "need dp_replicate = 1"),
        ({"ep": 2, "frozen_experts": "int4"}, "frozen_experts with ep > 1 is not built"),
    ):
        with pytest.raises(ValueError, match=match):
            ParallelConfig(**fields)
    with pytest.raises(ValueError, match="Mixture-of-Experts model is split with parallel.ep"):
        check_tp_fits(ModelConfig(model_type="qwen3_moe", num_experts=4), 2)
    with pytest.raises(ValueError, match="must divide the model's num_key_value_heads"):
        check_tp_fits(ModelConfig(num_attention_heads=4, num_key_value_heads=1), 2)


def test_a_pieces_boxes_follow_its_local_element_order():
    """Per-dim index lists (what a DTensor's placements leave a rank) become boxes whose elements,
    in order, are the local tensor's: runs of one dim, each index of the dims before the last
    fragmented one a box of its own, nothing for an empty piece."""
    rows, cols = torch.tensor([0, 1, 4, 5]), torch.arange(2, 6)  # interleaved rows x a column block
    assert boxes_of([rows, cols]) == [Box((0, 2), (2, 4)), Box((4, 2), (2, 4))]
    assert boxes_of([torch.arange(3), torch.tensor([0, 1, 6, 7])]) == [
        Box((r, c), (1, 2)) for r in range(3) for c in (0, 6)
    ]
    assert boxes_of([torch.arange(4, 8), torch.arange(10)]) == [Box((4, 0), (4, 10))]
    assert boxes_of([torch.arange(0), torch.arange(3)]) == []
    full = torch.arange(80).reshape(8, 10)
    for indices in ([rows, cols], [torch.arange(3), torch.tensor([0, 1, 6, 7])]):
        local = full[torch.meshgrid(*indices, indexing="ij")].reshape(-1)
        flat = torch.cat(
            [full[b.offsets[0] : b.stops[0], b.offsets[1] : b.stops[1]].reshape(-1) for b in boxes_of(indices)]
        )
        assert torch.equal(local, flat)


# ------------------------------------------------------------------------------------ data


def test_collate_shifts_pads_and_weights():
    a = Example(tokens=[5, 6, 7, 8], loss_weights=[0, 0, 1, 1])
    b = Example(tokens=[9, 10], loss_weights=[0, 1])
    mb = collate([a, b], max_seq_len=64, pad_multiple=8)
    assert mb.input_ids.shape == (2, 8)
    assert mb.input_ids[0, :3].tolist() == [5, 6, 7] and mb.targets[0, :3].tolist() == [6, 7, 8]
    assert mb.loss_weights[0].tolist() == [0, 1, 1, 0, 0, 0, 0, 0]
    assert mb.loss_weights[1].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert mb.advantages is None and mb.sampler_steps.tolist() == [-1, -1]
    with pytest.raises(ValueError, match="max_seq_len"):
        collate([a], max_seq_len=3)


def test_examples_are_validated():
    with pytest.raises(ValueError, match="loss_weights has 2 entries for 3 tokens"):
        Example(tokens=[1, 2, 3], loss_weights=[0, 1])
    with pytest.raises(ValueError, match=">= 0"):
        Example(tokens=[1, 2], loss_weights=[0, -1])
    with pytest.raises(ValueError, match="sampler_logprobs"):
        collate([Example(tokens=[1, 2], loss_weights=[0, 1], advantage=1.0)], max_seq_len=8)


@pytest.mark.parametrize("cls", [ArithmeticSource, ReverseSource])
def test_synthetic_sources_shard_the_same_global_batch(cls):
    single = cls(dp_rank=0, dp_size=1, seed=7)
    ranks = [cls(dp_rank=r, dp_size=2, seed=7) for r in range(2)]
    for _ in range(3):  # a global batch of 8, as 1 rank x 8 or 2 ranks x 2 micro-batches x 2
        want = [e.tokens.tolist() for e in single.take(8)]
        got = []
        for _micro in range(2):
            parts = [src.take(2) for src in ranks]
            got += [e.tokens.tolist() for part in parts for e in part]
        assert sorted(got) == sorted(want)


def test_synthetic_example_is_a_verifiable_task():
    example = ArithmeticSource(dp_rank=0, dp_size=1, seed=0).take(1)[0]
    text = bytes(t for t in example.tokens.tolist() if t < 256).decode()
    prompt = bytes(
        t for t, w in zip(example.tokens.tolist(), example.loss_weights.tolist(), strict=True) if t < 256 and w == 0
    ).decode()
    a, b = prompt.rstrip("=").split("+")
    assert text == f"{prompt}{int(a) + int(b)}"
    assert example.tokens[-1] == 257 and example.loss_weights[-1] == 1  # EOS is trained


def test_source_position_resumes(tmp_path):
    source = ArithmeticSource(dp_rank=1, dp_size=2, seed=3)
    source.take(4)
    saved = source.state_dict()
    following = [e.tokens.tolist() for e in source.take(4)]
    fresh = ArithmeticSource(dp_rank=1, dp_size=2, seed=3)
    fresh.load_state_dict(saved)
    assert [e.tokens.tolist() for e in fresh.take(4)] == following
    with pytest.raises(ValueError, match="cannot resume"):
        ArithmeticSource(dp_rank=0, dp_size=2, seed=4).load_state_dict(saved)


def test_jsonl_source_epochs_shuffle_and_resume(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"tokens": [1, i + 2], "loss_weights": [0, 1]}) + "\n\n" for i in range(5)))
    source = JsonlSource(path, dp_rank=0, dp_size=1, seed=0, shuffle=True)
    epoch1 = [e.tokens[1].item() for e in source.take(5)]
    assert sorted(epoch1) == [2, 3, 4, 5, 6]
    saved = source.state_dict()
    epoch2 = [e.tokens[1].item() for e in source.take(5)]
    assert sorted(epoch2) == [2, 3, 4, 5, 6] and epoch2 != epoch1
    again = JsonlSource(path, dp_rank=0, dp_size=1, seed=0, shuffle=True)
    again.load_state_dict(saved)
    assert [e.tokens[1].item() for e in again.take(5)] == epoch2
    path.write_text(path.read_text() + '{"tokens": [1]}\n')
    with pytest.raises(ValueError, match="changed since the checkpoint"):
        JsonlSource(path, dp_rank=0, dp_size=1, seed=0, shuffle=True).load_state_dict(saved)


# ---------------------------------------------------------------------------------- losses


def test_sft_loss_is_weighted_token_mean():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]])
    weights = torch.tensor([[0.0, 1.0, 1.0]])
    loss, metrics = mean_over_weights(sft_loss(logprobs, weights), weights)
    assert loss.item() == pytest.approx(2.5) and metrics["loss/nll"] == pytest.approx(2.5)


def grpo(logprobs, sampler, advantage, weights=None, **kwargs):
    logprobs = torch.tensor([logprobs], requires_grad=True)
    weights = torch.ones_like(logprobs) if weights is None else torch.tensor([weights])
    options = {"clip_low": 0.2, "clip_high": 0.28, **kwargs}
    sums = grpo_loss(logprobs, torch.tensor([sampler]), torch.tensor([advantage]), weights, **options)
    loss, metrics = mean_over_weights(sums, weights)
    loss.backward()
    return loss.item(), logprobs.grad[0].tolist(), metrics


def test_grpo_matches_hand_computation():
    # ratios 1 and exp(-0.5) = 0.6065, A = +1: neither clip binds (min picks the unclipped term).
    loss, grad, metrics = grpo([-1.0, -2.0], [-1.0, -1.5], 1.0)
    r = math.exp(-0.5)
    assert loss == pytest.approx(-(1 + r) / 2)
    assert grad == pytest.approx([-0.5, -r / 2])  # d(-r A)/dlogp = -r A, over 2 tokens
    assert metrics["grpo/ratio"] == pytest.approx((1 + r) / 2) and metrics["grpo/clip_frac"] == 0


def test_grpo_clipping_stops_the_gradient():
    # A > 0, ratio 1.5 > 1 + 0.28: the clipped term is smaller, so it counts and has no gradient.
    loss, grad, metrics = grpo([math.log(1.5)], [0.0], 1.0)
    assert loss == pytest.approx(-1.28) and grad == [0.0] and metrics["grpo/clip_frac"] == 1
    # A < 0, ratio 0.5 < 1 - 0.2: clipped at 0.8, no gradient.
    loss, grad, _ = grpo([math.log(0.5)], [0.0], -1.0)
    assert loss == pytest.approx(0.8) and grad == [0.0]
    # A < 0, ratio 1.5: pessimistic unclipped term, full gradient -r A = 1.5.
    loss, grad, _ = grpo([math.log(1.5)], [0.0], -1.0)
    assert loss == pytest.approx(1.5) and grad == pytest.approx([1.5])


def test_grpo_dual_clip_caps_negative_advantages():
    loss, grad, _ = grpo([math.log(5.0)], [0.0], -1.0, dual_clip=3.0)
    assert loss == pytest.approx(3.0) and grad == [0.0]
    loss, _, _ = grpo([math.log(5.0)], [0.0], -1.0, dual_clip=0.0)
    assert loss == pytest.approx(5.0)


def test_grpo_kl_is_zero_for_identical_models_and_k3_otherwise():
    logprobs = [-1.0, -2.0]
    _, _, metrics = grpo(logprobs, logprobs, 1.0, kl_coef=0.1, ref_logprobs=torch.tensor([logprobs]))
    assert metrics["grpo/kl"] == 0.0
    loss, _, metrics = grpo([-1.0], [-1.0], 0.0, kl_coef=0.5, ref_logprobs=torch.tensor([[-1.5]]))
    k3 = math.exp(-0.5) + 0.5 - 1
    assert metrics["grpo/kl"] == pytest.approx(k3) and loss == pytest.approx(0.5 * k3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo([-1.0], [-1.0], 1.0, kl_coef=0.1)


def test_grpo_ignores_garbage_at_masked_positions():
    loss, grad, _ = grpo([-1.0, -1.0], [-1.0, float("-inf")], -1.0, weights=[1.0, 0.0])
    assert math.isfinite(loss) and all(math.isfinite(g) for g in grad)


def test_compute_loss_dispatches_on_kind():
    example = Example(tokens=[1, 2, 3], loss_weights=[0, 1, 1], advantage=1.0, sampler_logprobs=[0, -1, -1])
    mb = collate([example], max_seq_len=8, pad_multiple=1)
    logprobs = torch.full(mb.targets.shape, -1.0)
    sums = compute_loss(LossConfig(kind="grpo"), logprobs, mb)
    assert sums.loss.item() == pytest.approx(-2.0)  # on-policy: ratio 1, A = 1, two tokens
    assert sums.metrics["loss/nll"].item() == pytest.approx(2.0)
    assert compute_loss(LossConfig(), logprobs, mb).loss.item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="advantage"):
        compute_loss(
            LossConfig(kind="grpo"), logprobs, collate([Example(tokens=[1, 2], loss_weights=[0, 1])], max_seq_len=8)
        )


def api_loss(name, policy_logprobs, config=None, **inputs):
    """LOSSES[name] on one datum: (per-token losses, d loss / d policy log-probs)."""
    policy = torch.tensor(policy_logprobs, requires_grad=True)
    config = {**LOSSES[name].config_defaults, **(config or {})}
    per_token = LOSSES[name].fn(policy, {k: torch.tensor(v) for k, v in inputs.items()}, config)
    per_token.sum().backward()
    return per_token.tolist(), policy.grad.tolist()


def test_training_api_losses_follow_their_public_definitions():
    r = math.exp(0.5)  # ratio of the first token: logp -1 against the sampler's -1.5
    losses, grad = api_loss("cross_entropy", [-1.0, -2.0], weights=[0.5, 2.0])
    assert losses == pytest.approx([0.5, 4.0]) and grad == pytest.approx([-0.5, -2.0])
    sampled = {"logprobs": [-1.5, -2.0], "advantages": [1.0, -2.0]}
    losses, grad = api_loss("importance_sampling", [-1.0, -2.0], **sampled)
    assert losses == pytest.approx([-r, 2.0]) and grad == pytest.approx([-r, 2.0])
    # ppo: ratio r = 1.65 > 1.2 with A = +1 is clipped (no gradient); ratio 1 with A = -2 is not.
    losses, grad = api_loss("ppo", [-1.0, -2.0], **sampled)
    assert losses == pytest.approx([-1.2, 2.0]) and grad == pytest.approx([0.0, 2.0])
    # cispo: the clipped ratio is a constant weight on logp * A, so every token has a gradient.
    losses, grad = api_loss("cispo", [-1.0, -2.0], {"clip_high_threshold": 1.5}, **sampled)
    assert losses == pytest.approx([1.5 * 1.0, -1.0 * 2.0 * 2.0]) and grad == pytest.approx([-1.5, 2.0])


def test_ppo_and_grpo_are_the_same_clipped_objective():
    """The Training API's ppo with thresholds (1 - eps_low, 1 + eps_high) is the loop's GRPO
    policy term (no KL, no dual clip) on a sequence with one advantage: one formula, two names."""
    logprobs, sampler = [-1.0, -0.2, -3.0, -0.7], [-1.4, -0.9, -2.5, -0.7]
    for advantage in (1.5, -0.5):
        ppo, ppo_grad = api_loss(
            "ppo",
            logprobs,
            {"clip_low_threshold": 1 - 0.2, "clip_high_threshold": 1 + 0.28},
            logprobs=sampler,
            advantages=[advantage] * 4,
        )
        weights = torch.ones(1, 4)
        lp = torch.tensor([logprobs], requires_grad=True)
        grpo_sums = grpo_loss(
            lp, torch.tensor([sampler]), torch.tensor([advantage]), weights, clip_low=0.2, clip_high=0.28
        )
        grpo_sums.loss.backward()
        assert grpo_sums.loss.item() == pytest.approx(sum(ppo)) and lp.grad[0].tolist() == pytest.approx(ppo_grad)


def test_datums_collate_into_one_padded_batch_and_sum_their_losses():
    data = [
        Datum(np.array([5, 6, 7]), {"target_tokens": np.array([6, 7, 8]), "weights": np.array([0.0, 1.0, 2.0])}),
        Datum(np.array([9]), {"target_tokens": np.array([3]), "weights": np.array([1.0])}),
    ]
    batch = collate_datums(data, torch.device("cpu"))
    assert batch.input_ids.tolist() == [[5, 6, 7], [9, 0, 0]] and batch.targets.tolist() == [[6, 7, 8], [3, 0, 0]]
    assert batch.lengths == (3, 1) and batch.inputs[1]["weights"].dtype == torch.float32
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -50.0, -60.0]], requires_grad=True)
    sums = sum_datum_losses("cross_entropy", {}, logprobs, batch)
    assert sums.loss.item() == pytest.approx(2.0 + 6.0 + 4.0)  # the padded positions never count
    assert [t.tolist() for t in sums.per_token] == [[0.0, 2.0, 6.0], [4.0]]
    # A rank without a datum runs one padding token whose loss is 0 but still reaches the model.
    empty = collate_datums([], torch.device("cpu"))
    assert empty.input_ids.shape == (1, 1) and empty.lengths == ()
    padding = torch.tensor([[-1.0]], requires_grad=True)
    nothing = sum_datum_losses("ppo", LOSSES["ppo"].config_defaults, padding, empty)
    nothing.loss.backward()
    assert nothing.loss.item() == 0.0 and padding.grad is not None and nothing.per_token == ()


# ----------------------------------------------------------------------------------- guard


def test_guard_accepts_skips_and_rolls_back():
    guard = SpikeGuard(GuardConfig(min_history=3, spike_factor=3.0, rollback_after=2))
    for loss in (2.0, 2.1, 1.9):
        assert guard.judge({"loss": loss, "grad_norm": 1.0}).verdict is Verdict.ACCEPT
    spike = guard.judge({"loss": 6.5, "grad_norm": 1.0})
    assert spike.verdict is Verdict.SKIP and "spike" in spike.reason
    assert guard.judge({"loss": 2.0, "grad_norm": 1.0}).verdict is Verdict.ACCEPT  # streak broken
    assert guard.judge({"loss": float("nan"), "grad_norm": 1.0}).verdict is Verdict.SKIP
    decision = guard.judge({"loss": 1.0, "grad_norm": float("inf")})
    assert decision.verdict is Verdict.ROLLBACK and "grad_norm" in decision.reason


def test_guard_waits_for_history_and_can_only_skip():
    guard = SpikeGuard(GuardConfig(min_history=3, action="skip", rollback_after=1))
    assert guard.judge({"loss": 100.0, "grad_norm": 1.0}).verdict is Verdict.ACCEPT  # no history yet
    for _ in range(5):
        assert guard.judge({"loss": float("nan"), "grad_norm": 1.0}).verdict is Verdict.SKIP
    assert SpikeGuard(GuardConfig(enabled=False)).judge({"loss": float("nan")}).verdict is Verdict.ACCEPT


def test_guard_ignores_ratio_when_median_is_not_positive_and_round_trips():
    guard = SpikeGuard(GuardConfig(min_history=2, window=4))
    for loss in (-0.2, -0.1, 0.0):
        guard.judge({"loss": loss})
    assert guard.judge({"loss": 5.0}).verdict is Verdict.ACCEPT
    copy = SpikeGuard(GuardConfig(min_history=2, window=4))
    copy.load_state_dict(guard.state_dict())
    assert list(copy.history) == [-0.2, -0.1, 0.0, 5.0]
    assert copy.streak == guard.streak


# --------------------------------------------------------------------------------- schedule


def test_lr_schedule_warmup_and_decay():
    cosine = ScheduleConfig(warmup_steps=4, decay="cosine", min_lr_ratio=0.1)
    lrs = [lr_at(s, peak_lr=1.0, schedule=cosine, total_steps=14) for s in range(1, 15)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[8] == pytest.approx(0.55)  # halfway through the decay
    assert lrs[-1] == pytest.approx(0.1)
    linear = ScheduleConfig(warmup_steps=0, decay="linear")
    assert lr_at(10, peak_lr=2.0, schedule=linear, total_steps=10) == 0.0
    assert lr_at(7, peak_lr=2.0, schedule=ScheduleConfig(), total_steps=10) == 2.0
    with pytest.raises(ValueError):
        lr_at(0, peak_lr=1.0, schedule=linear, total_steps=10)


# ------------------------------------------------------------------------------ checkpoints


def test_only_complete_checkpoints_are_found(tmp_path):
    for name in ("step-00000003", "step-00000010", ".tmp-step-00000020", "step-00000030", "notes"):
        (tmp_path / name).mkdir()
    for name in ("step-00000003", "step-00000010", ".tmp-step-00000020"):
        (tmp_path / name / ".metadata").write_bytes(b"x")
    # step 30 has no .metadata (not written by this trainer's commit); the .tmp one is a crashed save
    assert [step for step, _ in list_checkpoints(tmp_path)] == [3, 10]
    assert list_checkpoints(tmp_path / "missing") == []


def test_exit_worker_flushes_output_and_logs_then_exits_with_the_code():
    """A finished worker skips finalization (the gloo group FSDP keeps alive could abort it
    there) but loses no output: buffered stdout and the log handlers are flushed first."""
    script = (
        "import logging, sys; logging.basicConfig(stream=sys.stderr); print('result line', end=''); "
        "logging.getLogger('w').warning('last log line'); "
        "import atexit; atexit.register(print, 'finalized'); "
        "from weightsync.trainer.parallel import exit_worker; exit_worker(3)"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert proc.stdout == "result line"  # flushed, and no finalization (atexit did not run)
    assert "last log line" in proc.stderr


@pytest.mark.parametrize("value", ["0.0.0.0:9401", "", "host name"])
def test_the_publishers_metrics_host_is_checked_like_the_agents(value):
    with pytest.raises(ValueError, match="metrics_host must be an address or host name without a port"):
        PublishConfig(store="file://weights", metrics_port=9401, metrics_host=value)


def test_the_publishers_metrics_bind_on_metrics_host_and_a_taken_port_names_the_setting(tmp_path):
    """The trainer's metrics were bound on 127.0.0.1 only, out of a Prometheus scrape's reach."""
    import socket

    import torch.distributed as dist

    from weightsync.errors import ListenError
    from weightsync.trainer.publish import WeightPublisher

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        config = PublishConfig(store=str(tmp_path / "store"), metrics_port=0, metrics_host="0.0.0.0")
        publisher = WeightPublisher(config, rank=0, world_size=1)
        try:
            assert publisher.metrics._server.server_address[0] == "0.0.0.0"
            taken = publisher.metrics._server.server_port
            again = dataclasses.replace(config, metrics_port=taken)
            with pytest.raises(ListenError, match=r"train\.publish\.metrics_port.*the port is taken"):
                WeightPublisher(again, rank=0, world_size=1)
        finally:
            publisher.close()
    finally:
        dist.destroy_process_group()
