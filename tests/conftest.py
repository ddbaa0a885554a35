"""Shared fixtures: stores, small model-like state dicts, realistic sparse perturbations.

`store` is the fixture the store contract suite runs against; it is parametrized over every
scheme in the store registry (`weightsync.stores.STORE_SCHEMES`), so a new backend is covered
without a test edit: `file` gets a fresh directory, `s3` a fresh bucket on the moto server, any
other scheme `open_store("<scheme>://contract-<random>")`. `tmp_store` is always a LocalStore,
for tests that need a real directory.
Helpers that tests call (`make_state_dict`, `perturb`, `published_view`, `assert_bit_equal`)
are fixtures returning plain functions, so test modules never import conftest.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch

from harness.bits import assert_bit_equal as _assert_bit_equal
from harness.moto import MotoServer
from weightsync.stores import STORE_SCHEMES, LocalStore, open_store

SCHEME_MARKS = {"s3": pytest.mark.s3}  # schemes whose tests need a marked resource
STORE_KINDS = [pytest.param(scheme, marks=SCHEME_MARKS.get(scheme, ())) for scheme in STORE_SCHEMES]


# The files that run for minutes (seconds of one fresh-clone run beside two busy loops: chaos 280,
# the vLLM engine 240, vLLM sampling 175, crash 134, the vLLM demo 122, the cookbook 107, ...),
# handed out first, so that none of them starts last and runs alone while the other workers idle.
# The rest follow with the most tests first (xdist's own order); scripts/test.sh runs `--dist
# loadfile --no-loadscope-reorder` so that xdist keeps this order. Order only.
# The vLLM files (each starts one to three servers of three processes) alternate with the others,
# so that about two of the four workers run one at a time: in one order all four ran them at once
# (six to seven servers) and those minutes took twice as long as in a run where they overlapped
# less. They start fifth: scripts/test.sh is still setting up .venv-vllm while the first files run.
LONGEST_FIRST = (
    "tests/test_chaos.py",
    "tests/test_crash.py",
    "tests/app/training/test_training_cookbook.py",
    "tests/trainer/test_moe_trainer.py",
    "tests/agents/engines/test_vllm.py",
    "tests/trainer/test_trainer_distributed.py",
    "tests/app/training/test_training_vllm_sampling.py",
    "tests/app/training/test_training_distributed.py",
    "tests/app/test_demo_vllm.py",
    "tests/app/test_demo.py",
    "tests/app/test_cli.py",
    "tests/agents/engines/test_vllm_delta.py",
    "tests/app/test_train_to_serve.py",
    "tests/agents/engines/test_vllm_moe.py",
    "tests/trainer/test_parallel_trainer.py",
    "tests/agents/engines/test_vllm_lora.py",
)


def pytest_collection_modifyitems(config, items):
    root = Path(config.rootpath)
    missing = [name for name in LONGEST_FIRST if not (root / name).is_file()]
    if missing:  # a renamed file would silently lose its place
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that do not exist: {missing}")
    rank = {root / name: i for i, name in enumerate(LONGEST_FIRST)}
    tests_in = Counter(Path(item.path) for item in items)

    def place(item) -> tuple:
        path = Path(item.path)
        return (rank[path], 0, "") if path in rank else (len(rank), -tests_in[path], str(path))

    items.sort(key=place)  # stable: a file's tests keep their order


def pytest_configure(config):
    """What a test's body starts and leaves running is stopped when it ends, timeouts included
    (harness/pytest_reaper.py). Registered as a plugin of the whole run rather than imported as
    this file's hooks: a conftest's hooks see only the nodes under tests/, and a session-scoped
    fixture set up lazily inside a test body (`request.getfixturevalue("s3_endpoint")`) runs on the
    session node, so its server took the test's mark and was stopped with the test."""
    config.pluginmanager.import_plugin("harness.pytest_reaper")
    config.pluginmanager.import_plugin("harness.pytest_shm")  # and nothing is left in /dev/shm
    config.pluginmanager.import_plugin("harness.pytest_kernels")  # numba's kernels compiled once, first


@pytest.fixture(scope="session", autouse=True)
def _no_real_aws():
    """Scrub AWS settings so that no test can reach a real account or bucket."""
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith("AWS_") and name != "AWS_CA_BUNDLE":
                mp.delenv(name)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        yield


@pytest.fixture(scope="session")
def s3_endpoint(_no_real_aws) -> str:
    """A moto S3 server in its own process on 127.0.0.1, stopped (by PID) after the session."""
    with MotoServer() as server:
        yield server.endpoint


@pytest.fixture
def s3_store(s3_endpoint):
    """An empty S3Store: a fresh bucket on the moto server, under a prefix."""
    import boto3

    from weightsync.stores.s3 import S3Store

    bucket = f"ws-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    return S3Store(bucket, "prefix/run1", endpoint_url=s3_endpoint)


@pytest.fixture(params=STORE_KINDS)
def store(request, tmp_path):
    """An empty store of every scheme in the registry."""
    if request.param == "file":
        return LocalStore(tmp_path / "store")
    if request.param == "s3":
        return request.getfixturevalue("s3_store")
    return open_store(f"{request.param}://contract-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def tmp_store(tmp_path) -> LocalStore:
    """An empty LocalStore in a fresh directory (tmp_path / "store")."""
    return LocalStore(tmp_path / "store")


# ------------------------------------------------------------------------------ state dicts


def _make_state_dict(seed: int, *, width: int = 256, layers: int = 2) -> dict[str, torch.Tensor]:
    """A small model-like state dict: fp32 matrices (a few thousand to ~200k elements), a 1-D
    norm weight, an int64 buffer, a 0-dim tensor and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {"embed.weight": torch.randn(64, width, generator=g) * 0.02}
    for i in range(layers):
        sd[f"layers.{i}.attn.qkv.weight"] = torch.randn(3 * width // 4, width, generator=g) * 0.05
        sd[f"layers.{i}.mlp.up.weight"] = torch.randn(width * 3, width, generator=g) * 0.05  # ~197k
        sd[f"layers.{i}.norm.weight"] = 1.0 + 0.1 * torch.randn(width, generator=g)
    sd["position_ids"] = torch.arange(128, dtype=torch.int64).reshape(1, 128) + seed
    sd["logit_scale"] = torch.tensor(2.5 + seed)  # 0-dim
    sd["empty.bias"] = torch.empty(0, 16)
    return sd


def _perturb(state_dict: dict, fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy of `state_dict` with ~`fraction` of each float tensor's elements multiplied by
    (1 + 1e-3 * randn): an optimizer step, mostly below a bf16 ULP, so casts differ sparsely."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state_dict.items():
        t = t.clone()
        if t.is_floating_point() and t.numel():
            mask = torch.rand(t.shape, generator=g) < fraction
            factor = 1.0 + 1e-3 * torch.randn(t.shape, generator=g)
            t = torch.where(mask, t * factor.to(t.dtype), t)
        out[name] = t
    return out


def _published_view(state_dict: dict, cast_floats_to: torch.dtype | None = torch.bfloat16) -> dict:
    """What a publisher with `cast_floats_to` publishes: floats cast, everything else as is."""
    return {
        name: t.to(cast_floats_to) if cast_floats_to is not None and t.is_floating_point() else t.clone()
        for name, t in state_dict.items()
    }


@pytest.fixture
def make_state_dict():
    return _make_state_dict


@pytest.fixture
def perturb():
    return _perturb


@pytest.fixture
def published_view():
    return _published_view


@pytest.fixture
def assert_bit_equal():
    return _assert_bit_equal
