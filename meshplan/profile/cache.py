"""The profile cache: operator timings and communication fits in SQLite.

One file per user (``$XDG_CACHE_HOME/meshplan/profile.sqlite``, else
``~/.cache/meshplan/profile.sqlite``). Operator timings are keyed by hardware (CPU model
or GPU name), execution provider, onnxruntime version, thread count, timing method and
signature, so a
second profile of the same or a similar model times only what is new. Communication
fits are keyed by hardware, MPI library, the job's layout, the mesh axis and group size.

Every measurement is committed as soon as it is made (WAL journal), so an interrupted
profile keeps what it measured. A file that is not a readable cache of this format is
moved aside (``profile.sqlite.corrupt-<time>``) and a fresh one created.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from meshplan.profile.errors import ProfileError

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS op_times (
    hardware TEXT NOT NULL,
    provider TEXT NOT NULL,
    ort_version TEXT NOT NULL,
    threads INTEGER NOT NULL,
    method INTEGER NOT NULL,
    signature TEXT NOT NULL,
    op_type TEXT NOT NULL,
    description TEXT NOT NULL,
    seconds REAL,
    error TEXT,
    repeats INTEGER NOT NULL DEFAULT 0,
    spread REAL NOT NULL DEFAULT 0,
    copies INTEGER NOT NULL DEFAULT 1,
    measured_at REAL NOT NULL,
    PRIMARY KEY (hardware, provider, ort_version, threads, method, signature)
);
CREATE TABLE IF NOT EXISTS comm_fits (
    hardware TEXT NOT NULL,
    mpi_library TEXT NOT NULL,
    layout TEXT NOT NULL,
    axis INTEGER NOT NULL,
    group_size INTEGER NOT NULL,
    collective TEXT NOT NULL,
    latency REAL NOT NULL,
    bandwidth REAL NOT NULL,
    points TEXT NOT NULL,
    measured_at REAL NOT NULL,
    PRIMARY KEY (hardware, mpi_library, layout, axis, group_size, collective)
);
"""


def default_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME")
    root = Path(base) if base else Path.home() / ".cache"
    return root / "meshplan" / "profile.sqlite"


@dataclass(frozen=True)
class OpKey:
    """What an operator timing depends on besides its signature."""

    hardware: str
    provider: str
    ort_version: str
    threads: int
    method: int = 1             # timing.TIMING_METHOD: a change of method invalidates old timings


@dataclass
class CachedTime:
    seconds: float | None
    error: str | None
    repeats: int
    spread: float
    copies: int


