"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own."""

from __future__ import annotations

import threading
import time
from collections import deque

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
# about 1.25-1.5x apart from 0.1 ms to 0.1 s: a decode step takes 0.1-1 ms on a GPU or a small model, tens of
# milliseconds for a larger one on a CPU, and the p50 is read from these
TPOT_BUCKETS = (0.0001, 0.00015, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004,
                0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1)
WINDOW_SECONDS = 10.0    # tokens/s is measured over this much of the recent past


class ServerMetrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()   # the *_created series say nothing here

        self.registry = r = CollectorRegistry()
        self.running = Gauge("meshplan_requests_running", "Requests holding a batch slot", registry=r)
        self.waiting = Gauge("meshplan_requests_waiting", "Requests queued for a batch slot", registry=r)
        self.requests = Counter("meshplan_requests", "Requests ended, by how", ["outcome"], registry=r)
        self.ttft = Histogram("meshplan_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("meshplan_time_per_output_token_seconds", "Between a request's tokens",
                              buckets=TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("meshplan_prompt_tokens", "Prompt tokens taken", registry=r)
        self.prefix_reused = Counter("meshplan_prefix_cache_reused_positions", "Prompt positions taken from the "
                                     "key/value cache (a prefix another request left or holds) instead of computed",
                                     registry=r)
        self.output_tokens = Counter("meshplan_generation_tokens", "Tokens generated", registry=r)
        self.calls = Counter("meshplan_model_calls", "Calls of the model, by kind: every busy slot's prompt "
                             "(prompts), one slot's prompt (row), one position per slot (decode)", ["kind"],
                             registry=r)
        self.rate = Gauge("meshplan_output_tokens_per_second",
                          f"Tokens generated per second over the last {WINDOW_SECONDS:.0f} s", registry=r)
        self.slots = Gauge("meshplan_batch_slots", "The plan's batch: slots requests take", registry=r)
        self.weight_bytes = Gauge("meshplan_rank_weight_bytes", "Each rank's program and weight files", ["rank"],
                                  registry=r)
        self.cache_bytes = Gauge("meshplan_rank_kv_cache_bytes", "Each rank's key/value cache", ["rank"],
                                 registry=r)
        self._recent: deque = deque()   # (time, tokens) of the window's steps
        self._in_window = 0             # their tokens
        self._lock = threading.Lock()   # (the engine adds, whoever reads the text drops)

    def tokens(self, count: int) -> None:
        """``count`` tokens generated now (once a step: the window's sum is kept as it goes)."""
        self.output_tokens.inc(count)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, count))
            self._in_window += count
        self._update(now)

    def _update(self, now: float) -> None:
        with self._lock:
            while self._recent and self._recent[0][0] < now - WINDOW_SECONDS:
                self._in_window -= self._recent.popleft()[1]
            self.rate.set(self._in_window / WINDOW_SECONDS)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        self._update(time.monotonic())
        return generate_latest(self.registry)
