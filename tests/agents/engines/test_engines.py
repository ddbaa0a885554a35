"""The engine contract (agents/engines/base.py), one suite over every registered engine, plus what
only the safetensors directory engine does (reload failures and retries, snapshot layout,
retention, crash leftovers).

The suite is parametrized from the registry (weightsync.agents.engines.ENGINES): KITS says, one
entry per engine, how to run it under test and how to see what it really serves, and a registered
engine without a kit fails. The reload target of the directory engine is a fake SGLang server that
really loads the directory it is told about; the sglang engine runs against
harness/sglang_contract_server.py (its own tests: test_sglang.py); the vllm engine against the real
vLLM server (marked vllm and slow; its own tests: test_vllm.py), whose workers write back what they
hold. So each test compares what the inference side loaded with what was swapped in.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness import vllm as vh
from harness.bits import assert_bit_equal
from harness.sglang_contract_server import SGLangContractServer
from weightsync.agents.engines import ENGINES, engine_config_class, engine_types, open_engine
from weightsync.agents.engines.base import Engine, EngineState, check_engine, layout_of
from weightsync.agents.engines.swap_policy import SwapPolicy
from weightsync.errors import ConfigError, LayoutError, WeightsyncError
from weightsync.models import ModelConfig, build_model, load_pretrained, save_pretrained

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def make_weights(version: int) -> dict[str, torch.Tensor]:
    """bf16 weights that differ per version, as an agent hands them to swap."""
    model = build_model(ModelConfig(**SMALL), seed=version)
    return {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()}


class FakeReloadServer:
    """Stands in for SGLang/vLLM: POST /update_weights_from_disk loads the directory it names."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, dict[str, torch.Tensor]]] = []  # (path, weights) per successful load
        self.bodies: list[dict] = []
        self.fail: list[int] = []  # statuses to answer with, one per coming request
        self.fail_with_success_false = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                if fake.fail:
                    return self._answer(fake.fail.pop(0), {"success": False, "message": "injected failure"})
                if fake.fail_with_success_false:
                    return self._answer(200, {"success": False, "message": "cannot load"})
                _, weights = load_pretrained(body["model_path"])  # config.json + safetensors, checked
                fake.loaded.append((body["model_path"], weights))
                self._answer(200, {"success": True, "message": "ok", "num_paused_requests": 0})

            def _answer(self, status: int, doc: dict) -> None:
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/update_weights_from_disk"

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


# ------------------------------------------------------------------ kits: each engine under test


class Kit:
    """An engine under test: the weights it serves and how to see what it really serves."""

    kind = ""
    marks: tuple = ()  # pytest marks its contract tests carry

    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path, **options) -> None:
        self.engine: Engine = open_engine({"type": self.kind, **self.options(request, tmp_path), **options})

    def options(self, request: pytest.FixtureRequest, tmp_path: Path) -> dict:
        """The engine's [agent.engine] options for a test (and whatever it runs beside)."""
        return {}

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        """bf16 weights that differ per version, as an agent hands them to swap."""
        return make_weights(version)

    def served(self) -> tuple[int | None, dict[str, torch.Tensor] | None]:
        """(version, tensors) as the inference side has them."""
        raise NotImplementedError

    def observe(self) -> tuple[int | None, dict[str, torch.Tensor]] | None:
        """What a reader sees right now: (version, tensors), version None where the inference side
        does not say (the version is then the one whose tensors they are), or None for nothing."""
        return self.served()

    def close(self) -> None:
        self.engine.close()


class ReferenceKit(Kit):
    """The in-process reference server: what it serves is its served record."""

    kind = "reference"

    def options(self, request, tmp_path) -> dict:
        return {"model": SMALL}

    def served(self):
        served = self.engine.served()
        return served.version, dict(served.weights)


