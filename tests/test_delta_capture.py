"""DeltaCapture: the reader records exactly the elements a route changes, old and new bits.

Versions published through the real publisher (every codec the choice picks, and each delta codec
forced through `highest_codec`), read back with a capture on one delta, a chain applied delta by
delta, and a folded route; the capture is compared with a comparison of whole states, and
`revert` puts the parent back bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weightsync.delta_capture import DeltaCapture
from weightsync.format.write_format import WriteFormat
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.stores import LocalStore

MODEL = "org/capture"


def versions(seed: int, count: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    current = {
        "a": torch.randn(300, 70, generator=g).to(torch.bfloat16),
        "b": torch.randn(5000, generator=g).to(torch.bfloat16),
        "c": torch.randn(64, 64, generator=g).to(torch.bfloat16),
    }
    out = [current]
    for step in range(1, count):
        nxt = {}
        for name, t in current.items():
            mask = torch.rand(t.shape, generator=g) < (0.02 if step != 2 else 0.0)
            moved = (t.float() * (1 + 2**-6)).to(t.dtype)
            nxt[name] = torch.where(mask, moved, t)
        if step == 3:  # some elements come back to their bits of two versions ago
            nxt["c"] = out[1]["c"].clone()
        out.append(nxt)
        current = nxt
    return out


def publish(tmp_path, snapshots, highest_codec=None) -> LocalStore:
    store = LocalStore(tmp_path / "store")
    fmt = WriteFormat() if highest_codec is None else WriteFormat(highest_codec=highest_codec)
    config = PublisherConfig(chunk_bytes=16 * 1024, write_format=fmt)
    with Publisher(store, model=MODEL, config=config) as publisher:
        for step, weights in enumerate(snapshots):
            publisher.publish(weights, step=step).result()
    return store


def expected(old: dict, new: dict, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    words = {2: np.uint16, 4: np.uint32}[new[name].element_size()]
    o = old[name].contiguous().view(-1).view({2: torch.int16, 4: torch.int32}[new[name].element_size()]).numpy()
    n = new[name].contiguous().view(-1).view({2: torch.int16, 4: torch.int32}[new[name].element_size()]).numpy()
    positions = np.flatnonzero(o != n)
    return positions, o.view(words)[positions], n.view(words)[positions]


@pytest.mark.parametrize("highest_codec", [None, 3, 4])
@pytest.mark.parametrize("route", ["one delta", "chain", "folded"])
def test_the_capture_holds_exactly_the_changed_elements_and_reverts(tmp_path, highest_codec, route):
    snapshots = versions(0, 5)
    store = publish(tmp_path, snapshots, highest_codec)
    reader = Reader(store, model=MODEL)
    start, target = (1, 2) if route == "one delta" else (0, 4)
    state = reader.read(start + 1)
    parent = state.manifest
    capture = DeltaCapture(parent)
    taken = reader.advance_route(state, target + 1, capture=capture, fold=route == "folded")
    assert taken.kind == ("folded" if route == "folded" else "chain")
    delta = capture.result(state.manifest)
    assert delta is not None and delta.parent is parent and delta.version.version == target + 1
    for name in snapshots[0]:
        positions, old, new = expected(snapshots[start], snapshots[target], name)
        if len(positions) == 0:
            assert name not in delta.tensors
            continue
        got = delta.tensors[name]
        assert (
            np.array_equal(got.positions, positions) and np.array_equal(got.old, old) and np.array_equal(got.new, new)
        )
    assert delta.changed < 0.2 * delta.elements
    delta.revert(state)
    assert state.manifest is parent
    for name, tensor in state.state_dict().items():
        assert torch.equal(tensor, snapshots[start][name]), name


def test_a_route_through_a_full_version_is_not_captured(tmp_path):
    snapshots = versions(1, 3)
    store = publish(tmp_path, snapshots)
    reader = Reader(store, model=MODEL)
    state = reader.read(1)
    state.manifest = None  # not on the chain: the reader reads from the base
    capture = DeltaCapture(reader.read(1).manifest)
    reader.advance_route(state, 3, capture=capture)
    assert capture.result(state.manifest) is None and "base" in capture.reason
