"""The generation loop: prompts in, tokens out, one call of a *stepper* per step.

A stepper runs the model once on a call's inputs and keeps the key/value cache between
calls (``Stepper``): the resident job across ranks (``generation.driver.JobStepper``),
onnxruntime on the original model in one process (``SessionStepper``, the reference of
``meshplan verify --generate``) or every program of a plan in one process
(``InProcessStepper``). The loop is the same for all of them, so their tokens can be
compared one for one:

1. *prefill*: the prompts, padded to one length (on the right for a shared buffer, on
   the left for a growing cache: ``LlmLayout.padding_side``), in pieces of at most the
   plan's longest call (``GenerationShape.chunk``); only the last positions' logits are
   asked for;
2. *decode*: one new position per sequence and call, the chosen ids fed back, until every
   sequence has met an end token or ``max_new_tokens``, or the context is full.

The attention mask, position ids and cache follow the layout's rules; a sequence that
has ended goes on being fed its end token, and what it produces is dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from meshplan.errors import RunError
from meshplan.model.sizes import Sizes
from meshplan.plan_format import Plan
from meshplan.runtime.state_layout import cache_position_axis, copy_cache_rows


class Stepper(Protocol):
    def reset(self) -> None: ...

    def step(self, feeds: dict[str, np.ndarray], last: int) -> np.ndarray:
        """Run one call; return the logits of its ``last`` positions ([batch, last, vocab])."""

    # A stepper that can choose greedily where it computes the logits also has ``chooses``
    # (True) and ``choose(feeds, last)``: the greedy ids of its ``last`` positions ([batch, last]).


@dataclass
class GenerationShape:
    """What a plan accepts, read from it: the layout of its inputs, its batch (a size or a
    range), the longest call (prefill pieces) and the longest context (cache capacity)."""

    input_ids: str
    attention_mask: str | None
    position_ids: str | None
    state: dict[str, str]         # output → input
    shared: bool                  # past and present are one buffer of fixed capacity
    batch: tuple[int, int]        # lo, hi
    chunk: int
    context: int
    vocab: int | None
    cache_shapes: dict[str, list]   # state input → its shape spec
    cache_dtypes: dict[str, str]    # state input → its element type

    @property
    def padding_side(self) -> str:
        return "right" if self.shared else "left"

    @classmethod
    def of_plan(cls, plan: Plan) -> "GenerationShape":
        if not plan.state:
            raise RunError("the plan has no key/value cache (no state): generation needs a model with one",
                           hint="plan a model whose present.N.* outputs are its past inputs")
        sizes = Sizes.from_dict(plan.sizes) if plan.sizes else None
        inputs = {t.name: t for t in plan.inputs}
        outputs = {t.name: t for t in plan.outputs}
        state_inputs = {s["input"] for s in plan.state}
        ids = next((n for n in ("input_ids", "input_ids_0") if n in inputs), None)
        if ids is None:
            raise RunError(f"the plan's model has no input_ids (inputs: {', '.join(inputs)}): generation needs token ids")
        extra = [n for n in inputs if n not in state_inputs | {ids, "attention_mask", "position_ids"}]
        if extra:
            raise RunError(f"generation does not know what to feed input '{extra[0]}' "
                           "(it feeds input_ids, attention_mask, position_ids and the cache)")
        if "logits" not in outputs:
            raise RunError("the plan's model has no logits output: generation needs one")

        def extent(dim) -> tuple[int, int]:
            if isinstance(dim, int) and dim >= 0:
                return dim, dim
            if sizes is not None and isinstance(dim, str) and dim in sizes.ranges:
                r = sizes.ranges[dim]
                return r.lo, r.hi
            if sizes is not None and isinstance(dim, str) and dim in sizes.fixed:
                return sizes.fixed[dim], sizes.fixed[dim]
            raise RunError(f"the plan does not say how large {dim!r} may be")

        id_shape = inputs[ids].shape
        batch = extent(id_shape[0])
        chunk = extent(id_shape[1])[1] if len(id_shape) > 1 else 1
        entry = plan.state[0]
        past = inputs[entry["input"]].shape
        present = outputs[entry["output"]].shape
        axis = cache_position_axis(len(past))
        # a buffer of fixed capacity that present shares: past's length is a size, and present's
        # the same (a plan sized for generation) or left to the call (the total length)
        fixed = isinstance(past[axis], int) and past[axis] > 0
        shared = fixed and (present[axis] == past[axis] or not isinstance(present[axis], int))
        if shared:
            context = past[axis]
        else:
            context = extent(past[axis])[1] + 1
        logits = outputs["logits"].shape
        vocab = logits[-1] if isinstance(logits[-1], int) and logits[-1] > 0 else None
        return cls(ids, "attention_mask" if "attention_mask" in inputs else None,
                   "position_ids" if "position_ids" in inputs else None,
                   {s["output"]: s["input"] for s in plan.state}, shared, batch, max(1, chunk), context, vocab,
                   {s["input"]: list(inputs[s["input"]].shape) for s in plan.state},
                   {s["input"]: inputs[s["input"]].dtype for s in plan.state})


@dataclass
class Sequence:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    done: bool = False
    text: str | None = None


@dataclass
class Metrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    first_tokens: int = 0                 # the tokens chosen from the prefill
    prefill_seconds: float = 0.0          # time to the first token (TTFT)
    decode_seconds: list[float] = field(default_factory=list)   # per decode step (all but on_tokens)

    def to_dict(self) -> dict:
        decode = sum(self.decode_seconds)
        steps = len(self.decode_seconds)
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_seconds": self.prefill_seconds,
            "time_per_output_token_seconds": decode / steps if steps else None,
            "prefill_tokens_per_second": self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else None,
            "decode_tokens_per_second": (self.generated_tokens - self.first_tokens) / decode if decode else None,
            "decode_steps": steps,
        }


@dataclass
class StepRecord:
    """What one call fed and what it gave: its input ids, the last logits of each sequence
    (the ones the next token is chosen from), the ids chosen."""

    input_ids: np.ndarray
    logits: np.ndarray
    chosen: np.ndarray
    positions: np.ndarray     # per sequence: the position in the call's returned window its logits are at


class Generation:
    """One batch of prompts through a stepper (``run``). ``record`` keeps every step's
    logits and choices (``verify --generate`` compares them)."""

    def __init__(self, shape: GenerationShape, stepper: Stepper, pad_id: int = 0):
        self.shape, self.stepper, self.pad_id = shape, stepper, pad_id

    def check(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """Refuse, in one line, what the plan cannot generate."""
        shape = self.shape
        if not prompts:
            raise RunError("no prompt given")
        if max_new_tokens < 1:
            raise RunError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
        if len(prompts) > shape.batch[1]:
            raise RunError(f"{len(prompts)} prompts, but the plan takes at most {shape.batch[1]} sequences at once",
                           hint="plan with a larger --batch")
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise RunError(f"prompt {index} has no tokens")
            if len(prompt) >= shape.context:
                raise RunError(f"prompt {index} has {len(prompt)} tokens: the context holds {shape.context} "
                               "(the prompt and at least one new token)", hint="plan with a larger --max-length")
            if shape.vocab is not None:
                ids = np.asarray(prompt)
                outside = np.flatnonzero((ids < 0) | (ids >= shape.vocab))
                if outside.size:
                    raise RunError(f"prompt {index} has token id {int(ids[outside[0]])}, outside the vocabulary "
                                   f"(0 to {shape.vocab - 1})")
        lengths = {len(p) for p in prompts}
        if shape.shared and len(lengths) > 1 and max(lengths) > shape.chunk:
            raise RunError(f"prompts of different lengths up to {max(lengths)} tokens need one prefill call of that "
                           f"length; the plan's calls take at most {shape.chunk} positions",
                           hint="plan with a larger --prefill-chunk, or give prompts one at a time")

    def run(self, prompts: list[list[int]], max_new_tokens: int, sampler: Callable[[np.ndarray], np.ndarray],
            eos_ids=(), on_tokens: Callable[[int, np.ndarray, list[Sequence]], None] | None = None,
            record: list[StepRecord] | None = None) -> tuple[list[Sequence], Metrics]:
        self.check(prompts, max_new_tokens)
        shape = self.shape
        rows = len(prompts)
        batch = max(rows, shape.batch[0])
        prompts = [list(map(int, p)) for p in prompts]
        filled = prompts + [prompts[0]] * (batch - rows)       # a fixed batch: copies, dropped at the end
        lengths = np.array([len(p) for p in filled])
        longest = int(lengths.max())
        ids = np.full((batch, longest), self.pad_id, dtype=np.int64)
        mask = np.zeros((batch, longest), dtype=np.int64)
        for row, prompt in enumerate(filled):
            if shape.padding_side == "left":
                ids[row, longest - len(prompt):], mask[row, longest - len(prompt):] = prompt, 1
            else:
                ids[row, :len(prompt)], mask[row, :len(prompt)] = prompt, 1
        sequences = [Sequence(p) for p in prompts]
        metrics = Metrics(prompt_tokens=int(sum(len(p) for p in prompts)))
        eos = set(int(e) for e in eos_ids)
        # the greedy ids from the stepper where it chooses next to the logits (a GPU's job): the
        # host reads ids, not logits
        chooses = sampler.greedy and record is None and getattr(self.stepper, "chooses", False)
        choose = self.stepper.choose if chooses else None
        call = choose or self.stepper.step
        self.stepper.reset()
        started = time.perf_counter()
        # prefill, in pieces of at most the plan's longest call
        logits = None
        for start in range(0, longest, shape.chunk):
            stop = min(start + shape.chunk, longest)
            last = 1
            if shape.padding_side == "right" and stop == longest:
                last = longest - int(lengths.min()) + 1     # every sequence's last prompt position is in there
            piece = ids[:, start:stop]
            window = call(self._feeds(piece, mask[:, :stop], start), last)
            if stop == longest:
                offsets = (lengths - 1 - (longest - last)) if shape.padding_side == "right" else np.full(batch, last - 1)
                logits = window[np.arange(batch), offsets]   # (the ids, where the stepper chooses)
        chosen = logits if choose else sampler(logits)
        metrics.prefill_seconds = time.perf_counter() - started
        if record is not None:
            record.append(StepRecord(ids.copy(), logits[:rows].copy(), chosen[:rows].copy(), offsets[:rows].copy()))
        self._take(sequences, chosen, eos, metrics)
        metrics.first_tokens = sum(1 for s in sequences if s.ids)
        if on_tokens is not None:
            on_tokens(0, chosen[:rows], sequences)
        total = longest
        # a shared buffer decodes with a static mask of its capacity, updated in place (as
        # onnxruntime-genai's graph mode keeps it): every decode call then has one shape
        static = shape.shared and not shape.position_ids
        if static:
            mask = (np.arange(shape.context)[None, :] < lengths[:, None]).astype(np.int64)
        rows_ = range(batch)
        ends = lengths.tolist()   # (a static mask's) each row's next position
        live = sum(1 for s in sequences if not s.done)
        for step in range(1, max_new_tokens):
            began = time.perf_counter()     # a step: its feeds, the call, the choice, the ids kept
            if not live or total + 1 > shape.context:
                break
            fed = chosen.reshape(batch, 1) if chosen.dtype == np.int64 else chosen.astype(np.int64).reshape(batch, 1)
            if live < rows:   # a row that has ended feeds its last id again
                fed = fed.copy()
                for row, sequence in enumerate(sequences):
                    if sequence.done:
                        fed[row, 0] = sequence.ids[-1]
            if shape.padding_side == "left":
                mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
            elif static:      # (an element at a time: numpy's fancy indexing costs more for a few rows)
                for row in rows_:
                    mask[row, ends[row]] = 1
                    ends[row] += 1
            else:
                lengths = lengths + 1
                mask = (np.arange(int(lengths.max()))[None, :] < lengths[:, None]).astype(np.int64)
            total += 1
            window = call(self._feeds(fed, mask, total - 1), 1)
            logits = window[:, -1]
            chosen = logits if choose else sampler(logits)
            if record is not None:
                record.append(StepRecord(fed[:rows].copy(), logits[:rows].copy(), chosen[:rows].copy(),
                                         np.zeros(rows, dtype=np.int64)))
            live -= self._take(sequences, chosen, eos, metrics)
            metrics.decode_seconds.append(time.perf_counter() - began)
            if on_tokens is not None:
                on_tokens(step, chosen[:rows], sequences)
        return sequences, metrics

    @staticmethod
    def _take(sequences: list[Sequence], chosen: np.ndarray, eos: set, metrics: Metrics) -> int:
        """Each live sequence's chosen id appended; returns how many ended (an id of ``eos``)."""
        ended = 0
        for sequence, token in zip(sequences, chosen.tolist()):
            if sequence.done:
                continue
            sequence.ids.append(token)
            metrics.generated_tokens += 1
            if token in eos:
                sequence.done = True
                ended += 1
        return ended

    def _feeds(self, ids: np.ndarray, mask: np.ndarray, start: int) -> dict[str, np.ndarray]:
        return call_feeds(self.shape, ids, mask)