class SafetensorsDirKit(Kit):
    """The directory engine in front of FakeReloadServer, which loads what it is told to."""

    kind = "safetensors_dir"

    def options(self, request, tmp_path) -> dict:
        self.fake = FakeReloadServer()
        return {
            "root": str(tmp_path / "snapshots"),
            "reload_url": self.fake.url,
            "model": SMALL,
            "reload_backoff_s": 0.0,
        }

    def served(self):
        if not self.fake.loaded:
            return None, None
        path, weights = self.fake.loaded[-1]
        return int(Path(path).name[1:]), weights

    def observe(self):
        """The snapshot `current` names, read the way a restarted server would."""
        current = self.engine.current_dir()
        if current is None:
            return None
        try:
            return int(current.name[1:]), load_pretrained(current)[1]
        except (OSError, ValueError, RuntimeError):  # safetensors says "unable to open file" as a RuntimeError
            if current.exists():
                raise  # a snapshot that exists must always be complete
            return None  # pruned by a later swap while we read it

    def close(self) -> None:
        super().close()
        self.fake.close()


class SGLangKit(SafetensorsDirKit):
    """The sglang engine in front of the SGLang contract server, which loads what it is told to."""

    kind = "sglang"

    def options(self, request, tmp_path) -> dict:
        save_pretrained(tmp_path / "template", ModelConfig(**SMALL), make_weights(0))
        self.server = SGLangContractServer(tmp_path / "template")
        return {
            "url": self.server.url,
            "root": str(tmp_path / "snapshots"),
            "template_dir": str(tmp_path / "template"),
            "retry_backoff_s": 0.0,
        }

    def served(self):
        version = self.server.weight_version
        return (int(version), self.server.weights) if version.isdigit() else (None, None)

    def close(self) -> None:
        self.engine.close()
        self.server.close()


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """One real vLLM server (tiny Qwen3) for the module; its workers keep a copy of what they load
    through weightsync before the CPU kernels repack it, so that they can write back what they hold."""
    vh.require_vllm()
    model_dir = tmp_path_factory.mktemp("qwen3")
    vh.write_qwen3(model_dir, seed=0)
    with vh.VllmServer(model_dir, tmp_path_factory.mktemp("vllm-log") / "server.log") as server:
        server.wait_ready()
        server.base_weights = load_file(str(model_dir / "model.safetensors"))
        yield server


class VllmKit(Kit):
    """The vllm engine on the real vLLM server; what it serves is what the workers write back."""

    kind = "vllm"
    marks = (pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800))

    def options(self, request, tmp_path) -> dict:
        self.server = request.getfixturevalue("vllm_server")
        self.tmp_path = tmp_path
        return {"url": self.server.url}

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(version)
        return {
            name: (0.05 * torch.randn(t.shape, generator=generator)).to(t.dtype)
            for name, t in sorted(self.server.base_weights.items())
        }

    def served(self):
        version = vh.get_json(self.server.url + "/weight_info").get("weight_version")
        return (int(version) if version and version.isdigit() else None), self._held()

    def observe(self):
        return None, self._held()  # /weight_info and the tensors are two calls: tell by the tensors

    def _held(self) -> dict[str, torch.Tensor]:
        return vh.unfuse(vh.held_params(self.server.url, self.tmp_path))


KITS: dict[str, Callable[..., Kit]] = {
    "reference": ReferenceKit,
    "safetensors_dir": SafetensorsDirKit,
    "sglang": SGLangKit,
    "vllm": VllmKit,
}


@pytest.fixture(params=[pytest.param(kind, marks=getattr(KITS.get(kind), "marks", ())) for kind in engine_types()])
def kit(request, tmp_path):
    if request.param not in KITS:
        pytest.fail(f"engine {request.param!r} is registered but has no kit here: add one line to KITS")
    kit = KITS[request.param](request, tmp_path)
    yield kit
    kit.close()


def seen_version(kit: Kit, versions: dict[int, dict[str, torch.Tensor]]) -> int | None:
    """The version a reader sees now, after checking it sees exactly that version's tensors."""
    observed = kit.observe()
    if observed is None:
        return None
    version, weights = observed
    if version is None:
        same = [
            v
            for v, w in versions.items()
            if sorted(w) == sorted(weights) and all(torch.equal(weights[n], t) for n, t in w.items())
        ]
        assert same, "a reader saw tensors of no whole version"
        version = same[0]
    assert_bit_equal(weights, versions[version])
    return version


