"""The model's files travel with its versions (docs/format.md, "Model files"). Found by a new user:
`weightsync train` published no config.json, so `weightsync pull` wrote a directory no engine
loads. Now a publisher given the files stores each once, content-addressed, and names them in every
version's producer.files: a pull gets its own version's files, checked against their hashes; gc
keeps what a kept version names; `WriteFormat(model_files=False)` keeps the older per-model copies
that older pulls read; and a damaged index is refused without touching the weights.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from weightsync.errors import FormatError, IntegrityError
from weightsync.format.hashing import xxh3_hex
from weightsync.format.layout import manifest_key, model_file_key, model_prefix
from weightsync.format.manifest import FORMAT_VERSION
from weightsync.format.write_format import WriteFormat
from weightsync.model_files import get_model_files, model_files_index
from weightsync.publisher import PublisherConfig, publish_once
from weightsync.reader import Reader
from weightsync.stores.retention import collect_garbage
from weightsync.versions import read_manifest

MODEL = "org/policy"
CONFIG = json.dumps({"model_type": "qwen3", "hidden_size": 8}).encode()
TOKENIZER = b'{"version": "1.0"}'


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))}


def _publish(store, seed: int, files: dict[str, bytes], **config) -> int:
    config = PublisherConfig(workers=1, warm_up_kernels=False, **config)
    return publish_once(store, _weights(seed), model=MODEL, config=config, model_files=files).version


def test_each_version_names_its_files_and_a_pull_gets_its_own_versions(tmp_store):
    v1 = _publish(tmp_store, 0, {"config.json": CONFIG, "tokenizer.json": TOKENIZER})
    newer = {"config.json": CONFIG + b" ", "tokenizer.json": TOKENIZER}
    v2 = _publish(tmp_store, 1, newer)
    first = read_manifest(tmp_store, MODEL, v1)
    assert first.format == FORMAT_VERSION  # no format axis moved: readers of format 1 read it
    assert first.producer["files"]["config.json"] == {"object": xxh3_hex(CONFIG), "size": len(CONFIG)}
    assert get_model_files(tmp_store, MODEL, first) == {"config.json": CONFIG, "tokenizer.json": TOKENIZER}
    assert get_model_files(tmp_store, MODEL, read_manifest(tmp_store, MODEL, v2)) == newer
    # The unchanged tokenizer is one object; the weights read as ever.
    stored = [info.key for info in tmp_store.list(model_prefix(MODEL) + "model-files/")]
    assert len(stored) == 3
    assert torch.equal(Reader(tmp_store, model=MODEL).read(v1).state_dict()["w"], _weights(0)["w"].bfloat16())


def test_a_file_that_does_not_match_its_hash_is_refused(tmp_store):
    version = _publish(tmp_store, 0, {"config.json": CONFIG})
    manifest = read_manifest(tmp_store, MODEL, version)
    key = model_prefix(MODEL) + model_files_index(manifest)["config.json"].key
    tmp_store.put(key, CONFIG.replace(b"8", b"9"))
    with pytest.raises(IntegrityError, match="config.json .* does not match its hash"):
        get_model_files(tmp_store, MODEL, manifest)
    tmp_store.delete(key)
    with pytest.raises(IntegrityError, match="config.json .* is missing"):
        get_model_files(tmp_store, MODEL, manifest)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ([], "must be an object"),
        ({"../config.json": {"object": "0" * 32, "size": 1}}, "invalid model file name"),
        ({"config.json": {"object": "xyz", "size": 1}}, "32 lowercase hex"),
        ({"config.json": {"object": "0" * 32, "size": -1}}, "size must be an integer"),
        ({"config.json": {"object": "0" * 32}}, 'must be {"object"'),
        ({f"f{i}": {"object": "0" * 32, "size": 1} for i in range(33)}, "at most 32 entries"),
    ],
)
def test_a_damaged_files_index_is_refused_naming_what_is_wrong(tmp_store, files, message):
    version = _publish(tmp_store, 0, {"config.json": CONFIG})
    manifest = read_manifest(tmp_store, MODEL, version)
    damaged = dataclasses.replace(manifest, producer={**manifest.producer, "files": files})
    with pytest.raises(FormatError, match=message):
        model_files_index(damaged)


def test_for_older_pulls_the_files_stay_one_copy_per_model(tmp_store):
    version = _publish(tmp_store, 0, {"config.json": CONFIG}, write_format=WriteFormat(model_files=False))
    manifest = read_manifest(tmp_store, MODEL, version)
    assert "files" not in manifest.producer
    assert tmp_store.get(model_file_key(MODEL, "config.json")) == CONFIG  # where older pulls look
    assert get_model_files(tmp_store, MODEL, manifest) == {"config.json": CONFIG}
    assert not list(tmp_store.list(model_prefix(MODEL) + "model-files/"))


def test_gc_keeps_the_files_a_kept_version_names_and_deletes_the_others(tmp_store):
    _publish(tmp_store, 0, {"config.json": b"old"}, rebase_every=0)
    latest = _publish(tmp_store, 1, {"config.json": CONFIG}, rebase_every=0)
    plan = collect_garbage(tmp_store, MODEL, keep=1, grace_s=3600)
    assert not any("model-files" in key for key in plan.delete_objects)  # young: spared by the grace period
    time.sleep(0.01)
    plan = collect_garbage(tmp_store, MODEL, keep=1, grace_s=0.001)
    assert [key for key in plan.delete_objects if "model-files" in key] == [
        model_prefix(MODEL) + f"model-files/{xxh3_hex(b'old')[:2]}/{xxh3_hex(b'old')}"
    ]
    assert get_model_files(tmp_store, MODEL, read_manifest(tmp_store, MODEL, latest)) == {"config.json": CONFIG}
    assert not tmp_store.exists(manifest_key(MODEL, 1))
