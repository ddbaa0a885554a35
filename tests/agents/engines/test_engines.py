"""The engine contract (agents/engine.py), one suite over every engine adapter, plus what only the
safetensors directory engine does (reload failures and retries, snapshot layout, retention,
crash leftovers). The reload target of the directory engine is a fake SGLang server that really
loads the directory it is told about, so the tests compare what it loaded with what was swapped in.
The sglang engine runs against harness/sglang_contract_server.py (its own tests: test_sglang_engine.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from harness.bits import assert_bit_equal
from harness.sglang_contract_server import SGLangContractServer
from weightsync.agents.engine import SWAP_POLICIES, Engine, open_engine
from weightsync.errors import LayoutError, WeightsyncError
from weightsync.models import ModelConfig, build_model, load_pretrained, save_pretrained

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
ENGINES = ["reference", "safetensors_dir", "sglang"]


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


class Kit:
    """An engine under test and how to see what it serves."""

    def __init__(self, kind: str, tmp_path: Path, **options) -> None:
        self.kind = kind
        self.fake = None
        self.server = None
        if kind == "reference":
            self.engine = open_engine({"type": "reference", "model": SMALL, **options})
        elif kind == "sglang":
            save_pretrained(tmp_path / "template", ModelConfig(**SMALL), make_weights(0))
            self.server = SGLangContractServer(tmp_path / "template")
            self.engine = open_engine(
                {
                    "type": "sglang",
                    "url": self.server.url,
                    "root": str(tmp_path / "snapshots"),
                    "template_dir": str(tmp_path / "template"),
                    "retry_backoff_s": 0.0,
                    **options,
                }
            )
        else:
            self.fake = FakeReloadServer()
            options = {
                "root": str(tmp_path / "snapshots"),
                "reload_url": self.fake.url,
                "model": SMALL,
                "reload_backoff_s": 0.0,
                **options,
            }
            self.engine = open_engine({"type": "safetensors_dir", **options})

    def served(self) -> tuple[int | None, dict[str, torch.Tensor] | None]:
        """(version, tensors) as the inference side has them."""
        if self.kind == "reference":
            served = self.engine.served()
            return served.version, dict(served.weights)
        if self.kind == "sglang":
            version = self.server.weight_version
            return (int(version), self.server.weights) if version.isdigit() else (None, None)
        if not self.fake.loaded:
            return None, None
        path, weights = self.fake.loaded[-1]
        return int(Path(path).name[1:]), weights

    def observe(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """What a reader sees right now: the served record, or the snapshot `current` names."""
        if self.kind == "reference":
            served = self.engine.served()
            return served.version, dict(served.weights)
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
        self.engine.close()
        if self.fake is not None:
            self.fake.close()
        if self.server is not None:
            self.server.close()


@pytest.fixture(params=ENGINES)
def kit(request, tmp_path):
    kit = Kit(request.param, tmp_path)
    yield kit
    kit.close()


# ------------------------------------------------------------------ the contract, over every engine


def test_swap_makes_the_version_served(kit):
    engine = kit.engine
    assert isinstance(engine, Engine)
    assert engine.served_version() is None
    w1 = make_weights(1)
    report = engine.swap(1, w1, digest="digest-1")
    assert report.version == 1 and 0 <= report.pause_s <= report.total_s
    assert engine.served_version() == 1
    version, served = kit.served()
    assert version == 1
    assert_bit_equal(served, w1)
    w2 = make_weights(2)
    engine.swap(2, w2, digest="digest-2")
    assert engine.served_version() == 2
    assert_bit_equal(kit.served()[1], w2)


def test_zero_copy_engines_serve_the_tensors_copying_engines_keep_none(kit):
    weights = make_weights(1)
    originals = {name: t.clone() for name, t in weights.items()}
    kit.engine.swap(1, weights, digest="digest-1")
    if kit.engine.zero_copy:
        served = kit.served()[1]
        assert all(served[name] is weights[name] for name in weights)
    else:
        for t in weights.values():  # the agent reuses its buffers as soon as swap returns
            t.fill_(float("nan"))
        assert_bit_equal(kit.served()[1], originals)
        assert_bit_equal(kit.observe()[1], originals)


@pytest.mark.parametrize("damage", ["missing", "unexpected", "shape", "not_a_tensor"])
def test_a_bad_swap_raises_and_the_previous_version_stays(kit, damage):
    w1 = make_weights(1)
    kit.engine.swap(1, w1, digest="digest-1")
    bad = make_weights(2)
    if damage == "missing":
        del bad["model.layers.1.mlp.up_proj.weight"]
    elif damage == "unexpected":
        bad["model.layers.2.mlp.up_proj.weight"] = bad["model.layers.1.mlp.up_proj.weight"]
    elif damage == "shape":
        bad["model.norm.weight"] = bad["model.norm.weight"][:-1]
    else:
        bad["model.norm.weight"] = [1.0] * 32
    with pytest.raises(LayoutError):
        kit.engine.swap(2, bad, digest="digest-2")
    assert kit.engine.served_version() == 1
    assert kit.served()[0] == 1
    assert_bit_equal(kit.served()[1], w1)
    assert kit.observe()[0] == 1
    if kit.kind == "safetensors_dir":
        assert kit.engine.snapshots() == [1]


def test_readers_only_ever_see_whole_versions(kit):
    versions = {v: make_weights(v) for v in range(1, 7)}
    kit.engine.swap(1, versions[1], digest="digest-1")
    stop = threading.Event()
    seen, problems = [], []

    def observe() -> None:
        while not stop.is_set():
            try:
                observed = kit.observe()
                if observed is not None:
                    version, weights = observed
                    seen.append(version)
                    if sorted(weights) != sorted(versions[version]) or not all(
                        torch.equal(weights[n], t) for n, t in versions[version].items()
                    ):
                        problems.append(f"version {version} observed with other tensors")
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
    assert kit.observe()[0] == 6


def test_wait_unused(kit):
    engine = kit.engine
    engine.swap(1, make_weights(1), digest="digest-1")
    engine.swap(2, make_weights(2), digest="digest-2")
    if not engine.zero_copy:
        assert engine.wait_unused(1, 0) and engine.wait_unused(2, 0)
        return
    assert engine.wait_unused(1, 0), "no request runs on a replaced version"
    assert not engine.wait_unused(2, 0.05), "the served version is in use: new requests get it"
    with engine.lease() as held:  # a request in flight on version 2
        assert held.version == 2
        engine.swap(3, make_weights(3), digest="digest-3")
        assert not engine.wait_unused(2, 0.05)
        result = []
        waiter = threading.Thread(target=lambda: result.append(engine.wait_unused(2, 60)))
        waiter.start()
    waiter.join()
    assert result == [True]
    assert engine.wait_unused(2, 0)


def test_close_is_idempotent(kit):
    kit.engine.swap(1, make_weights(1), digest="digest-1")
    kit.engine.close()
    kit.engine.close()
    with pytest.raises(WeightsyncError, match="closed"):
        kit.engine.swap(2, make_weights(2), digest="digest-2")


def test_every_engine_names_its_swap_policies_and_refuses_the_others(kit):
    engine = kit.engine
    assert "drain" in engine.swap_policies and set(engine.swap_policies) <= set(SWAP_POLICIES)
    for policy in SWAP_POLICIES:
        if policy not in engine.swap_policies:
            with pytest.raises(ValueError, match=f"does not implement swap policy {policy!r}"):
                engine.swap(1, make_weights(1), digest="digest-1", policy=policy)
    with pytest.raises(ValueError, match="swap policy must be one of"):
        engine.swap(1, make_weights(1), digest="digest-1", policy="later")
    assert engine.served_version() is None, "a refused policy touched nothing"


@pytest.mark.parametrize("kind", ENGINES)
def test_swap_refuses_bad_versions_and_digests(kind, tmp_path):
    kit = Kit(kind, tmp_path)
    try:
        for version in (-1, True, 1.0, "1"):
            with pytest.raises(ValueError, match="version"):
                kit.engine.swap(version, make_weights(1), digest="d")
        with pytest.raises(TypeError, match="digest"):
            kit.engine.swap(1, make_weights(1), digest=None)
        assert kit.engine.served_version() is None
    finally:
        kit.close()


def test_open_engine_refuses_unknown_types_and_options(tmp_path):
    with pytest.raises(ValueError, match="unknown engine type 'vllm-magic'.*reference.*safetensors_dir"):
        open_engine({"type": "vllm-magic"})
    with pytest.raises(ValueError, match="unknown engine type None"):
        open_engine({"model": SMALL})
    with pytest.raises(ValueError, match="options are"):
        open_engine({"type": "reference", "model": SMALL, "prot": 80})
    with pytest.raises(ValueError, match="options are"):
        open_engine({"type": "safetensors_dir", "root": str(tmp_path), "model": SMALL, "reload": "x"})
    with pytest.raises(ValueError, match="template_dir"):
        open_engine({"type": "safetensors_dir", "root": str(tmp_path)})


# ------------------------------------------------------------------ safetensors directory engine


@pytest.fixture
def dir_kit(tmp_path):
    kit = Kit("safetensors_dir", tmp_path, reload_retries=1)
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
from weightsync.agents.engine import open_engine
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
    decoder (weightsync.models) never imported (open_engine would import the reference server's)."""
    hf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 32}
    child = f"""
import json, sys, torch
from weightsync.agents.safetensors_engine import open_safetensors_dir_engine
from weightsync.errors import LayoutError
engine = open_safetensors_dir_engine({{"root": sys.argv[1], "model": {hf!r}}})
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
