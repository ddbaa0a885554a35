"""LoRA end to end through the unmodified `tinker` SDK: only the adapters train, the merged
weights an agent serves are bit-exact to W + scale * B A computed here from the DCP state, and
an adapter-only version is at least 50x smaller than the merged-weights delta of the same step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types

from harness.tiny_model import write_tiny_model
from harness.training_server import API_KEY, TrainingServer
from weightsync.models import ModelConfig, build_model, load_pretrained, save_pretrained
from weightsync.reader import Reader
from weightsync.stores import open_store
from weightsync.trainer.lora import LORA_ALPHA
from weightsync.versions import read_manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKENS = [3, 17, 42, 99, 7, 8, 250, 11, 12, 13]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # hidden 256: big enough that rank-1 adapters are a small fraction of the weights they adapt
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=256))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        with TrainingServer(tmp_path_factory.mktemp("server") / "state") as srv:
            yield srv


@pytest.fixture(scope="module")
def service(server):
    client = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=60)  # else its heartbeat outlives the server, warning


def step(client, lr=1e-3):
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )
    out = client.forward_backward([datum], "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=lr)).result()
    return out.result().metrics["loss:sum"]


def dcp_state(server, client, name, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    client.save_state(name).result()
    dcp_to_torch_save(Path(server.state_dir) / "runs" / client.model_id / "weights" / name, tmp_path / f"{name}.pt")
    return torch.load(tmp_path / f"{name}.pt", weights_only=True)["model"]


def stored_bytes(manifest):
    return sum(chunk.size for tensor in manifest.tensors for chunk in tensor.chunks)


def test_lora_trains_only_the_adapters_and_merged_weights_are_bit_exact(server, service, model_dir, tmp_path):
    client = service.create_lora_training_client(base_model=model_dir, rank=2, train_unembed=True).result()
    info = client.get_info()
    assert info.is_lora and info.lora_rank == 2
    losses = [step(client, lr=1e-3) for _ in range(4)]
    assert losses[-1] < losses[0]
    client.save_weights_for_sampler("merged").result()
    state = dcp_state(server, client, "after", tmp_path)

    _, base = load_pretrained(model_dir, dtype=torch.float32)
    adapted = sorted(k[: -len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight"))
    assert len(adapted) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head
    for name, tensor in base.items():  # the base weights never move
        assert torch.equal(state[name], tensor), name

    store = open_store(f"file://{Path(server.state_dir).resolve() / 'store'}")
    store_model = "tinker-" + client.model_id.replace(":", "-")
    served = Reader(store, model=store_model).read(1).state_dict()
    assert set(served) == set(base)
    scale = LORA_ALPHA / 2
    for name, tensor in base.items():
        prefix = name[: -len(".weight")]
        if prefix in adapted:
            want = tensor + scale * (state[f"{prefix}.lora_B.weight"] @ state[f"{prefix}.lora_A.weight"])
        else:
            want = tensor
        assert torch.equal(served[name], want.to(torch.bfloat16)), name
    # And sampling runs on those merged weights (the agent serves them).
    sampler = service.create_sampling_client(model_path=f"tinker://{client.model_id}/sampler_weights/merged").result()
    assert (
        len(
            sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), 1, types.SamplingParams(max_tokens=2))
            .result()
            .sequences[0]
            .tokens
        )
        >= 1
    )


def test_adapter_only_versions_are_at_least_50x_smaller_than_merged_deltas(server, service, model_dir):
    client = service.create_lora_training_client(base_model=model_dir, rank=1, train_unembed=False).result()
    step(client)
    client.save_weights_for_sampler("v1").result()
    step(client)
    client.save_weights_for_sampler("v2").result()
    store = open_store(f"file://{Path(server.state_dir).resolve() / 'store'}")
    store_model = "tinker-" + client.model_id.replace(":", "-")
    merged = read_manifest(store, store_model, 2)
    adapter = read_manifest(store, store_model + "-adapter", 2)
    assert merged.kind == "delta"
    assert {t.name for t in adapter.tensors} == {
        n for n in _names(adapter) if n.endswith((".lora_A.weight", ".lora_B.weight"))
    }
    ratio = stored_bytes(merged) / max(1, stored_bytes(adapter))
    assert ratio >= 50, (stored_bytes(merged), stored_bytes(adapter))
    # The manifests say which kind each version is.
    assert adapter.producer["weights_kind"] == "adapter"
    assert merged.producer.get("weights_kind", "model") == "model"


def test_an_agent_refuses_versions_of_the_wrong_kind(server, service, model_dir, tmp_path):
    """An agent whose engine serves whole weights, pointed at the adapter-only store model,
    refuses every version with a clear error and serves nothing from it."""
    import time

    from weightsync.agents.config import AgentConfig
    from weightsync.agents.engines.reference import ReferenceEngine, ReferenceEngineConfig
    from weightsync.agents.server import AgentServer
    from weightsync.models import load_config

    client = service.create_lora_training_client(base_model=model_dir, rank=1).result()
    step(client)
    client.save_weights_for_sampler("kind").result()
    store_uri = f"file://{Path(server.state_dir).resolve() / 'store'}"
    adapter_model = "tinker-" + client.model_id.replace(":", "-") + "-adapter"
    engine = ReferenceEngine(ReferenceEngineConfig(model=load_config(model_dir), compute_dtype="float32"))
    agent = AgentServer(
        AgentConfig(
            model=adapter_model, cache_dir=str(tmp_path / "cache"), store=store_uri, poll_interval_s=0.2, workers=1
        ),
        engine=engine,
    ).start()
    try:
        deadline = time.monotonic() + 120
        while "holds 'adapter' weights" not in (agent.agent.status()["last_error"] or ""):
            assert time.monotonic() < deadline, agent.agent.status()
            time.sleep(0.1)
        assert "serves 'model' weights" in agent.agent.status()["last_error"]
        assert engine.served_version() is None
    finally:
        agent.stop()
        engine.close()


def _names(manifest):
    return [t.name for t in manifest.tensors]


def test_lora_state_resumes_bit_identically(service, model_dir):
    client = service.create_lora_training_client(base_model=model_dir, rank=2, seed=7).result()
    step(client)
    path = client.save_state("lora-1").result().path
    want = [step(client) for _ in range(2)]
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().lora_rank == 2
    assert [step(resumed) for _ in range(2)] == want


def test_bad_lora_configs_are_refused(service, model_dir, tmp_path):
    with pytest.raises(Exception, match="rank must be an integer >= 0"):
        service.create_lora_training_client(base_model=model_dir, rank=-1).result()
    # A model whose output projection is its embedding has no lm_head to adapt: refused on arrival.
    tied = ModelConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, tie_word_embeddings=True
    )
    save_pretrained(tmp_path / "tied", tied, build_model(tied).state_dict())
    with pytest.raises(Exception, match="ties its embeddings; set train_unembed=False"):
        service.create_lora_training_client(base_model=str(tmp_path / "tied"), rank=1, train_unembed=True).result()
    client = service.create_lora_training_client(base_model=str(tmp_path / "tied"), rank=1, train_unembed=False)
    assert client.result().get_info().lora_rank == 1


def test_a_lora_client_without_a_seed_gets_random_adapters_and_a_seed_repeats_them(service, model_dir):
    """The SDK documents seed=None as a random initialisation; the server used to fix it at 0, so
    every unseeded run started from the same adapters. B starts at zero, so the adapters' A shows
    after the first step: same seed, same loss; no seed, different losses."""

    def second_loss(seed):
        client = service.create_lora_training_client(base_model=model_dir, rank=4, seed=seed).result()
        step(client, lr=1e-2)
        return step(client)

    assert second_loss(11) == second_loss(11)
    unseeded = [second_loss(None) for _ in range(2)]
    assert unseeded[0] != unseeded[1]
