"""An agent serves the newest version it can verify (a real store, a real gRPC agent).

One object of the newest version rots in the store: a new agent must not wait for it forever
with nothing served. It serves the version before (its base and deltas, bit-exact), reports the
broken one in `status()` and the metrics, keeps retrying it, and moves on to the next good
version as soon as one is published.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.request

import torch

from weightsync.agents.config import AgentConfig
from weightsync.agents.server import AgentServer
from weightsync.models import ModelConfig, build_model
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.stores import LocalStore
from weightsync.transport.rpc import AgentClient
from weightsync.versions import read_manifest

MODEL = "availability-lm"
ARCH = ModelConfig(
    vocab_size=259,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
PUBLISH = PublisherConfig(chunk_bytes=16 * 1024, rebase_every=10, workers=2)
WAIT_S = 120


def _step(model: torch.nn.Module, generator: torch.Generator) -> None:
    """A sparse update, as between two RL steps: consecutive versions are small deltas."""
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=generator) < 0.05
            p.add_(mask * torch.randn(p.shape, generator=generator) * 1e-2 * p.abs().mean())


def _bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().to(torch.bfloat16).clone() for name, t in model.state_dict().items()}


def _assert_serves(server: AgentServer, version: int, want: dict[str, torch.Tensor]) -> None:
    assert server.agent.wait_for_version(version, WAIT_S), f"never served v{version}: {server.agent.status()}"
    served = server.engine.served()
    assert served.version == version
    assert sorted(served.weights) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(served.weights[name], tensor), f"v{version} {name}"


def _wait_until(agent, predicate, what: str) -> dict:
    """status() once `predicate(status)` holds; a generous deadline, no timing assumed."""
    deadline = time.monotonic() + WAIT_S
    while not predicate(status := agent.status()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {status}"
        time.sleep(0.05)
    return status


def test_a_corrupt_object_in_the_newest_version_does_not_stop_serving(tmp_path):
    store = LocalStore(tmp_path / "store")
    model = build_model(ARCH, seed=0)
    generator = torch.Generator().manual_seed(1)
    published: dict[int, dict[str, torch.Tensor]] = {}
    with Publisher(store, model=MODEL, config=PUBLISH) as publisher:
        for step in range(3):  # v1 full, v2 and v3 deltas on it
            result = publisher.publish(model.state_dict(), step=step).result()
            published[result.version] = _bf16(model)
            _step(model, generator)
    manifests = {v: read_manifest(store, MODEL, v) for v in (1, 2, 3)}
    assert [m.kind for m in manifests.values()] == ["full", "delta", "delta"]

    # Rot one object that only v3 names (content-addressed: v1's and v2's objects stay good).
    older = {c.key for v in (1, 2) for t in manifests[v].tensors for c in t.chunks if c.key}
    victim = next(c.key for t in manifests[3].tensors for c in t.chunks if c.key and c.key not in older)
    path = store.root / f"models/{MODEL}/{victim}"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    config = AgentConfig(
        model=MODEL,
        cache_dir=str(tmp_path / "agent"),
        name="agent",
        region="r",
        store=store.uri,
        engine={"type": "reference", "model": dataclasses.asdict(ARCH), "port": 0},
        poll_interval_s=0.5,
        push_wait_s=1.0,
        workers=2,
        metrics_port=0,
    )
    server = AgentServer(config).start()
    try:
        _assert_serves(server, 2, published[2])  # v1 + the v2 delta, verified; never a byte of v3
        status = server.agent.status()
        assert status["current_version"] == 2
        broken = {b["version"]: b for b in status["broken"]}
        assert list(broken) == [3], status["broken"]
        assert broken[3]["digest"] == manifests[3].digest and broken[3]["failures"] >= 1
        assert "IntegrityError" in broken[3]["error"]
        json.dumps(status)  # plain values, as the JSON status and the gRPC reply carry them
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).read().decode()
        assert _sample(metrics, "weightsync_agent_broken_versions") == 1.0, metrics
        assert _sample(metrics, "weightsync_agent_newest_broken_version") == 3.0

        # It keeps retrying v3 (with backoff) while it serves v2; the gRPC status reports it too.
        client = AgentClient(server.address)
        try:
            reply = client.status()
        finally:
            client.close()
        assert [b.version for b in reply.broken] == [3] and reply.current_version == 2
        _wait_until(server.agent, lambda s: s["broken"] and s["broken"][0]["failures"] >= 2, "a retry of v3")
        assert server.engine.served().version == 2

        # v4, a full version (a fresh publisher does not diff against the store): reachable without v3.
        _step(model, generator)
        rebase = dataclasses.replace(PUBLISH, parent_from_store=False)
        with Publisher(store, model=MODEL, config=rebase) as publisher:
            result = publisher.publish(model.state_dict(), step=3).result()
        assert result.version == 4 and result.manifest.kind == "full"
        _assert_serves(server, 4, _bf16(model))
        assert server.agent.status()["broken"] == []
        ledger = {e["version"]: e for e in server.agent.status()["ledger"]}
        assert ledger[3]["outcome"] == "failed" and ledger[2]["outcome"] == "served"
    finally:
        server.stop(0)


def _sample(exposition: str, name: str) -> float:
    """The value of the one sample of gauge `name` (any labels) in a Prometheus exposition."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in exposition.splitlines()
        if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {"
    ]
    assert len(values) == 1, (name, values)
    return values[0]