# ------------------------------------------------------------------ the registry


def test_every_registered_engine_has_a_kit_and_a_config_class():
    assert set(KITS) == set(engine_types()) == set(ENGINES)
    for kind in engine_types():
        cls = engine_config_class(kind)
        assert cls.__module__.startswith("weightsync.agents.engines.") and callable(cls.open)


def test_the_registry_imports_an_engine_only_when_its_type_is_used():
    """Listing the types (--help, config errors) imports no engine and no torch; resolving one
    imports its module alone."""
    script = """
import sys
from weightsync.agents.engines import ENGINES, engine_config_class, engine_types
assert engine_types() == tuple(ENGINES), engine_types()
assert "torch" not in sys.modules
engine_config_class("safetensors_dir")
loaded = sorted(m for m in sys.modules if m.startswith("weightsync.agents.engines."))
print(loaded)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = eval(done.stdout.strip())  # noqa: S307 - our own child's list of module names
    assert "weightsync.agents.engines.safetensors_dir" in loaded
    assert not {f"weightsync.agents.engines.{m}" for m in ("reference", "reference_server", "vllm", "sglang")} & set(
        loaded
    )


def test_the_docs_engine_table_lists_the_registry():
    """docs/agents.md's Engines table has one row per registered type, no more, no fewer."""
    text = (Path(__file__).parents[3] / "docs" / "agents.md").read_text()
    table = text.split("## Engines", 1)[1].split("\n\n", 2)[1]
    rows = [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:] if line.startswith("|")]
    assert sorted(rows) == sorted(engine_types()) and len(rows) == len(set(rows))


