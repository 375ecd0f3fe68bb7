"""Learning-rate schedules: the rate of step k (counted from 0) of K.

``constant``: lr. ``cosine`` with ``warmup`` W: lr·(k + 1)/W while k < W, then
lr·½·(1 + cos(π·(k − W)/(K − W))) — linear warm-up, then cosine decay to 0 at step K.
"""

from __future__ import annotations

import math

from meshplan.errors import TrainError

SCHEDULES = ("constant", "cosine")


def learning_rate(kind: str, lr: float, step: int, steps: int, warmup: int = 0) -> float:
    if kind not in SCHEDULES:
        raise TrainError(f"unknown schedule {kind!r} (known: {', '.join(SCHEDULES)})")
    if step < warmup:
        return lr * (step + 1) / warmup
    if kind == "constant":
        return lr
    span = max(1, steps - warmup)
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(step - warmup, span) / span))
