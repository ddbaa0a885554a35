"""WriteFormat: a publisher writes what the readers it serves can read, as declared configuration.

Two publishers in one process, in two threads at once, one writing for readers from before packs
and codec 4 (`WriteFormat(manifest_format=1, highest_codec=3)`) and one with the default: each
writes exactly what its own format allows (with module globals, one flipped the other's codecs
mid-encode), the first's versions decode with a reader that refuses anything newer, and the
second's use `ctx`, `rans` and packs and read back bit-exactly. Also: WriteFormat's validation,
and how it settles with `PublisherConfig.pack_bytes`.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import struct
import threading

import numpy as np
import pytest
import torch

from weightsync.errors import UnsupportedFormatError
from weightsync.format.codecs import CODEC_CTX, CODEC_NAMES, CODEC_SPARSE
from weightsync.format.codecs.choice import CodecChoice
from weightsync.format.layout import manifest_key, model_prefix
from weightsync.format.pack import DEFAULT_PACK_BYTES
from weightsync.format.write_format import WriteFormat
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.stores import LocalStore

MODEL = "write-format/model"
WAIT_S = 120
FORMAT_1_READERS = WriteFormat(manifest_format=1, highest_codec=CODEC_SPARSE)
DELTA_CEILINGS = sorted(i for i in CODEC_NAMES if i >= CODEC_SPARSE)  # [3, 4, 5]: the registry's
CHUNK_BYTES = 256 * 1024  # several chunks a version: the two publishers' encodes interleave


class OldFormatReader:
    """Stands in for a reader built before packs and codec 4 (manifest format 1, codecs 1-3).

    It refuses what such a reader cannot parse, checked on the stored bytes before anything is
    decoded: a manifest whose `format` is not 1, a chunk entry with a pack `offset` or a codec
    other than full/xor/sparse/same, an object whose header is not chunk format 1 or names a codec
    id above 3 (the header's bytes 4-6). What passes is decoded by the Reader, whose full, xor
    and sparse decoders are the first release's (tests/format/test_golden.py pins their objects).
    """

    MANIFEST_FORMATS = (1,)
    CODECS = ("full", "xor", "sparse", "same")
    HIGHEST_CODEC_ID = 3

    def __init__(self, store: LocalStore, model: str) -> None:
        self.store, self.model = store, model

    def read(self, version: int) -> dict[str, torch.Tensor]:
        step = version
        while step is not None:  # the chain back to its base, each manifest and object checked
            doc = json.loads(self.store.get(manifest_key(self.model, step)))
            self._check(step, doc)
            step = doc["parent"] if doc["kind"] == "delta" else None
        return Reader(self.store, model=self.model).read(version).state_dict()

    def _check(self, version: int, doc: dict) -> None:
        if doc["format"] not in self.MANIFEST_FORMATS:
            raise UnsupportedFormatError(
                f"v{version}: manifest format {doc['format']} is not supported; supported: [1]"
            )
        for tensor in doc["tensors"]:
            for chunk in tensor["chunks"]:
                if "offset" in chunk or chunk["codec"] not in self.CODECS:
                    raise UnsupportedFormatError(f"v{version}: chunk {chunk} is not a format-1 chunk")
                if chunk["codec"] == "same":
                    continue
                obj = self.store.get(model_prefix(self.model) + chunk["key"])
                chunk_format, codec_id = struct.unpack_from("<HB", obj, 4)
                if chunk_format != 1 or codec_id > self.HIGHEST_CODEC_ID:
                    raise UnsupportedFormatError(f"v{version}: object {chunk['object']} has codec id {codec_id}")


def _series(n: int) -> list[dict[str, torch.Tensor]]:
    """bf16 weights of std 0.02 and then steps at RL change rates: 5 % of the elements move by one
    ULP. In `CHUNK_BYTES` chunks: 8 of a 1M-element tensor (~6.5k changes each: `rans` territory)
    and one of a 32k one (~1.6k: `ctx`)."""
    g = torch.Generator().manual_seed(11)
    rng = np.random.default_rng(11)
    state = {
        name: (torch.randn(size, generator=g) * 0.02).to(torch.bfloat16)
        for name, size in [("big", 1 << 20), ("small", 1 << 15)]
    }
    series = [state]
    for _ in range(n - 1):
        state = {name: t.clone() for name, t in state.items()}
        for t in state.values():
            bits = t.view(torch.int16).numpy()
            moved = rng.choice(t.numel(), int(0.05 * t.numel()), replace=False)
            bits[moved] += rng.choice(np.array([-1, 1], dtype=np.int16), len(moved))
        series.append(state)
    return series


def _codecs_of(manifests) -> list[set[str]]:
    return [{c.codec for t in m.tensors for c in t.chunks} for m in manifests]


def test_two_publishers_at_once_each_write_for_their_own_readers(tmp_path):
    series = _series(4)
    stores = {"old": LocalStore(tmp_path / "old"), "new": LocalStore(tmp_path / "new")}
    formats = {"old": FORMAT_1_READERS, "new": WriteFormat()}
    start = threading.Barrier(2)

    def publish(which: str):
        config = PublisherConfig(
            write_format=formats[which], chunk_bytes=CHUNK_BYTES, workers=2, parent_from_store=False
        )
        with Publisher(stores[which], model=MODEL, config=config) as publisher:
            start.wait(WAIT_S)  # both encode at once, on their own pools, in one process
            futures = [publisher.publish(sd) for sd in series]
            return [f.result(timeout=WAIT_S).manifest for f in futures]

    with cf.ThreadPoolExecutor(2) as pool:
        running = {which: pool.submit(publish, which) for which in stores}
        manifests = {which: f.result(timeout=4 * WAIT_S) for which, f in running.items()}

    old, new = manifests["old"], manifests["new"]
    assert [m.kind for m in old] == [m.kind for m in new] == ["full", "delta", "delta", "delta"]
    # The default publisher's deltas are where ctx and rans win, packed ...
    new_codecs = _codecs_of(new[1:])
    assert all({"ctx", "rans"} <= used for used in new_codecs), new_codecs
    assert all(m.format == 2 for m in new[1:]) and all(c.offset is not None for c in new[1].tensors[0].chunks)
    # ... and the same deltas, written for format-1 readers, are in the first three codecs, unpacked.
    assert all(used <= {"xor", "sparse", "same"} for used in _codecs_of(old[1:]))
    assert all(m.format == 1 for m in old)
    assert all(c.offset is None for m in old for t in m.tensors for c in t.chunks)

    old_reader = OldFormatReader(stores["old"], MODEL)
    for version, expected in enumerate(series, start=1):
        got = old_reader.read(version)
        for name, want in expected.items():
            assert torch.equal(got[name].view(torch.int16), want.view(torch.int16)), (version, name)
        got = Reader(stores["new"], model=MODEL).read(version).state_dict()
        for name, want in expected.items():
            assert torch.equal(got[name].view(torch.int16), want.view(torch.int16)), (version, name)
    # The stand-in is no pushover: the default publisher's deltas are what it refuses.
    with pytest.raises(UnsupportedFormatError, match="manifest format 2"):
        OldFormatReader(stores["new"], MODEL).read(2)


def test_a_write_format_before_rans_writes_ctx_and_no_rans(tmp_path):
    series = _series(2)
    store = LocalStore(tmp_path / "store")
    config = PublisherConfig(
        write_format=WriteFormat(highest_codec=CODEC_CTX), chunk_bytes=CHUNK_BYTES, parent_from_store=False
    )
    with Publisher(store, model=MODEL, config=config) as publisher:
        delta = [publisher.publish(sd).result(timeout=WAIT_S) for sd in series][-1].manifest
    assert {c.codec for t in delta.tensors for c in t.chunks} == {"ctx"}
    assert delta.format == 2  # packs are still allowed: only the codec is limited


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"manifest_format": 4}, r"manifest_format must be one of \[1, 2, 3\]"),
        ({"manifest_format": 0}, r"manifest_format must be one of \[1, 2, 3\]"),
        ({"highest_codec": 2}, re.escape(f"highest_codec must be one of {DELTA_CEILINGS}")),
        ({"highest_codec": max(CODEC_NAMES) + 1}, re.escape(f"highest_codec must be one of {DELTA_CEILINGS}")),
    ],
)
def test_a_write_format_readers_cannot_read_is_refused_with_the_fix(fields, match):
    with pytest.raises(ValueError, match=match):
        WriteFormat(**fields)
    if "highest_codec" in fields:  # the codec choice checks the same bound
        with pytest.raises(ValueError, match=match):
            CodecChoice(**fields)


def test_packs_follow_the_write_format_and_a_conflicting_pack_size_is_refused():
    assert PublisherConfig().effective_pack_bytes == DEFAULT_PACK_BYTES
    assert PublisherConfig(write_format=FORMAT_1_READERS).effective_pack_bytes == 0
    assert PublisherConfig(pack_bytes=0).effective_pack_bytes == 0  # no packs, whatever the format allows
    assert PublisherConfig(pack_bytes=1 << 20).effective_pack_bytes == 1 << 20
    with pytest.raises(ValueError, match="manifest format 1 cannot hold"):
        PublisherConfig(write_format=FORMAT_1_READERS, pack_bytes=1 << 20)
    assert PublisherConfig(write_format=FORMAT_1_READERS, pack_bytes=0).effective_pack_bytes == 0