def test_open_engine_refuses_unknown_types_and_options(tmp_path):
    with pytest.raises(
        ConfigError, match=r"type 'vllm-magic' is not an engine type; .*known: \['reference', 'safetensors_dir'"
    ):
        open_engine({"type": "vllm-magic"})
    with pytest.raises(ConfigError, match=r"type 'refrence' is not an engine type; did you mean 'reference'\?"):
        open_engine({"type": "refrence"})
    with pytest.raises(ConfigError, match=r"\[agent.engine\] needs a type"):
        open_engine({"model": SMALL})
    with pytest.raises(ConfigError, match=r"unknown key \[agent.engine\] 'prot'; did you mean 'port'\?"):
        open_engine({"type": "reference", "model": SMALL, "prot": 80})
    with pytest.raises(ConfigError, match=r"unknown key \[agent.engine\] 'reload'; did you mean 'reload_url'\?"):
        open_engine({"type": "safetensors_dir", "root": str(tmp_path), "model": SMALL, "reload": "x"})
    with pytest.raises(ConfigError, match="template_dir"):
        open_engine({"type": "safetensors_dir", "root": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"\[agent.engine\] root is missing: the safetensors_dir engine needs it"):
        open_engine({"type": "safetensors_dir", "model": SMALL})
    with pytest.raises(ConfigError, match=r"\[agent.engine\] url is missing: the vllm engine needs it"):
        open_engine({"type": "vllm"})
    with pytest.raises(ConfigError, match=r"\[agent.engine\] port must be an integer, got '80'"):
        open_engine({"type": "reference", "model": SMALL, "port": "80"})


# ------------------------------------------------------------------ the contract, over every engine


def test_engine_keeps_every_member_of_the_protocol(kit):
    engine = kit.engine
    check_engine(engine)
    assert isinstance(engine, Engine)
    assert engine.name == kit.kind, "the name the registry knows it by"
    assert "model" in engine.weights_kinds
    assert engine.url is None or engine.url.startswith("http")


def test_an_engine_without_a_member_is_refused_naming_it():
    """Every member is required, the digest of what an engine holds too (not an optional attribute)."""

    class NoDigest:
        name, zero_copy, swap_policies, weights_kinds, url = "x", False, (SwapPolicy.DRAIN,), ("model",), None

        def swap(self, *args, **kwargs): ...

        def served_version(self): ...

        def wait_unused(self, version, timeout_s): ...

        def check_fit(self, layout): ...

        def state(self): ...

        def close(self): ...

    with pytest.raises(TypeError, match=r"NoDigest is not an Engine: verify_held\(\) is missing"):
        check_engine(NoDigest())


def test_engine_says_what_it_serves_and_digests_what_it_holds(kit):
    """`state()` before and after a swap; `verify_held` against the version swapped in (equal) and
    another one (not), or None from an engine that cannot report what it holds; `check_fit`
    refuses what `swap` would refuse for its layout, before anything is touched."""
    engine = kit.engine
    before = engine.state()
    assert before.state == "empty" and before.version is None and before.reason
    w1, w2 = kit.weights(1), kit.weights(2)
    engine.swap(1, w1, digest="digest-1")
    assert engine.state() == EngineState(state="serving", version=1)
    held = engine.verify_held(1, w1)
    if kit.kind in ("safetensors_dir", "sglang"):  # a server with no route that reports what it holds
        assert held is None
    else:
        assert held.ok and not held.error and held.hashed, held
        other = engine.verify_held(1, w2)  # the bytes differ from what it holds
        assert not other.ok and "digest" in other.error, other
        assert not engine.verify_held(2, w1).ok, "it serves v1, not v2"
    engine.check_fit(layout_of(w2))
    wider = layout_of(w2)
    wider["model.norm.weight"] = (wider["model.norm.weight"][0], (wider["model.norm.weight"][1][0] + 8,))
    with pytest.raises(LayoutError, match="model.norm.weight has shape"):
        engine.check_fit(wider)
    assert engine.served_version() == 1 and kit.served()[0] == 1


def test_swap_makes_the_version_served(kit):
    engine = kit.engine
    assert engine.served_version() is None
    w1 = kit.weights(1)
    report = engine.swap(1, w1, digest="digest-1")
    assert report.version == 1 and 0 <= report.pause_s <= report.total_s
    assert engine.served_version() == 1
    version, served = kit.served()
    assert version == 1
    assert_bit_equal(served, w1)
    w2 = kit.weights(2)
    engine.swap(2, w2, digest="digest-2")
    assert engine.served_version() == 2
    assert_bit_equal(kit.served()[1], w2)


def test_zero_copy_engines_serve_the_tensors_copying_engines_keep_none(kit):
    weights = kit.weights(1)
    originals = {name: t.clone() for name, t in weights.items()}
    kit.engine.swap(1, weights, digest="digest-1")
    if kit.engine.zero_copy:
        served = kit.served()[1]
        assert all(served[name] is weights[name] for name in weights)
    else:
        for t in weights.values():  # the agent reuses its buffers as soon as swap returns
            t.fill_(float("nan"))
        assert_bit_equal(kit.served()[1], originals)
        assert seen_version(kit, {1: originals}) == 1


@pytest.mark.parametrize("damage", ["missing", "unexpected", "shape", "not_a_tensor"])
def test_a_bad_swap_raises_and_the_previous_version_stays(kit, damage):
    w1 = kit.weights(1)
    kit.engine.swap(1, w1, digest="digest-1")
    bad = kit.weights(2)
    if damage == "missing":
        del bad["model.layers.1.mlp.up_proj.weight"]
    elif damage == "unexpected":
        bad["model.layers.2.mlp.up_proj.weight"] = bad["model.layers.1.mlp.up_proj.weight"]
    elif damage == "shape":
        bad["model.norm.weight"] = bad["model.norm.weight"][:-1]
    else:
        bad["model.norm.weight"] = [1.0] * len(bad["model.norm.weight"])
    with pytest.raises(LayoutError):
        kit.engine.swap(2, bad, digest="digest-2")
    assert kit.engine.served_version() == 1
    assert kit.served()[0] == 1
    assert_bit_equal(kit.served()[1], w1)
    assert seen_version(kit, {1: w1}) == 1
    if kit.kind == "safetensors_dir":
        assert kit.engine.snapshots() == [1]


def test_readers_only_ever_see_whole_versions(kit):
    versions = {v: kit.weights(v) for v in range(1, 7)}
    kit.engine.swap(1, versions[1], digest="digest-1")
    stop = threading.Event()
    seen, problems = [], []

    def observe() -> None:
        while not stop.is_set():
            try:
                version = seen_version(kit, versions)
                if version is not None:
                    seen.append(version)
            except Exception as e:  # reported below; a reader thread must not die silently
                problems.append(repr(e))

    reader = threading.Thread(target=observe)
    reader.start()
    try:
        for v in range(2, 7):
            kit.engine.swap(v, versions[v], digest=f"digest-{v}")
    finally:
        stop.set()
        reader.join()
    assert not problems
    assert seen and seen == sorted(seen)
    assert seen_version(kit, versions) == 6


def test_wait_unused(kit):
    engine = kit.engine
    engine.swap(1, kit.weights(1), digest="digest-1")
    engine.swap(2, kit.weights(2), digest="digest-2")
    if not engine.zero_copy:
        assert engine.wait_unused(1, 0) and engine.wait_unused(2, 0)
        return
    assert engine.wait_unused(1, 0), "no request runs on a replaced version"
    assert not engine.wait_unused(2, 0.05), "the served version is in use: new requests get it"
    with engine.lease() as held:  # a request in flight on version 2
        assert held.version == 2
        engine.swap(3, kit.weights(3), digest="digest-3")
        assert not engine.wait_unused(2, 0.05)
        result = []
        waiter = threading.Thread(target=lambda: result.append(engine.wait_unused(2, 60)))
        waiter.start()
    waiter.join()
    assert result == [True]
    assert engine.wait_unused(2, 0)


def test_close_is_idempotent(kit):
    kit.engine.swap(1, kit.weights(1), digest="digest-1")
    kit.engine.close()
    kit.engine.close()
    with pytest.raises(WeightsyncError, match="closed"):
        kit.engine.swap(2, kit.weights(2), digest="digest-2")


def test_every_engine_names_its_swap_policies_and_refuses_the_others(kit):
    engine = kit.engine
    assert SwapPolicy.DRAIN in engine.swap_policies
    assert all(isinstance(policy, SwapPolicy) for policy in engine.swap_policies)
    for policy in SwapPolicy:
        if policy not in engine.swap_policies:
            with pytest.raises(ValueError, match=f"does not implement swap policy {policy.value!r}"):
                engine.swap(1, kit.weights(1), digest="digest-1", policy=policy)
    for policy in ("later", "drain"):  # strings are parsed once, where a setting is read
        with pytest.raises(TypeError, match="swap policy must be a SwapPolicy"):
            engine.swap(1, kit.weights(1), digest="digest-1", policy=policy)
    assert engine.served_version() is None, "a refused policy touched nothing"


def test_swap_refuses_bad_versions_and_digests(kit):
    for version in (-1, True, 1.0, "1"):
        with pytest.raises(ValueError, match="version"):
            kit.engine.swap(version, kit.weights(1), digest="d")
    with pytest.raises(TypeError, match="digest"):
        kit.engine.swap(1, kit.weights(1), digest=None)
    assert kit.engine.served_version() is None


# ------------------------------------------------------------------ safetensors directory engine


@pytest.fixture
def dir_kit(request, tmp_path):
    kit = SafetensorsDirKit(request, tmp_path, reload_retries=1)
    yield kit
    kit.close()


@pytest.mark.parametrize("failure", ["refused", "server_errors", "success_false"])
def test_dir_failed_reload_keeps_the_previous_version(dir_kit, failure):
    engine, fake = dir_kit.engine, dir_kit.fake
    w1 = make_weights(1)
    engine.swap(1, w1, digest="digest-1")
    requests_before = len(fake.bodies)
    if failure == "refused":
        fake.fail = [400]  # a 4xx is final: no retry
    elif failure == "server_errors":
        fake.fail = [500, 503]  # one attempt + one retry, both fail
    else:
        fake.fail_with_success_false = True
    with pytest.raises(WeightsyncError, match="reload of version 2"):
        engine.swap(2, make_weights(2), digest="digest-2")
    assert len(fake.bodies) - requests_before == (2 if failure == "server_errors" else 1)
    assert engine.served_version() == 1
    assert engine.current_dir().name == "v000000000001"
    assert engine.snapshots() == [1]
    assert len(fake.loaded) == 1
    assert_bit_equal(dir_kit.served()[1], w1)


def test_dir_retries_a_server_error_then_succeeds(dir_kit):
    dir_kit.fake.fail = [502]
    w1 = make_weights(1)
    dir_kit.engine.swap(1, w1, digest="digest-1")
    assert len(dir_kit.fake.bodies) == 2
    assert_bit_equal(dir_kit.served()[1], w1)


def test_dir_unreachable_server_fails_after_retries(tmp_path):
    fake = FakeReloadServer()
    url = fake.url
    fake.close()  # nothing listens there any more
    engine = open_engine(
        {
            "type": "safetensors_dir",
            "root": str(tmp_path / "s"),
            "model": SMALL,
            "reload_url": url,
            "reload_retries": 1,
            "reload_backoff_s": 0.0,
            "reload_timeout_s": 5,
        }
    )
    try:
        with pytest.raises(WeightsyncError, match="after 2 attempts"):
            engine.swap(1, make_weights(1), digest="digest-1")
        assert engine.served_version() is None and engine.current_dir() is None and engine.snapshots() == []
    finally:
        engine.close()


def test_dir_snapshot_layout_body_template_and_retention(tmp_path):
    fake = FakeReloadServer()
    engine = open_engine(
        {
            "type": "safetensors_dir",
            "root": str(tmp_path / "s"),
            "model": SMALL,
            "reload_url": fake.url,
            "reload_body": {"model_path": "{path}", "weight_version": "{version}", "tags": ["{digest}", 7]},
            "keep_snapshots": 2,
            "max_shard_bytes": 20_000,
        }
    )
    try:
        for v in range(1, 5):
            engine.swap(v, make_weights(v), digest=f"digest-{v}")
        root = tmp_path / "s"
        assert engine.snapshots() == [3, 4]
        assert os.readlink(root / "current") == "v000000000004"  # relative: the root may move
        snapshot = root / "v000000000004"
        assert fake.bodies[-1] == {"model_path": str(snapshot), "weight_version": "4", "tags": ["digest-4", 7]}
        assert json.loads((snapshot / "weightsync.json").read_text()) == {"version": 4, "digest": "digest-4"}
        assert ModelConfig.from_hf(json.loads((snapshot / "config.json").read_text())) == ModelConfig(**SMALL)
        assert (snapshot / "model.safetensors.index.json").exists(), "20 kB shards: an HF-style index"
        assert_bit_equal(fake.loaded[-1][1], make_weights(4))
        assert sorted(p.name for p in root.iterdir()) == [".lock", "current", "v000000000003", "v000000000004"]
    finally:
        engine.close()
        fake.close()


def test_dir_template_files_and_layout(tmp_path):
    template = tmp_path / "template"
    save_pretrained(template, ModelConfig(**SMALL), make_weights(0))
    (template / "tokenizer.json").write_text('{"model": "bytes"}')
    fake = FakeReloadServer()
    engine = open_engine(
        {"type": "safetensors_dir", "root": str(tmp_path / "s"), "template_dir": str(template), "reload_url": fake.url}
    )
    try:
        bad = make_weights(1)
        bad["model.norm.weight"] = bad["model.norm.weight"].float()
        with pytest.raises(LayoutError, match="model.norm.weight is torch.float32"):
            engine.swap(1, bad, digest="digest-1")
        engine.swap(1, make_weights(1), digest="digest-1")
        snapshot = engine.current_dir()
        assert (snapshot / "tokenizer.json").read_text() == '{"model": "bytes"}'
        assert (snapshot / "config.json").read_text() == (template / "config.json").read_text()
        assert_bit_equal(fake.loaded[-1][1], make_weights(1))
    finally:
        engine.close()
        fake.close()


def test_dir_reopen_cleans_leftovers_and_reuses_a_complete_snapshot(tmp_path):
    root = tmp_path / "s"
    fake = FakeReloadServer()
    options = {"type": "safetensors_dir", "root": str(root), "model": SMALL, "reload_url": fake.url}
    engine = open_engine(options)
    try:
        engine.swap(1, make_weights(1), digest="digest-1")
        with pytest.raises(WeightsyncError, match="another engine"):
            open_engine(options)
    finally:
        engine.close()
    # What a crash leaves: a half-written snapshot, a half-deleted one, a temp symlink.
    (root / ".tmp-v000000000002-abc").mkdir()
    (root / ".tmp-v000000000002-abc" / "model.safetensors").write_bytes(b"partial")
    (root / ".trash-v000000000000-1234").mkdir()
    os.symlink("v000000000002", root / ".current.tmp-xyz")
    snapshot_inode = (root / "v000000000001" / "model.safetensors").stat().st_ino
    engine = open_engine(options)
    try:
        assert sorted(p.name for p in root.iterdir()) == [".lock", "current", "v000000000001"]
        assert engine.served_version() is None, "unknown until a swap succeeds in this process"
        engine.swap(1, make_weights(1), digest="digest-1")  # the agent re-applies its last version
        assert (root / "v000000000001" / "model.safetensors").stat().st_ino == snapshot_inode
        assert engine.served_version() == 1 and len(fake.loaded) == 2
        with pytest.raises(WeightsyncError, match="must not be reused"):
            engine.swap(1, make_weights(5), digest="digest-5")
        assert_bit_equal(load_pretrained(engine.current_dir())[1], make_weights(1))
    finally:
        engine.close()
        fake.close()


_CRASH_CHILD = """
import sys, torch
from weightsync.agents.engines import open_engine
from weightsync.models import ModelConfig, build_model
small = {small!r}
engine = open_engine({{"type": "safetensors_dir", "root": sys.argv[1], "model": small, "keep_snapshots": 2}})
for v in range(1, 100000):
    m = build_model(ModelConfig(**small), seed=v % 7)
    engine.swap(v, {{n: t.to(torch.bfloat16) for n, t in m.state_dict().items()}}, digest=f"digest-{{v}}")
    print(v, flush=True)
"""


@pytest.mark.slow
def test_dir_sigkill_mid_swap_leaves_current_complete(tmp_path):
    root = tmp_path / "s"
    child = subprocess.Popen(
        [sys.executable, "-c", _CRASH_CHILD.format(small=SMALL), str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        for _ in range(15):  # let it get well into its loop, then kill it wherever it is
            assert child.stdout.readline(), "the child died before being killed"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        child.stdout.close()
    current = root / os.readlink(root / "current")
    version = json.loads((current / "weightsync.json").read_text())["version"]
    assert current.name == f"v{version:012d}" and version >= 15
    expected = build_model(ModelConfig(**SMALL), seed=version % 7).state_dict()
    assert_bit_equal(load_pretrained(current)[1], {n: t.to(torch.bfloat16) for n, t in expected.items()})
    engine = open_engine({"type": "safetensors_dir", "root": str(root), "model": SMALL})
    try:
        assert not [p for p in root.iterdir() if p.name.startswith((".tmp-", ".trash-", ".current.tmp-"))]
        assert engine.current_dir() == current
    finally:
        engine.close()


def test_dir_needs_no_model_code(tmp_path):
    """A generic engine: an HF config.json dict as `model`, layout from the first swap, and the
    decoder (weightsync.models) never imported: the registry imports the directory engine's module alone."""
    hf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 32}
    child = f"""
import json, sys, torch
from weightsync.agents.engines import open_engine
from weightsync.errors import LayoutError
engine = open_engine({{"type": "safetensors_dir", "root": sys.argv[1], "model": {hf!r}}})
engine.swap(1, {{"a": torch.zeros(2, 3, dtype=torch.bfloat16)}}, digest="d1")
try:
    engine.swap(2, {{"a": torch.zeros(3, 2, dtype=torch.bfloat16)}}, digest="d2")
    raise SystemExit("a shape change was accepted")
except LayoutError as e:
    assert "needs (2, 3)" in str(e), e
assert json.loads((engine.current_dir() / "config.json").read_text()) == {hf!r}
assert "weightsync.models" not in sys.modules, "the engine imported the decoder"
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path / "s")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