class ProfileCache:
    """Open (creating or rebuilding as needed) the cache at ``path``."""

    def __init__(self, path: str | os.PathLike | None = None, check: bool = True):
        self.path = Path(path) if path is not None else default_cache_path()
        self.moved_aside: Path | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ProfileError(f"cannot create the cache directory {self.path.parent}: {exc.strerror or exc}") from None
        if self.path.is_dir():
            raise ProfileError(f"the cache path {self.path} is a directory", hint="give a file with --cache")
        self.conn = self._open(check)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(str(self.path), timeout=60.0)
        conn.execute("PRAGMA busy_timeout = 60000")
        return conn

    def _open(self, check: bool) -> sqlite3.Connection:
        try:
            conn = self._connect()
            usable = self._usable(conn, check)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "unable to open" in str(exc):
                raise ProfileError(f"cannot open the cache {self.path}: {exc}", hint="give another file with --cache") from None
            usable, conn = False, None
        except sqlite3.DatabaseError:
            usable, conn = False, None
        if not usable:
            if conn is not None:
                conn.close()
            self._move_aside()
            try:
                conn = self._connect()
                self._usable(conn, False)
            except sqlite3.DatabaseError as exc:
                raise ProfileError(f"cannot create the cache {self.path}: {exc}", hint="give another file with --cache") from None
        return conn

    def _usable(self, conn: sqlite3.Connection, check: bool) -> bool:
        """True when the file is (or has just become) a cache of this format."""
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise ProfileError(
                f"the cache {self.path} was written by a newer meshplan (format {version}, this one reads {SCHEMA_VERSION})",
                hint="upgrade meshplan or give another file with --cache",
            )
        if check and version == SCHEMA_VERSION:
            result = conn.execute("PRAGMA quick_check").fetchall()
            if result != [("ok",)]:
                return False
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if version == 0 and tables:
            return False        # some other SQLite file: not ours to write into
        if version == SCHEMA_VERSION and not {"op_times", "comm_fits"} <= tables:
            return False
        try:
            conn.execute("PRAGMA journal_mode = WAL")
        except sqlite3.OperationalError:
            pass                # e.g. a file system without shared memory: keep the default journal
        conn.execute("PRAGMA synchronous = NORMAL")
        with conn:
            conn.executescript(_SCHEMA)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        return True

    def _move_aside(self) -> None:
        if not self.path.exists():
            return
        target = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        try:
            os.replace(self.path, target)
            for suffix in ("-wal", "-shm", "-journal"):
                extra = self.path.with_name(self.path.name + suffix)
                if extra.exists():
                    os.replace(extra, target.with_name(target.name + suffix))
        except OSError as exc:
            raise ProfileError(f"the cache {self.path} is unreadable and cannot be moved aside: {exc.strerror or exc}",
                               hint="delete it or give another file with --cache") from None
        self.moved_aside = target

    def close(self) -> None:
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- operator timings -----------------------------------------------------------

    def get_ops(self, key: OpKey, signatures: list[str]) -> dict[str, CachedTime]:
        found = {}
        query = ("SELECT signature, seconds, error, repeats, spread, copies FROM op_times "
                 "WHERE hardware=? AND provider=? AND ort_version=? AND threads=? AND method=? AND signature IN ({})")
        for start in range(0, len(signatures), 500):
            chunk = signatures[start:start + 500]
            rows = self._query(query.format(",".join("?" * len(chunk))),
                               (key.hardware, key.provider, key.ort_version, key.threads, key.method, *chunk))
            for sig, seconds, error, repeats, spread, copies in rows:
                found[sig] = CachedTime(seconds, error, repeats, spread, copies)
        return found

    def put_op(self, key: OpKey, signature: str, op_type: str, description: str, seconds: float | None,
               error: str | None = None, repeats: int = 0, spread: float = 0.0, copies: int = 1) -> None:
        self._write(
            "INSERT OR REPLACE INTO op_times VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (key.hardware, key.provider, key.ort_version, key.threads, key.method, signature, op_type, description,
             seconds, error, repeats, spread, copies, time.time()),
        )

    def count_ops(self) -> int:
        return self._query("SELECT COUNT(*) FROM op_times", ())[0][0]

    # --- communication fits -------------------------------------------------------

    def get_comm(self, hardware: str, mpi_library: str, layout: str) -> list[dict]:
        rows = self._query(
            "SELECT axis, group_size, collective, latency, bandwidth, points FROM comm_fits "
            "WHERE hardware=? AND mpi_library=? AND layout=?", (hardware, mpi_library, layout))
        found = []
        for axis, group, collective, latency, bandwidth, extra in rows:
            extra = json.loads(extra)
            found.append({"axis": axis, "group_size": group, "collective": collective, "latency": latency,
                          "bandwidth": bandwidth, "points": extra["points"], "max_rel_error": extra["max_rel_error"]})
        return found

    def put_comm(self, hardware: str, mpi_library: str, layout: str, fits: list[dict]) -> None:
        now = time.time()
        rows = [(hardware, mpi_library, layout, f["axis"], f["group_size"], f["collective"], f["latency"],
                 f["bandwidth"], json.dumps({"points": f["points"], "max_rel_error": f.get("max_rel_error", 0.0)}), now)
                for f in fits]
        try:
            with self.conn:
                self.conn.executemany("INSERT OR REPLACE INTO comm_fits VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
        except sqlite3.DatabaseError as exc:
            raise ProfileError(f"cannot write the cache {self.path}: {exc}") from None

    # --- helpers ------------------------------------------------------------------

    def _query(self, sql: str, args: tuple):
        try:
            return self.conn.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as exc:
            raise ProfileError(f"cannot read the cache {self.path}: {exc}", hint="delete it or give another file with --cache") from None

    def _write(self, sql: str, args: tuple) -> None:
        try:
            with self.conn:
                self.conn.execute(sql, args)
        except sqlite3.DatabaseError as exc:
            raise ProfileError(f"cannot write the cache {self.path}: {exc}") from None
