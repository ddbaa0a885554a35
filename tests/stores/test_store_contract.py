"""The Store contract (weightsync/stores/__init__.py, `Store` docstring), run against every backend.

Tests taking the `store` fixture are the contract: every backend must pass them unchanged.
Tests taking `tmp_store` / `tmp_path` check LocalStore specifics (temp files on disk, nothing
written outside the root) and `open_store`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from weightsync.errors import ObjectExists, ObjectNotFound, ObjectTooShort, StoreError, WeightsyncError
from weightsync.stores import LocalStore, ObjectInfo, Store, open_store

MiB = 1024 * 1024

INVALID_KEYS = ["../x", "a/../../x", "/abs", "a//b", "a/./b", "./a", "a/", "", ".", "..", "a\\b", "a b", "x" * 1025]


def _age(store, key: str, seconds: float) -> None:
    """Makes `key` look `seconds` old: back-dates the file on disk, elsewhere waits out the
    backend's one-second mtime resolution."""
    if isinstance(store, LocalStore):
        t = time.time() - seconds
        os.utime(store.root / key, (t, t))
    else:
        time.sleep(1.1)


# ------------------------------------------------------------------------------ get / put


def test_store_satisfies_protocol(store):
    assert isinstance(store, Store)
    assert isinstance(store.uri, str) and store.uri


@pytest.mark.parametrize("size", [0, 1, 4096, 8 * MiB + 3])
def test_put_get_round_trip(store, size):
    data = os.urandom(size)
    store.put(f"objects/o{size}", data)
    assert store.get(f"objects/o{size}") == data
    assert store.exists(f"objects/o{size}")


def test_put_accepts_memoryview(store):
    data = bytearray(os.urandom(1000))
    store.put("mv", memoryview(data)[10:900])
    assert store.get("mv") == bytes(data[10:900])


def test_get_missing_raises_object_not_found(store):
    with pytest.raises(ObjectNotFound) as info:
        store.get("nothing/here")
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, StoreError) and isinstance(info.value, WeightsyncError)
    assert "nothing/here" in str(info.value)


@pytest.mark.parametrize("start,length", [(0, 1), (0, 9000), (1234, 100), (8999, 1), (5, 8994)])
def test_get_range_returns_exactly_the_range(store, start, length):
    data = os.urandom(9000)
    store.put("objects/ranged", data)
    assert store.get_range("objects/ranged", start, length) == data[start : start + length]


def test_get_range_spanning_several_transfer_parts(store):
    data = os.urandom(8 * MiB + 4097)  # past S3's part size: read as parallel ranged GETs
    store.put("objects/big", data)
    assert store.get_range("objects/big", 3, len(data) - 4) == data[3:-1]


def test_get_range_missing_object_raises_object_not_found(store):
    with pytest.raises(ObjectNotFound):
        store.get_range("nothing/here", 0, 10)


@pytest.mark.parametrize("start,length", [(90, 11), (100, 1), (500, 5)])
def test_get_range_past_the_end_is_a_clear_error(store, start, length):
    store.put("objects/short", os.urandom(100))
    with pytest.raises(ObjectTooShort, match="past the object.s end"):
        store.get_range("objects/short", start, length)


@pytest.mark.parametrize("start,length", [(-1, 5), (0, 0), (0, -3), (True, 1)])
def test_get_range_invalid_range_raises_store_error(store, start, length):
    store.put("objects/x", b"0123456789")
    with pytest.raises(StoreError, match="invalid byte range"):
        store.get_range("objects/x", start, length)


def test_put_overwrites(store):
    store.put("k", b"first version")
    store.put("k", b"second")
    assert store.get("k") == b"second"
    assert [i.key for i in store.list()] == ["k"]


def test_concurrent_put_and_get_never_see_partial_objects(store):
    a, b = b"A" * (2 * MiB), b"B" * (2 * MiB + 17)
    store.put("hot", a)
    stop = threading.Event()
    seen: list[bytes] = []
    errors: list[BaseException] = []

    def writer():
        try:
            for i in range(40):
                store.put("hot", a if i % 2 else b)
        except BaseException as e:  # surfaced below
            errors.append(e)
        finally:
            stop.set()

    def reader():
        try:
            while not stop.is_set():
                data = store.get("hot")
                if data not in (a, b):
                    seen.append(data[:16] + b"..." + data[-16:])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not seen, f"readers saw {len(seen)} partial objects"
    assert store.get("hot") in (a, b)


# ------------------------------------------------------------------------------- put_new


def test_put_new_creates_then_refuses_and_keeps_original(store):
    store.put_new("versions/1.json", b"original")
    assert store.get("versions/1.json") == b"original"
    with pytest.raises(ObjectExists) as info:
        store.put_new("versions/1.json", b"intruder")
    assert isinstance(info.value, StoreError) and isinstance(info.value, FileExistsError)
    assert store.get("versions/1.json") == b"original"
    assert [i.key for i in store.list()] == ["versions/1.json"]


