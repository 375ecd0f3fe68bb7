"""Writing files so that nobody ever sees half of one; knowing a file's SHA-256 without
reading it again."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write through a temporary sibling and a rename, so readers never see half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, read a block at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class HashRecord:
    """The SHA-256 of some files of a folder, each kept with the file's stamp when it was
    hashed (size, modification and change times in nanoseconds, inode): a file whose stamp is
    unchanged is not read again. Writing a file changes its change time (which no program
    can set back) and replacing it its inode, so an edited or swapped file is hashed again;
    a copied folder's files are hashed once more, at their new stamps. The record is a
    cache, not a signature: deleting it costs one hashing; a folder it cannot be written
    to (read-only) is hashed every time.

    ``sha256(path)``: the file's sum (from the record or read now); ``put(path, sum)``: a sum
    just computed while writing the file; ``save()``: writes the record (atomically) if it
    changed."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.changed = False
        try:
            entries = json.loads(self.path.read_text())["files"]
            self.entries = {str(k): v for k, v in entries.items()} if isinstance(entries, dict) else {}
        except (OSError, ValueError, KeyError, TypeError):
            self.entries = {}

    def _key(self, path: Path) -> str:
        return os.path.relpath(path, self.path.parent)

    def sha256(self, path: str | os.PathLike) -> str:
        path = Path(path)
        stamp = file_stamp(path)
        entry = self.entries.get(self._key(path))
        if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
        digest = file_sha256(path)
        if file_stamp(path) == stamp:   # not written to while it was read
            self.entries[self._key(path)] = {"sha256": digest, "stamp": stamp}
            self.changed = True
        return digest

    def put(self, path: str | os.PathLike, digest: str) -> None:
        self.entries[self._key(Path(path))] = {"sha256": digest, "stamp": file_stamp(path)}
        self.changed = True

    def save(self) -> None:
        if not self.changed:
            return
        try:
            atomic_write_bytes(self.path, (json.dumps({"files": self.entries}, indent=1, sort_keys=True) + "\n").encode())
        except OSError:   # a folder this process may not write: the next run hashes again
            pass
        self.changed = False


def file_stamp(path: str | os.PathLike) -> list[int]:
    """What changes whenever a file's content does: size, modification and change times
    (nanoseconds), inode."""
    found = os.stat(path)
    return [found.st_size, found.st_mtime_ns, found.st_ctime_ns, found.st_ino]


def read_json(path: Path, what: str, error: type[Exception]):
    """The JSON document at ``path``; ``error`` (one line naming ``what``) if it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{what} is not valid JSON ({exc})") from None
    except OSError as exc:
        raise error(f"cannot read {what}: {exc.strerror or exc}") from None
