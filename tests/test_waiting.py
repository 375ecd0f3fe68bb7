"""Waiting for MPI requests: GPU ranks never sleep (sleeping stalls MPI's progress)."""

import time

import pytest

from meshplan.providers import cuda_provider
from meshplan.runtime import waiting


class _FakeRequest:
    """Completes after ``polls`` tests."""

    def __init__(self, polls: int):
        self.left = polls


class _FakeMPI:
    class Request:
        @staticmethod
        def Testall(requests):
            for r in requests:
                r.left -= 1
            return all(r.left <= 0 for r in requests)


@pytest.fixture
def restore_sleeping():
    yield
    waiting.set_sleeping(True)


@pytest.mark.parametrize("sleeping", [True, False])
def test_long_waits_sleep_only_when_allowed(monkeypatch, restore_sleeping, sleeping):
    slept = []
    monkeypatch.setattr(waiting, "YIELD_SECONDS", 0.0)
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s))
    waiting.set_sleeping(sleeping)
    waiting.wait_all([_FakeRequest(50)], _FakeMPI)
    assert bool(slept) == sleeping


def test_cuda_sessions_compute_float32_without_tf32():
    name, options = cuda_provider(3)
    assert name == "CUDAExecutionProvider"
    assert options == {"device_id": "3", "use_tf32": "0"}


def test_an_idle_rank_sleeps_from_the_start_even_where_ranks_never_sleep(monkeypatch, restore_sleeping):
    """An idle rank's wait takes no core from the ranks beside it, GPU ranks' rule or not."""
    slept, yielded = [], []
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s))
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: yielded.append(1))
    waiting.set_sleeping(False)
    waiting.wait_all([_FakeRequest(30)], _FakeMPI, idle=True)
    assert len(slept) == 29 and not yielded
    assert max(slept) == waiting.IDLE_PAUSE and slept == sorted(slept)
