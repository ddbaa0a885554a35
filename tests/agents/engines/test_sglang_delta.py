"""In-place delta swaps into SGLang through weightsync's custom weight loader, against
harness/sglang_contract_server.py (a contract server of SGLang's routes, not SGLang: it cannot be
installed on a CPU machine). The server imports and calls the loader named in the request's
load_format, as SGLang does for a loader listed in --custom-weight-loader, on a model whose
parameters are what it serves.

An agent with the sglang engine serves a full version then 10 deltas in place (the ledger says
which path each took), bit for bit; a corrupted element makes the next swap go in whole; a
refused parity probe is undone from the loader's undo log; a server without the loader is never
sent a delta.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from harness.sglang_contract_server import SGLangContractServer
from weightsync import Publisher, Reader
from weightsync.agents.config import AgentConfig
from weightsync.agents.engines.sglang import SGLangEngine, SGLangEngineConfig
from weightsync.agents.engines.sglang_loader import LOADER
from weightsync.agents.server import AgentServer
from weightsync.delta_capture import DeltaCapture
from weightsync.models import ModelConfig, build_model, save_pretrained
from weightsync.stores import LocalStore

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
MODEL = "sglang-delta"
WAIT_S = 120


def versions(count: int) -> dict[int, dict[str, torch.Tensor]]:
    base = {n: t.to(torch.bfloat16) for n, t in build_model(ModelConfig(**SMALL), seed=0).state_dict().items()}
    out, g = {1: base}, torch.Generator().manual_seed(1)
    for v in range(2, count + 1):
        out[v] = {
            n: torch.where(torch.rand(t.shape, generator=g) < 0.03, (t.float() * 1.03).to(t.dtype), t)
            for n, t in out[v - 1].items()
        }
    return out


def start(tmp_path, loader: bool = True) -> tuple[SGLangContractServer, SGLangEngine]:
    save_pretrained(tmp_path / "template", ModelConfig(**SMALL), versions(1)[1])
    server = SGLangContractServer(tmp_path / "template", custom_weight_loader=(LOADER,) if loader else ())
    engine = SGLangEngine(
        SGLangEngineConfig(
            url=server.url,
            root=str(tmp_path / "snapshots"),
            template_dir=str(tmp_path / "template"),
            custom_weight_loader=loader,
        )
    )
    return server, engine


def assert_served(server: SGLangContractServer, weights: dict[str, torch.Tensor]) -> None:
    for name, tensor in weights.items():
        assert torch.equal(server.weights[name], tensor), name


def test_an_agent_patches_ten_delta_versions_in_place_bit_exactly(tmp_path):
    server, engine = start(tmp_path)
    store = LocalStore(tmp_path / "store")
    config = AgentConfig(
        model=MODEL,
        cache_dir=str(tmp_path / "cache"),
        name="sglang-delta-agent",
        store=store.uri,
        engine={"type": "sglang", "url": server.url, "root": str(tmp_path / "snapshots")},
        poll_interval_s=0.1,
    )
    agent = AgentServer(config, engine=engine).start()
    try:
        wanted = versions(11)
        loads_before = server.loads
        with Publisher(store, model=MODEL) as publisher:
            for version, weights in wanted.items():
                publisher.publish(weights, step=version).result()
                assert agent.agent.wait_for_version(version, WAIT_S)
                entry = next(e for e in agent.agent.status()["ledger"] if e["version"] == version)
                assert entry["swap_path"] == ("full" if version == 1 else "delta"), entry
                assert_served(server, weights)
                assert server.weight_version == str(version)
        assert server.loads == loads_before + 1, "only the first version was loaded from disk"
        calls = [c for c in server.calls if c[1] == "/update_weights_from_tensor"]
        assert all(body["load_format"] == LOADER and body["flush_cache"] for _, _, body in calls)
    finally:
        agent.stop(0)
        server.close()


def capture(store, version: int, state):
    delta = DeltaCapture(state.manifest)
    Reader(store, model=MODEL).advance_route(state, version, capture=delta)
    return delta.result(state.manifest)


def test_a_corrupted_element_sends_the_next_version_whole_and_undo_restores(tmp_path):
    server, engine = start(tmp_path)
    store = LocalStore(tmp_path / "store")
    wanted = versions(4)
    with Publisher(store, model=MODEL) as publisher:
        for version, weights in wanted.items():
            publisher.publish(weights, step=version).result()
    try:
        state = Reader(store, model=MODEL).read(1)
        engine.swap(1, state.state_dict(), digest=state.manifest.digest)
        delta = capture(store, 2, state)
        name = "model.layers.0.self_attn.q_proj.weight"
        position = int(delta.tensors[name].positions[0])
        server.weights[name].view(-1).view(torch.int16)[position] = 0x3F80  # a worker's memory goes bad
        report = engine.swap_delta(2, delta, weights=state.state_dict(), digest=state.manifest.digest)
        assert report.path == "full" and "old-bit sum" in report.path_reason and "diverged" in report.path_reason
        assert_served(server, wanted[2])

        delta = capture(store, 3, state)
        report = engine.swap_delta(3, delta, weights=state.state_dict(), digest=state.manifest.digest)
        assert report.path == "delta" and report.delta_bytes > 0
        assert_served(server, wanted[3])
        loads = server.loads
        undone = engine.undo(3)  # what a parity refuse asks
        assert undone is not None and undone.version == 2 and engine.served_version() == 2
        assert_served(server, wanted[2])
        assert server.loads == loads and server.weight_version == "2", "undone in place, relabelled"
    finally:
        engine.close()
        server.close()


def test_a_server_without_the_loader_gets_whole_versions(tmp_path):
    server, engine = start(tmp_path, loader=False)
    store = LocalStore(tmp_path / "store")
    wanted = versions(2)
    with Publisher(store, model=MODEL) as publisher:
        for version, weights in wanted.items():
            publisher.publish(weights, step=version).result()
    try:
        state = Reader(store, model=MODEL).read(1)
        engine.swap(1, state.state_dict(), digest=state.manifest.digest)
        delta = capture(store, 2, state)
        report = engine.swap_delta(2, delta, weights=state.state_dict(), digest=state.manifest.digest)
        assert report.path == "full" and "custom_weight_loader = false" in report.path_reason
        assert_served(server, wanted[2])
        assert not [c for c in server.calls if c[1] == "/update_weights_from_tensor"]
    finally:
        engine.close()
        server.close()


def test_the_contract_server_refuses_a_loader_it_was_not_started_with(tmp_path):
    server, engine = start(tmp_path, loader=False)
    try:
        reply = engine._call(
            "POST",
            "/update_weights_from_tensor",
            {"serialized_named_tensors": ["AAAA"], "load_format": LOADER},
            10,
        )
        assert reply.status == 400 and "Unknown load_format" in reply.text
    finally:
        engine.close()
        server.close()


def test_a_parity_refuse_is_undone_in_place_and_the_agents_copy_reverted(tmp_path, caplog):
    """v2 carries a forged probe (v1's figures while v2 moves the output layer): the agent refuses
    it and rolls back through the loader's undo log (no load from disk) and its captured old bits."""
    from harness.fake_trainer import trainer_probe
    from weightsync.agents.parity import ParityConfig
    from weightsync.models.probe import draw_prompts

    server, engine = start(tmp_path)
    v1 = versions(1)[1]
    v2 = dict(v1)
    head = v1["lm_head.weight"]
    mask = torch.rand(head.shape, generator=torch.Generator().manual_seed(3)) < 0.1
    v2["lm_head.weight"] = torch.where(mask, (head.float() + 1.0).to(head.dtype), head)
    architecture = ModelConfig(**SMALL)
    prompts = list(itertools.islice(draw_prompts(architecture.vocab_size, length=12), 2))

    def probe_of(weights):
        return trainer_probe(weights, architecture, prompts, top_k=0)

    store = LocalStore(tmp_path / "store")
    config = AgentConfig(
        model=MODEL,
        cache_dir=str(tmp_path / "cache"),
        name="sglang-parity-agent",
        store=store.uri,
        engine={"type": "sglang", "url": server.url, "root": str(tmp_path / "snapshots")},
        poll_interval_s=0.1,
        parity=ParityConfig(action="refuse"),  # the defaults
    )
    caplog.set_level(logging.INFO, logger="weightsync.agents.delta_swap")
    agent = AgentServer(config, engine=engine).start()
    try:
        with Publisher(store, model=MODEL) as publisher:
            publisher.publish(v1, step=1, probe=probe_of(v1)).result()
            assert agent.agent.wait_for_version(1, WAIT_S)
            loads = server.loads
            publisher.publish(v2, step=2, probe=probe_of(v1)).result()
            deadline = time.monotonic() + WAIT_S
            while 2 not in agent.agent.status()["refused"]:
                assert time.monotonic() < deadline, agent.agent.status()
                time.sleep(0.05)
        assert server.loads == loads, "the rollback loaded nothing from disk"
        assert engine.served_version() == 1 and server.weight_version == "1"
        assert_served(server, v1)
        copy = agent.agent.buffers.served
        for name, tensor in copy.state_dict().items():  # the agent's copy is v1 again, bit for bit
            assert torch.equal(tensor, v1[name]), name
        assert any("the agent's copy is back on v1" in r.getMessage() for r in caplog.records), "reverted in place"
    finally:
        agent.stop(0)
        server.close()
