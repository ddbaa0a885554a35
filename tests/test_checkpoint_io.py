"""safetensors in and out: every dtype round-trips bit for bit, sharding writes an HF index,
writes are atomic, and bad inputs get clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from harness.bits import bits_equal
from weightsync.checkpoint_io import INDEX_NAME, SINGLE_NAME, is_dcp_checkpoint, open_checkpoint, write_safetensors
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


def test_a_dcp_directory_is_recognised_and_left_to_the_trainer_layer(tmp_path):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    assert is_dcp_checkpoint(tmp_path / "dcp") and not is_dcp_checkpoint(tmp_path)
    with pytest.raises(LayoutError, match="open_dcp_checkpoint"):
        open_checkpoint(tmp_path / "dcp")