def test_put_new_refuses_key_written_by_put(store):
    store.put("k", b"by put")
    with pytest.raises(ObjectExists):
        store.put_new("k", b"by put_new")
    assert store.get("k") == b"by put"


def test_racing_put_new_exactly_one_wins(store):
    n = 8
    barrier = threading.Barrier(n)
    outcomes: list[tuple[int, str]] = []
    lock = threading.Lock()

    def contender(i: int):
        payload = f"writer {i}".encode() * 1000
        barrier.wait()
        try:
            store.put_new("race/manifest.json", payload)
            outcome = "won"
        except ObjectExists:
            outcome = "lost"
        except BaseException as e:
            outcome = f"error {e!r}"
        with lock:
            outcomes.append((i, outcome))

    threads = [threading.Thread(target=contender, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, o in outcomes if o == "won"]
    assert len(outcomes) == n
    assert len(winners) == 1, outcomes
    assert sorted(o for _, o in outcomes) == ["lost"] * (n - 1) + ["won"], outcomes
    assert store.get("race/manifest.json") == f"writer {winners[0]}".encode() * 1000
    assert [i.key for i in store.list("race/")] == ["race/manifest.json"]


def test_racing_put_new_leaves_no_temp_files(tmp_store):
    barrier = threading.Barrier(8)

    def contender(i: int):
        barrier.wait()
        try:
            tmp_store.put_new("m.json", bytes([i]) * 100)
        except ObjectExists:
            pass

    threads = [threading.Thread(target=contender, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert list(tmp_store.temp_files()) == []


# ------------------------------------------------------------------------- touch / exists


def test_touch_refreshes_modified_time(store):
    store.put("chunks/ab/obj", b"x" * 10)
    _age(store, "chunks/ab/obj", 3600)
    (before,) = store.list("chunks/")
    t0 = time.time()
    store.touch("chunks/ab/obj")
    (after,) = store.list("chunks/")
    assert after.modified_unix_s > before.modified_unix_s
    assert after.modified_unix_s >= t0 - 2  # backends may round mtimes to seconds
    assert store.get("chunks/ab/obj") == b"x" * 10


def test_touch_missing_raises_object_not_found(store):
    with pytest.raises(ObjectNotFound):
        store.touch("chunks/ab/missing")


def test_exists(store):
    assert not store.exists("a/b")
    store.put("a/b", b"1")
    assert store.exists("a/b")
    assert not store.exists("a/b/c")
    store.delete("a/b")
    assert not store.exists("a/b")


@pytest.mark.parametrize("op", ["exists", "get", "touch", "delete"])
@pytest.mark.parametrize(
    "present, missing", [("a/b", "a"), ("a", "a/b")], ids=["missing-is-a-prefix", "missing-under-object"]
)
def test_keys_related_to_existing_objects_behave_as_missing(store, present, missing, op):
    """`a` when only `a/b` exists, and `a/b` when only `a` exists, are simply missing keys (as
    on an object store): exists is False, get/touch raise ObjectNotFound, delete is a no-op."""
    store.put(present, b"keep me")
    if op == "exists":
        assert not store.exists(missing)
    elif op == "delete":
        store.delete(missing)
    else:
        with pytest.raises(ObjectNotFound):
            getattr(store, op)(missing)
    assert store.get(present) == b"keep me"
    assert [i.key for i in store.list()] == [present]


# ----------------------------------------------------------------------------------- list


LIST_KEYS = [
    "b",
    "a/c/d",
    "a/b0",
    "a-b",
    "ab",
    "a/b",
    "models/m/versions/000000000002.json",
    "models/m/versions/000000000010.json",
    "models/m/chunks/ab/abcd",
]


@pytest.fixture
def listed_store(store):
    for i, key in enumerate(LIST_KEYS):
        store.put(key, b"x" * (i + 1))
    return store


def test_list_everything_in_key_order_with_sizes(listed_store):
    infos = list(listed_store.list())
    assert [i.key for i in infos] == sorted(LIST_KEYS)
    assert all(isinstance(i, ObjectInfo) for i in infos)
    assert {i.key: i.size for i in infos} == {k: n + 1 for n, k in enumerate(LIST_KEYS)}
    assert all(i.modified_unix_s > 0 for i in infos)


@pytest.mark.parametrize(
    "prefix",
    [
        "a/",
        "a/b",
        "a",
        "a/c/",
        "a/c/d",
        "models/m/versions/",
        "models/m/versions/00000000001",
        "models/",
        "zzz",
        "nothing/here/",
        "a/b0/",
    ],
)
def test_list_prefix_filters_like_a_string_prefix(listed_store, prefix):
    assert [i.key for i in listed_store.list(prefix)] == sorted(k for k in LIST_KEYS if k.startswith(prefix))


def test_list_empty_store(store):
    assert list(store.list()) == []
    assert list(store.list("models/")) == []


def test_list_invalid_prefix_raises(store):
    with pytest.raises(StoreError):
        list(store.list("../"))


def test_list_excludes_temp_files(tmp_store):
    tmp_store.put("models/m/versions/000000000001.json", b"{}")
    (tmp_store.root / "models/m/versions/.tmp-deadbeef").write_bytes(b"partial")
    (tmp_store.root / ".tmp-top").write_bytes(b"partial")
    assert [i.key for i in tmp_store.list()] == ["models/m/versions/000000000001.json"]
    assert [i.key for i in tmp_store.list("models/m/versions/")] == ["models/m/versions/000000000001.json"]
    assert sorted(i.key for i in tmp_store.temp_files()) == [".tmp-top", "models/m/versions/.tmp-deadbeef"]


def test_every_accepted_key_is_listed(store):
    """A key that put accepts is an object, so list must yield it (none is mistaken for a
    temp file and hidden, or later removed by gc as one)."""
    keys = ["a/.tmp-lookalike", ".tmp-x"]
    accepted = []
    for key in keys:
        try:
            store.put(key, b"data")
        except StoreError:
            continue
        accepted.append(key)
    assert [i.key for i in store.list()] == sorted(accepted)


# --------------------------------------------------------------------------------- delete


def test_delete_and_delete_missing(store):
    store.put("a/1", b"1")
    store.put("a/2", b"2")
    store.delete("a/1")
    assert not store.exists("a/1")
    with pytest.raises(ObjectNotFound):
        store.get("a/1")
    assert [i.key for i in store.list()] == ["a/2"]
    store.delete("a/1")  # already gone: not an error
    store.delete("never/was")
    assert store.get("a/2") == b"2"


# ---------------------------------------------------------------------------- invalid keys


@pytest.mark.parametrize("key", INVALID_KEYS, ids=lambda k: repr(k[:12]))
def test_invalid_keys_raise_store_error(store, key):
    for call in (
        lambda: store.get(key),
        lambda: store.put(key, b"x"),
        lambda: store.put_new(key, b"x"),
        lambda: store.touch(key),
        lambda: store.exists(key),
        lambda: store.delete(key),
    ):
        with pytest.raises(StoreError):
            call()
    assert list(store.list()) == []


def test_non_string_key_raises_store_error(store):
    with pytest.raises(StoreError):
        store.put(None, b"x")  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["../outside", "../store-sibling/x", "a/../../outside", "ABS"], ids=repr)
def test_invalid_keys_write_nothing_outside_the_root(tmp_path, key):
    root = tmp_path / "deep" / "store"
    store = LocalStore(root)
    if key == "ABS":
        key = str(tmp_path / "outside")
    for call in (lambda: store.put(key, b"x"), lambda: store.put_new(key, b"x"), lambda: store.touch(key)):
        with pytest.raises(StoreError):
            call()
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert written in ([], ["deep", "deep/store"])  # the root itself appears on first write at most


# ----------------------------------------------------------------------------- open_store


def test_open_store_file_uri(tmp_path):
    store = open_store(f"file://{tmp_path}/s")
    assert isinstance(store, LocalStore)
    store.put("k", b"v")
    assert (tmp_path / "s" / "k").read_bytes() == b"v"
    assert open_store(store.uri).get("k") == b"v"


def test_open_store_plain_path(tmp_path):
    for uri in (str(tmp_path / "p"), tmp_path / "p"):
        store = open_store(uri)
        assert isinstance(store, LocalStore)
        assert store.root == (tmp_path / "p").resolve()
    store.put("k", b"v")
    assert open_store(tmp_path / "p").get("k") == b"v"


@pytest.mark.parametrize("uri", ["ftp://x", "gs://bucket/prefix", "file://"])
def test_open_store_unsupported_uri(uri):
    with pytest.raises(StoreError) as info:
        open_store(uri)
    assert "file://" in str(info.value)
    if uri != "file://":
        assert "supported" in str(info.value)


def test_an_s3_store_without_boto3_names_the_extra_to_install(tmp_path):
    """boto3 is the `s3` extra: without it, opening an s3:// store says what to install."""
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('boto3', 'botocore'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from weightsync.errors import StoreError\n"
        "from weightsync.stores import open_store\n"
        "try:\n"
        "    open_store('s3://bucket/prefix')\n"
        "except StoreError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "pip install 'weightsync[s3]'" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("uri", ["s3:/bucket/x", "s3:bucket", "file:/tmp/x", "gs:/bucket/x"])
def test_a_scheme_with_its_slashes_missing_is_refused_not_made_a_directory(uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreError, match="neither a directory nor a URI"):
        open_store(uri)
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_scheme_lists_the_known_ones():
    with pytest.raises(StoreError, match=r"unsupported store URI 'gs://b/x'; supported: file://DIR .*s3://BUCKET"):
        open_store("gs://b/x")