def call_feeds(shape: GenerationShape, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """A call's inputs: ``ids`` [batch, new positions], the mask of every position so far;
    position ids count the real tokens before each new one."""
    feeds = {shape.input_ids: np.ascontiguousarray(ids)}
    if shape.attention_mask:
        feeds[shape.attention_mask] = np.ascontiguousarray(mask)
    if shape.position_ids:
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -ids.shape[1]:]
        feeds[shape.position_ids] = np.ascontiguousarray(positions.astype(np.int64))
    return feeds


class SessionStepper:
    """A model run whole by ``run(feeds) -> outputs``, its cache carried by hand: the
    reference (onnxruntime on the original model) or a plan in one process."""

    def __init__(self, shape: GenerationShape, run: Callable[[dict], dict]):
        self.shape, self._run = shape, run
        self.cache: dict[str, np.ndarray] | None = None

    def reset(self) -> None:
        self.cache = None

    row_calls = True
    copies_rows = True

    def copy_rows(self, source: int, target: int, positions: int) -> None:
        """The first ``positions`` positions of cache row ``source`` into row ``target``
        (``Job.copy_rows``)."""
        for array in self.cache.values():
            copy_cache_rows(array, source, target, positions)

    def step(self, feeds: dict[str, np.ndarray], last: int, row: int | None = None) -> np.ndarray:
        """``row``: a call of the feeds' batch of sequences on the rows of the cache from
        ``row`` on (written back into them)."""
        if row is not None:
            window = slice(row, row + len(feeds[self.shape.input_ids]))
            outputs = self._run({**feeds, **{name: value[window] for name, value in self.cache.items()}})
            for output, name in self.shape.state.items():
                self.cache[name][window] = outputs[output]
            return np.asarray(outputs["logits"])[:, -last:]
        if self.cache is None:
            self.cache = self.empty_cache(len(feeds[self.shape.input_ids]))
        outputs = self._run({**feeds, **self.cache})
        self.cache = {self.shape.state[o]: np.array(outputs[o], order="C") for o in self.shape.state}
        return np.asarray(outputs["logits"])[:, -last:]

    def empty_cache(self, batch: int) -> dict[str, np.ndarray]:
        """Zeros: a buffer at its capacity (shared), or no positions yet (growing)."""
        found = {}
        for name, spec in self.shape.cache_shapes.items():
            dims = [batch if axis == 0 else d if isinstance(d, int) and d >= 0 else 0 for axis, d in enumerate(spec)]
            found[name] = np.zeros(dims, dtype=self.shape.cache_dtypes[name])
        return found
