"""stores.local: the `Store` contract over a local directory (`file://DIR`).

Not here: the contract itself (`base.py`), choosing a backend by URI (`stores/__init__.py`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from weightsync.errors import ObjectExists, ObjectNotFound, ObjectTooShort, StoreError, StoreUriError
from weightsync.stores.base import TEMP_PREFIX, ObjectInfo, check_key, check_range


class LocalStore:
    """A directory (`file://DIR`): atomic renames for puts, hard links for create-only puts.

    Objects are written to a temporary file in the target directory, flushed to disk, then
    renamed (put) or hard-linked (put_new: link(2) fails if the name exists, which makes the
    create atomic) into place, and the directory entry is flushed. A crash leaves at most a
    stray `.tmp-*` file, which listing ignores and `gc` removes.
    """

    io_concurrency = 4  # a local disk gains little from more parallel writes

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True) -> None:
        self.root = Path(root).resolve()
        self.uri = f"file://{self.root}"
        self.fsync = fsync  # the directory is created by the first write, never by a reader

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            # A directory where an object would be (or an object where a directory would be)
            # is a missing key, as on an object store.
            raise ObjectNotFound(f"{self.uri}/{key} does not exist") from None
        except OSError as e:
            raise StoreError(f"cannot read {self.uri}/{key}: {e}") from e

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(start, length)
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(length)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(f"{self.uri}/{key} does not exist") from None
        except OSError as e:
            raise StoreError(f"cannot read {self.uri}/{key}: {e}") from e
        if len(data) != length:
            raise ObjectTooShort(
                f"{self.uri}/{key}: bytes {start}..{start + length} run past the object's end "
                f"({start + len(data)} bytes)"
            )
        return data

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.replace(tmp, path)
        except OSError as e:
            _unlink_quietly(tmp)
            raise StoreError(f"cannot write {self.uri}/{key}: {e}") from e
        self._sync_dir(path.parent)

    def put_new(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise ObjectExists(f"{self.uri}/{key} already exists") from None
        except OSError as e:
            raise StoreError(f"cannot create {self.uri}/{key}: {e}") from e
        finally:
            _unlink_quietly(tmp)
        self._sync_dir(path.parent)

    def touch(self, key: str) -> None:
        path = self._path(key)
        try:
            if not path.is_file():
                raise FileNotFoundError(key)
            os.utime(path)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(f"{self.uri}/{key} does not exist") from None
        except OSError as e:
            raise StoreError(f"cannot touch {self.uri}/{key}: {e}") from e

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Walk only the directory the prefix names, not the whole store.
        directory = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if prefix:
            check_key(prefix.rstrip("/") or "x")
        found = []
        for dirpath, dirnames, filenames in os.walk(directory):
            dirnames.sort()
            # The key prefix once per directory: an agent's cache gc lists thousands of chunks
            # after every sync, and relpath per file was most of that listing's time.
            relative = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            key_prefix = "" if relative == "." else relative + "/"
            for name in filenames:
                key = key_prefix + name
                if name.startswith(TEMP_PREFIX) or not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:  # deleted while we walked
                    continue
                found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        found.sort(key=lambda info: info.key)
        yield from found

    def delete(self, key: str) -> None:
        path = self._path(key)
        if not path.is_file():  # missing, or a directory of other objects: nothing to delete
            return
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StoreError(f"cannot delete {self.uri}/{key}: {e}") from e

    def temp_files(self) -> Iterator[ObjectInfo]:
        """Leftovers of crashed writes (for gc)."""
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                if name.startswith(TEMP_PREFIX):
                    full = os.path.join(dirpath, name)
                    try:
                        st = os.stat(full)
                    except FileNotFoundError:
                        continue
                    yield ObjectInfo(os.path.relpath(full, self.root), st.st_size, st.st_mtime)

    def delete_temp(self, relpath: str) -> None:
        _unlink_quietly(self.root / relpath)

    def _write_temp(self, path: Path, data: bytes | memoryview) -> Path:
        try:
            self._make_dirs(path.parent)
            tmp = path.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            return tmp
        except OSError as e:
            raise StoreError(f"cannot write under {path.parent}: {e}") from e

    def _make_dirs(self, directory: Path) -> None:
        """mkdir -p, flushing each new directory's entry so a committed path survives power loss."""
        if directory.is_dir():
            return
        missing = []
        while not directory.is_dir():
            missing.append(directory)
            directory = directory.parent
        for new in reversed(missing):
            try:
                new.mkdir()
            except FileExistsError:  # a concurrent writer made it
                pass
            self._sync_dir(new.parent)

    def _sync_dir(self, directory: Path) -> None:
        if not self.fsync:
            return
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def open_local(location: str, **options) -> LocalStore:
    """`DIR` (the part after `file://`, or a plain path) as a store."""
    if not location:
        raise StoreUriError("file:// URI needs a directory, e.g. file:///data/weights")
    return LocalStore(location, **options)
