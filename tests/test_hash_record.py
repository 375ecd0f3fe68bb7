"""A plan's programs are checked against their planned SHA-256 at every start, but a file
unchanged since it was hashed (same size, times and inode) is not read again."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

import meshplan.files
from meshplan.cost.cluster import make_cluster
from meshplan.errors import PlanError
from meshplan.files import HashRecord, file_sha256
from meshplan.make_plan import make_plan
from meshplan.runtime.sessions import check_program_files
from sample_models import SAMPLES


@pytest.fixture
def hashed(monkeypatch):
    """The files ``file_sha256`` reads from now on, in order."""
    read = []

    def counting(path):
        read.append(os.path.basename(path))
        return file_sha256(path)
    monkeypatch.setattr(meshplan.files, "file_sha256", counting)
    return read


def _edit_in_place(path):
    """Change one byte, keeping the size and the modification time (as ``touch -r`` would)."""
    before = os.stat(path)
    time.sleep(0.05)   # past a coarse clock's tick: the change time moves
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == before.st_mtime_ns and os.stat(path).st_size == before.st_size


def test_record_reads_a_file_once_until_it_changes(tmp_path, hashed):
    data = tmp_path / "w.bin"
    data.write_bytes(os.urandom(10_000))
    record = HashRecord(tmp_path / ".record.json")
    first = record.sha256(data)
    assert first == file_sha256(data) and hashed == ["w.bin"]
    record.save()
    again = HashRecord(tmp_path / ".record.json")
    assert again.sha256(data) == first and hashed == ["w.bin"]    # from the record
    _edit_in_place(data)
    changed = again.sha256(data)
    assert changed != first and changed == file_sha256(data) and hashed == ["w.bin", "w.bin"]
    # a file swapped for another of the same bytes' length (a new inode) is read again too
    other = tmp_path / "other.bin"
    other.write_bytes(os.urandom(10_000))
    os.replace(other, data)
    assert again.sha256(data) == file_sha256(data) and hashed.count("w.bin") == 3


def test_record_that_cannot_be_read_is_ignored(tmp_path, hashed):
    data = tmp_path / "w.bin"
    data.write_bytes(b"abc")
    (tmp_path / ".record.json").write_text("{not json")
    record = HashRecord(tmp_path / ".record.json")
    assert record.sha256(data) == file_sha256(data) and hashed == ["w.bin"]
    record.save()
    assert json.loads((tmp_path / ".record.json").read_text())["files"]["w.bin"]["sha256"] == file_sha256(data)
    # an entry of another shape is not trusted either
    (tmp_path / ".record.json").write_text(json.dumps({"files": {"w.bin": ["x"]}}))
    assert HashRecord(tmp_path / ".record.json").sha256(data) == file_sha256(data) and len(hashed) == 2


def test_plan_records_its_programs_and_a_run_checks_without_reading(tmp_path, hashed):
    sample = SAMPLES["gpt"]
    plan_dir = tmp_path / "plan"
    plan = make_plan(sample.path, make_cluster((1, 2), "cpu"), dict(sample.dims), plan_dir, external_threshold=0)
    assert all(p.data_files for p in plan.programs)
    for program in plan.programs:
        assert (plan_dir / program.hash_record).is_file()
    hashed.clear()
    for program in plan.programs:
        check_program_files(plan, plan_dir, program)
    assert hashed == []     # every file as planned: nothing read

    # a copy (new inodes) is read once, then recorded
    copy = tmp_path / "copy"
    shutil.copytree(plan_dir, copy)
    program = plan.programs[1]
    check_program_files(plan, copy, program)
    assert sorted(hashed) == sorted(name for name, _ in program.files)
    hashed.clear()
    check_program_files(plan, copy, program)
    assert hashed == []

    # a weights file edited in place, its size and modification time kept: caught
    _edit_in_place(copy / program.data_files[0]["file"])
    with pytest.raises(PlanError, match="missing or changed since planning"):
        check_program_files(plan, copy, program)
    with pytest.raises(PlanError, match="missing or changed since planning"):   # and on the next start too
        check_program_files(plan, copy, program)
    # the program file itself
    _edit_in_place(copy / plan.programs[0].file)
    with pytest.raises(PlanError, match="changed after planning"):
        check_program_files(plan, copy, plan.programs[0])
