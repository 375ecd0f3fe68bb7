"""Choosing the next token from the last position's logits: greedy by default, or sampled
with a temperature, top-k and top-p (nucleus) from a seeded generator."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from meshplan.errors import RunError


@dataclass
class Sampler:
    """``temperature`` 0 (the default) is greedy: the highest logit, the first on a tie.
    Otherwise the logits are divided by the temperature, cut to the ``top_k`` highest (0:
    all) and to the smallest set whose probabilities reach ``top_p`` (1: all), and one
    token is drawn per sequence from what remains. Every setting is checked here (finite,
    in range: NaN passes no comparison), so that a draw never fails on what it was given;
    logits that hold NaN or an infinity are a ``RunError`` at the draw."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not _real(self.temperature) or not self.temperature >= 0:
            raise RunError(f"--temperature must be a finite number, 0 (greedy) or more, got {self.temperature}")
        if not _integer(self.top_k) or self.top_k < 0:
            raise RunError(f"--top-k must be an integer, 0 (all) or more, got {self.top_k}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise RunError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (not _integer(self.seed) or not 0 <= self.seed <= LARGEST_SEED):
            raise RunError(f"--seed must be an integer from 0 to {LARGEST_SEED}, got {self.seed}")
        self._rng = None     # made at the first draw: a greedy request never needs one (10 µs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        """One token id per row of ``logits`` [batch, vocab]."""
        logits = np.asarray(logits)
        if self.greedy:   # widening keeps the order: take the maximum where it lies
            if logits.dtype == np.float32 or logits.dtype == np.float64:
                return logits.argmax(axis=-1).astype(np.int64)
            if logits.dtype == np.float16:
                return _float16_argmax(logits)
            wide = np.float32 if logits.dtype.name == "bfloat16" else np.float64
            return logits.astype(wide).argmax(axis=-1).astype(np.int64)
        if self._rng is None:
            self._rng = np.random.default_rng(self.seed)
        logits = logits.astype(np.float64)
        chosen = np.empty(len(logits), dtype=np.int64)
        for row, values in enumerate(logits):
            order = np.argsort(-values, kind="stable")
            if self.top_k:
                order = order[:self.top_k]
            kept = values[order]
            # less the highest before dividing: a tiny temperature then gives 0 and -inf, never
            # inf - inf (a temperature of 1e-320 made every probability NaN)
            with np.errstate(over="ignore"):
                probs = np.exp((kept - kept[0]) / self.temperature)
            if not np.isfinite(probs).all():
                raise RunError("the model's logits hold NaN or an infinity: no token can be sampled from them")
            probs /= probs.sum()
            if self.top_p < 1:
                reach = np.cumsum(probs)
                count = int(np.searchsorted(reach, self.top_p) + 1)
                order, probs = order[:count], probs[:count] / probs[:count].sum()
            chosen[row] = order[self._rng.choice(len(order), p=probs)]
        return chosen


LARGEST_SEED = 2**64 - 1     # numpy's generators take seeds from 0 up; OpenAI's are 64-bit


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _float16_argmax(logits: np.ndarray) -> np.ndarray:
    """``argmax`` over the last axis of float16 logits, as numpy's over the same values, from
    their bits: numpy's float16 comparisons are emulated (209 µs for a 32000-token
    vocabulary; widening to float32 first 39–47 µs; this 5 µs). A float16's bits read as an
    int16 order like the values once the negative ones are mirrored (and -0 put on +0);
    logits holding a NaN take numpy's own float path (it answers the first NaN)."""
    bits = np.ascontiguousarray(logits).view(np.int16)
    if ((bits & 0x7FFF) > 0x7C00).any():
        return logits.astype(np.float32).argmax(axis=-1).astype(np.int64)
    sign = bits >> 15                                  # -1 where negative, else 0
    keys = (bits ^ (sign & 0x7FFF)) - sign             # negatives mirrored below zero, -0 on +0
    return keys.argmax(axis=-1).astype(np.int64)


@dataclass
class Adjustment:
    """What a request changes in the logits before its draw (the log-probabilities it is told
    are of the model's logits as they are): OpenAI's ``presence_penalty`` and
    ``frequency_penalty`` (less ``presence`` for each id generated so far, less ``frequency``
    times its count), vLLM's ``repetition_penalty`` (a logit of an id in the prompt or
    generated divided by it where positive, multiplied where negative), ``logit_bias`` (added
    per id) and ``min_tokens`` (the end ids at -inf until that many were generated)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.bias or self.min_tokens)

    def __call__(self, logits: np.ndarray, prompt: list[int], generated: list[int], eos) -> np.ndarray:
        values = np.asarray(logits).astype(np.float64)   # (a copy: the model's logits stay as they are)
        if self.repetition != 1.0:
            seen = np.unique(np.asarray(prompt + generated, dtype=np.int64))
            seen = seen[seen < len(values)]
            picked = values[seen]
            values[seen] = np.where(picked > 0, picked / self.repetition, picked * self.repetition)
        if (self.presence or self.frequency) and generated:
            ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
            keep = ids < len(values)
            values[ids[keep]] -= self.frequency * counts[keep] + self.presence
        for token, value in self.bias.items():
            if token < len(values):   # (where the plan does not say its vocabulary, ids past the logits' are none)
                values[token] += value
        if len(generated) < self.min_tokens:
            for token in eos:
                if 0 <= token < len(values):
                    values[token] = -np.inf
        return values
