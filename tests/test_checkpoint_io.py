"""safetensors in and out: every dtype round-trips bit for bit, sharding writes an HF index,
writes are atomic, and bad inputs get clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from harness.bits import bits_equal
from weightsync.checkpoint_io import INDEX_NAME, SINGLE_NAME, open_checkpoint, write_safetensors
from weightsync.errors import FormatError, LayoutError, StoreError

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
] + [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None]


def _sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (8 * 37,), dtype=torch.uint8, generator=g)  # arbitrary bit patterns, NaNs included
    out = {}
    for dtype in DTYPES:
        size = torch.empty((), dtype=dtype).element_size()
        out[f"t.{str(dtype).removeprefix('torch.')}"] = (
            raw[: 37 * size].view(dtype).clone().reshape(37) if dtype != torch.bool else (raw[:37] % 2).to(torch.bool)
        )
    out["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    out["empty"] = torch.empty(0, 3)
    return out


def test_every_dtype_round_trips_bit_exactly(tmp_path):
    sd = _sample()
    files = write_safetensors(sd, tmp_path / "out", metadata={"weightsync_version": 3})
    assert [f.name for f in files] == [SINGLE_NAME]
    back = open_checkpoint(tmp_path / "out")
    assert set(back) == set(sd)
    for name, tensor in sd.items():
        assert bits_equal(back[name], tensor), name


def test_sharded_write_has_an_index_and_reopens(tmp_path):
    sd = {f"layer.{i}.weight": torch.randn(100, 10) for i in range(6)}
    files = write_safetensors(sd, tmp_path / "out", max_shard_bytes=9000)
    assert files[-1].name == INDEX_NAME and len(files) == 4  # 3 shards of 2 tensors, then the index
    index = json.loads(files[-1].read_text())
    assert index["metadata"]["total_size"] == 6 * 100 * 10 * 4
    assert set(index["weight_map"]) == set(sd)
    back = open_checkpoint(tmp_path / "out")
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    # Writing a single-file checkpoint into the same directory removes the stale shards.
    write_safetensors({"a": torch.ones(2)}, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [SINGLE_NAME]


class _Exploding(dict):
    """A state dict whose second tensor fails on access: stands in for a crash mid-write."""

    def __getitem__(self, key):
        if key == "b":
            raise RuntimeError("boom")
        return super().__getitem__(key)


def test_interrupted_write_leaves_no_file_under_a_final_name(tmp_path):
    out = tmp_path / "out"
    sd = _Exploding(a=torch.ones(1000), b=torch.ones(1000))
    with pytest.raises(RuntimeError):
        write_safetensors(sd, out, max_shard_bytes=4000)
    assert list(out.iterdir()) == []


def test_several_files_and_errors(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "1.safetensors")
    save_file({"b": torch.zeros(2)}, tmp_path / "2.safetensors")
    both = open_checkpoint([tmp_path / "1.safetensors", tmp_path / "2.safetensors"])
    assert sorted(both) == ["a", "b"] and len(both) == 2
    assert sorted(open_checkpoint(tmp_path)) == ["a", "b"]  # a directory without an index: every file

    save_file({"a": torch.ones(3)}, tmp_path / "dup.safetensors")
    with pytest.raises(LayoutError, match="is in both"):
        open_checkpoint([tmp_path / "1.safetensors", tmp_path / "dup.safetensors"])
    with pytest.raises(StoreError, match="does not exist"):
        open_checkpoint(tmp_path / "missing.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LayoutError, match="no .safetensors"):
        open_checkpoint(tmp_path / "empty")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(FormatError, match="not a readable safetensors"):
        open_checkpoint(tmp_path / "junk.safetensors")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(StoreError, match="does not exist"):
        open_checkpoint(hf)
    (hf / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "../1.safetensors"}}))
    with pytest.raises(FormatError, match="outside"):
        open_checkpoint(hf)


# ------------------------------------------------------------------------------ torch DCP


def _save_dcp(state: dict, path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def test_a_dcp_directory_opens_with_every_tensor_bit_exact(tmp_path):
    want = {k: v for k, v in _sample().items() if v.dtype != torch.bool and v.numel()}
    _save_dcp({k: v.clone() for k, v in want.items()}, tmp_path / "dcp")
    got = open_checkpoint(tmp_path / "dcp")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert bits_equal(got[name], tensor), name


def test_a_dcp_training_state_yields_the_model_under_its_own_names(tmp_path):
    model = {"model.embed_tokens.weight": torch.randn(8, 4), "lm_head.weight": torch.randn(8, 4)}
    optim = {"state": {"model.embed_tokens.weight": {"exp_avg": torch.randn(8, 4), "step": torch.tensor(3.0)}}}
    _save_dcp({"model": {k: v.clone() for k, v in model.items()}, "optim": optim, "extra": {"step": 7}}, tmp_path / "c")
    got = open_checkpoint([tmp_path / "c"])
    assert sorted(got) == sorted(model)  # the optimizer's tensors are not weights
    for name, tensor in model.items():
        assert torch.equal(got[name], tensor), name


def test_a_dcp_directory_goes_alone_and_a_broken_one_is_a_clear_error(tmp_path):
    _save_dcp({"w": torch.ones(3)}, tmp_path / "dcp")
    save_file({"x": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(LayoutError, match="DCP checkpoint is published on its own"):
        open_checkpoint([tmp_path / "dcp", tmp_path / "x.safetensors"])
    (tmp_path / "dcp" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(FormatError, match="not a readable torch DCP metadata file"):
        open_checkpoint(tmp_path / "dcp")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LayoutError, match="no .safetensors files"):
        open_checkpoint(tmp_path / "empty")


def test_missing_dcp_data_is_a_clear_error_when_the_tensor_is_read(tmp_path):
    _save_dcp({"w": torch.ones(3)}, tmp_path / "dcp")
    for data in (tmp_path / "dcp").glob("*.distcp"):
        data.unlink()
    checkpoint = open_checkpoint(tmp_path / "dcp")
    with pytest.raises(FormatError, match="cannot read tensor 'w'"):
        checkpoint["w"]


def _fsdp_save(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial weights on both ranks
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()  # lr 0: the optimizer has state, the weights are unchanged
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=out)
    if rank == 0:
        torch.save(full, os.path.join(out, "..", "full.pt"))
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_an_fsdp2_training_state_saved_by_2_ranks_is_published_as_the_full_model(tmp_path):
    import socket
    import subprocess
    import sys

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_fsdp_save, args=(2, port, str(tmp_path / "dcp")), nprocs=2, start_method="spawn")
    want = torch.load(tmp_path / "full.pt")
    store = f"file://{tmp_path / 'store'}"
    for command in (
        ["publish", "--store", store, "--model", "m", "--keep-dtypes", str(tmp_path / "dcp")],
        ["pull", "--store", store, "--model", "m", "--out", str(tmp_path / "pulled")],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "weightsync.app.cli", *command], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
    got = open_checkpoint(tmp_path / "pulled")
    assert sorted(got) == sorted(want)  # the optimizer's state is not part of the model
    for name, tensor in want.items():
        assert bits_equal(got[name], tensor), name
