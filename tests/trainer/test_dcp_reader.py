"""Reading a torch DCP directory (`weightsync.trainer.checkpoint.open_dcp_checkpoint`, what
`weightsync publish` does with one): every tensor bit-exact, a training state's model only, clear
errors for a broken directory, and a checkpoint saved by 2 FSDP2 ranks published whole."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from harness.bits import bits_equal
from weightsync.checkpoint_io import open_checkpoint
from weightsync.errors import FormatError, LayoutError
from weightsync.trainer.checkpoint import open_dcp_checkpoint


def _sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {
        f"t.{str(d).removeprefix('torch.')}": torch.randn(37, generator=g).to(d)
        for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    }
    out.update({"ints": torch.randint(-100, 100, (5, 3), generator=g), "scalar": torch.tensor(2.5)})
    return out


def _save_dcp(state: dict, path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def test_a_dcp_directory_opens_with_every_tensor_bit_exact(tmp_path):
    want = _sample()
    _save_dcp({k: v.clone() for k, v in want.items()}, tmp_path / "dcp")
    got = open_dcp_checkpoint(tmp_path / "dcp")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert bits_equal(got[name], tensor), name


def test_a_dcp_training_state_yields_the_model_under_its_own_names(tmp_path):
    model = {"model.embed_tokens.weight": torch.randn(8, 4), "lm_head.weight": torch.randn(8, 4)}
    optim = {"state": {"model.embed_tokens.weight": {"exp_avg": torch.randn(8, 4), "step": torch.tensor(3.0)}}}
    _save_dcp({"model": {k: v.clone() for k, v in model.items()}, "optim": optim, "extra": {"step": 7}}, tmp_path / "c")
    got = open_dcp_checkpoint(tmp_path / "c")
    assert sorted(got) == sorted(model)  # the optimizer's tensors are not weights
    for name, tensor in model.items():
        assert torch.equal(got[name], tensor), name


def test_a_dcp_directory_goes_alone_and_a_broken_one_is_a_clear_error(tmp_path, capsys):
    from weightsync.app.cli import main

    _save_dcp({"w": torch.ones(3)}, tmp_path / "dcp")
    save_file({"x": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    store = str(tmp_path / "store")
    assert (
        main(["publish", "--store", store, "--model", "m", str(tmp_path / "dcp"), str(tmp_path / "x.safetensors")]) == 1
    )
    assert "DCP checkpoint is published on its own" in capsys.readouterr().err
    (tmp_path / "dcp" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(FormatError, match="not a readable torch DCP metadata file"):
        open_dcp_checkpoint(tmp_path / "dcp")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LayoutError, match="no .safetensors files"):
        open_checkpoint(tmp_path / "empty")


def test_missing_dcp_data_is_a_clear_error_when_the_tensor_is_read(tmp_path):
    _save_dcp({"w": torch.ones(3)}, tmp_path / "dcp")
    for data in (tmp_path / "dcp").glob("*.distcp"):
        data.unlink()
    checkpoint = open_dcp_checkpoint(tmp_path / "dcp")
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
