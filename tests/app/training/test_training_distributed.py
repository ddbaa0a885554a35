"""The training API on 2 ranks (torchrun, gloo) matches 1 rank, and matches the project's own
TOML trainer (`weightsync.trainer.train.Trainer`) on the same batch: forward_backward with
cross_entropy, then an AdamW optim_step, compared through per-token logprobs (1e-5).
"""

from __future__ import annotations

import socket

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types

from harness.tiny_model import write_tiny_model
from harness.training_server import API_KEY, TrainingServer
from weightsync.models import CausalLM, token_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(900)]

SEQS = [[3, 17, 42, 99, 7, 8, 250], [5, 6, 7, 8, 9], [100, 200, 300, 400, 12, 13, 14, 15, 16]]
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}


def batch(scale: float = 1.0):
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [scale] * (len(s) - 1)},
        )
        for s in SEQS
    ]


def run_api(state_dir, model_dir, ranks, *, steps, weight_scale=1.0, extra_args=()):
    with (
        TrainingServer(state_dir, ranks=ranks, extra_args=tuple(extra_args)) as server,
        tinker.ServiceClient(base_url=server.url, api_key=API_KEY) as service,
    ):
        client = service.create_lora_training_client(base_model=model_dir, rank=0).result()
        losses = []
        for _ in range(steps):
            out = client.forward_backward(batch(weight_scale), "cross_entropy")
            client.optim_step(types.AdamParams(**ADAM)).result()
            losses.append(out.result().metrics["loss:sum"])
        forward = client.forward(batch(0.0), "cross_entropy").result()
        return losses, [torch.tensor(o["logprobs"].data) for o in forward.loss_fn_outputs]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        yield str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def test_two_ranks_match_one_rank(tmp_path, model_dir):
    one_losses, one_logprobs = run_api(tmp_path / "one", model_dir, 1, steps=2)
    two_losses, two_logprobs = run_api(tmp_path / "two", model_dir, 2, steps=2)
    assert two_losses == pytest.approx(one_losses, rel=1e-5)
    for a, b in zip(one_logprobs, two_logprobs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_cpu_offload_and_activation_checkpointing_stay_available_and_change_no_result(tmp_path, model_dir):
    plain_losses, plain_logprobs = run_api(tmp_path / "plain", model_dir, 2, steps=2)
    losses, logprobs = run_api(
        tmp_path / "offload", model_dir, 2, steps=2, extra_args=("--cpu-offload", "--activation-checkpointing")
    )
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for a, b in zip(plain_logprobs, logprobs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def run_published(state_dir, model_dir, ranks, *, lora_rank, extra_args=()):
    """`run_api`'s two steps on a LoRA (rank > 0) or fully fine-tuned model, then
    save_weights_for_sampler: losses, log-probs and the version it published, read back."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from weightsync.reader import Reader
    from weightsync.stores import open_store

    with (
        TrainingServer(state_dir, ranks=ranks, extra_args=tuple(extra_args)) as server,
        tinker.ServiceClient(base_url=server.url, api_key=API_KEY) as service,
    ):
        client = service.create_lora_training_client(base_model=model_dir, rank=lora_rank, seed=5).result()
        losses = []
        for _ in range(2):
            out = client.forward_backward(batch(), "cross_entropy")
            client.optim_step(types.AdamParams(**ADAM)).result()
            losses.append(out.result().metrics["loss:sum"])
        client.save_weights_for_sampler("parallel").result()
        forward = client.forward(batch(0.0), "cross_entropy").result()
        store = open_store(f"file://{server.state_dir.resolve() / 'store'}")
        published = Reader(store, model="tinker-" + client.model_id.replace(":", "-")).read(1)
        client.save_state("after").result()
        checkpoint = server.state_dir / "runs" / client.model_id / "weights" / "after"
        dcp_to_torch_save(checkpoint, state_dir / "after.pt")
    logprobs = [torch.tensor(o["logprobs"].data) for o in forward.loss_fn_outputs]
    return losses, logprobs, published, torch.load(state_dir / "after.pt", weights_only=True)["model"]


def _moe_dir(directory) -> str:
    from weightsync.models import ModelConfig, build_model, save_pretrained

    config = ModelConfig(
        model_type="qwen3_moe", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, max_position_embeddings=1024,
    )  # fmt: skip
    save_pretrained(directory, config, build_model(config, seed=0).state_dict())
    return str(directory)


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_tensor_and_expert_parallel_servers_match_one_rank_and_publish(tmp_path, model_dir, layout):
    """`serve-training --tp 2` (a LoRA run: merged weights) and `--ep 2` (a MoE, fully fine-tuned)
    on 2 ranks: the same losses and log-probs as 1 rank (seeded adapters: the SDK draws a seed
    otherwise), and save_weights_for_sampler publishes
    every rank's pieces, read back as the same weights."""
    base = model_dir if layout == "tp" else _moe_dir(tmp_path / "moe")
    lora_rank = 4 if layout == "tp" else 0
    one = run_published(tmp_path / "one", base, 1, lora_rank=lora_rank)
    two = run_published(tmp_path / "two", base, 2, lora_rank=lora_rank, extra_args=(f"--{layout}", "2"))
    assert two[0] == pytest.approx(one[0], rel=1e-5)
    for a, b in zip(one[1], two[1], strict=True):  # after two steps at lr 1e-2: float rounding apart
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    published, trained = two[2], two[3]
    assert published.manifest.format == (3 if layout == "tp" else 1), "tp pieces are boxes; ep pieces flat"
    assert set(published.state_dict()) == set(one[2].state_dict())
    scale = 32.0 / lora_rank if lora_rank else 0.0  # lora.LORA_ALPHA / rank
    for name, got in published.state_dict().items():  # the 2-rank run's own weights, merged, in bf16
        prefix = name.removesuffix(".weight")
        want = trained[name]
        if f"{prefix}.lora_A.weight" in trained:
            want = want + scale * (trained[f"{prefix}.lora_B.weight"] @ trained[f"{prefix}.lora_A.weight"])
        assert torch.equal(got, want.to(torch.bfloat16)), name


def test_the_api_matches_the_toml_trainer_on_the_same_batch(tmp_path, model_dir):
    """The TOML trainer minimises the token mean; the API the weighted sum. Weights of
    1/(number of loss tokens) make them the same objective, so one step lands on the same weights."""
    from weightsync.trainer.config import parse_job_config
    from weightsync.trainer.data import Example, collate
    from weightsync.trainer.train import Trainer

    tokens = sum(len(s) - 1 for s in SEQS)
    api_losses, api_logprobs = run_api(tmp_path / "api", model_dir, 1, steps=1, weight_scale=1.0 / tokens)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = parse_job_config(
        {
            "parallel": {"device": "cpu"},
            "train": {
                "steps": 1,
                "model": {"init_dir": model_dir},
                "optimizer": {
                    "lr": ADAM["learning_rate"],
                    "betas": [ADAM["beta1"], ADAM["beta2"]],
                    "eps": ADAM["eps"],
                    "weight_decay": 0.0,
                    "max_grad_norm": 0.0,
                },
                "schedule": {"warmup_steps": 0, "decay": "constant"},
                "data": {"global_batch_size": 3, "micro_batch_size": 3, "max_seq_len": 64},
            },
        }
    )
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        trainer = Trainer(job)
        try:
            examples = [Example(tokens=s, loss_weights=[0.0] + [1.0] * (len(s) - 1)) for s in SEQS]
            metrics = trainer.forward_backward([collate(examples, max_seq_len=64)])
            trainer.clip_gradients()
            trainer.apply_verdict(metrics)
            weights = trainer.full_state_dict()
        finally:
            trainer.close()
    assert api_losses[0] == pytest.approx(metrics["loss"], rel=1e-5)
    model = CausalLM(trainer.model.config)
    model.load_state_dict(weights)
    with torch.no_grad():
        for s, got in zip(SEQS, api_logprobs, strict=True):
            want = token_logprobs(model(torch.tensor([s[:-1]])), torch.tensor([s[1:]]))[0]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_sigterm_to_serve_training_stops_every_rank(tmp_path):
    """`weightsync serve-training --nproc 2` ran torchrun as a plain child: a SIGTERM ended the
    command and left torchrun and both ranks serving, forever. Now the signal reaches every rank
    and none outlives the command."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from harness.reaper import alive, descendants

    model_dir = write_tiny_model(tmp_path / "model")
    command = [sys.executable, "-m", "weightsync.app.cli", "serve-training", "--nproc", "2", "--port", "0",
               "--api-key", API_KEY, "--state-dir", str(tmp_path / "state"), "--model", str(model_dir)]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert json.loads(proc.stdout.readline())["event"] == "ready"
        job = descendants(proc.pid)
        assert sum("weightsync.app.training.serve" in cmd for cmd in job.values()) >= 3  # torchrun and 2 ranks
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=300)
        deadline = time.monotonic() + 300
        while any(alive(pid) for pid in job):
            assert time.monotonic() < deadline, f"still running after the command ended: {job}"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
