"""The plan's batch as slots that requests take and give back between calls.

``SlotBatch`` (a shared key/value buffer of fixed capacity, the builder's format): every
row has its own length. A request takes a free row whenever one is free; its prompt goes
into the row's part of the buffer, and it then decodes with the others. A finished or
cancelled request frees its row at once; the next request simply writes over it. The rows'
lengths are told to the model by the attention mask alone (each row's count of ones is its
length after the call), so a call may mix rows that prefill with rows that decode.

onnxruntime's GroupQueryAttention takes a call of several new positions per row only as a
*first* prompt (every row's past empty) or at batch 1; so prompts go in whole (in pieces of
the plan's longest call) when every busy row is new or the plan's batch is 1, and one
token per call otherwise, riding along with the other rows' decode steps.

Where the stepper can call some rows of the cache (``Job.row_calls``), requests take the
lowest free slot and a call covers only the rows up to the last busy one: a lone request
on a plan of 8 slots decodes at batch 1.

``GrowingBatch`` (a cache that grows with every call, optimum and torch exports): every row
shares the call's length, so a call's new positions are masked out where a row has fewer
tokens, a request joining a running batch masks out the positions before it, and requests
join while the context has room for them (then the batch drains and starts again empty).

Where the stepper can copy rows of the cache (``Job.copy_rows``: the same conditions as row
calls), ``SlotBatch`` also reuses what the cache holds. Each row remembers the tokens
whose keys and values it holds (a freed row's stay until a call writes over them), and a
request takes the free row whose tokens begin its prompt the furthest, or has the longest
such beginning another row holds copied into its row: those positions are not computed
again (a shared system prompt, a chat's earlier turns; ``reused`` counts them). A request
of ``n`` choices takes n rows at once: its prompt is computed in the first, copied into
the others once it is in, and each choice draws its first token from the same logits.
Without copies, each choice is a request of its own.

Both return, per step, the tokens chosen for the rows whose prompt is in, and list the
kinds of the calls they made in ``made``: "prompts" (every busy row's prompt at once),
"row" (one row's), "decode" (one position per row).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from meshplan.generation.loop import GenerationShape
from meshplan.generation.sampling import Adjustment, Sampler
from meshplan.generation.scoring import Scores


@dataclass(eq=False)
class Work:
    """One request inside the engine."""

    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    emit: Callable = lambda event: None     # the engine's events for this request
    ignore_eos: bool = False                # end tokens do not end it (max_tokens does)
    cancelled: str | None = None            # set by the front: why it ended it ("cancelled": the client went away)
    arrived: float = field(default_factory=time.perf_counter)
    fed: int = 0                            # prompt tokens in the cache
    ids: list[int] = field(default_factory=list)
    started: float | None = None            # admitted into a row
    first_at: float | None = None           # its first token chosen
    last_at: float | None = None
    finished: str | None = None             # "stop", "length", "cancelled", "error"
    logprobs: int | None = None             # alternatives told per token (None: no log-probabilities)
    echo: bool = False                      # the prompt's own tokens scored too (with logprobs)
    adjust: Adjustment | None = None        # penalties, biases, min_tokens
    eos: frozenset = frozenset()            # the end ids (min_tokens masks them)
    prompt_scores: list = field(default_factory=list)   # (id, logprob, top) per prompt token from the 2nd
    score: tuple | None = None              # the last chosen token's (id, logprob, top)
    followers: list = field(default_factory=list)   # the other choices of its request (``n``), admitted with it
    held: bool = False                      # a follower waiting for its leader's prompt to be in the cache
    link: tuple | None = None               # (request, choice) on the front's side of a ``link``

    @property
    def adjusted(self) -> bool:
        """Its choice reads logits changed by penalties, biases or ``min_tokens``."""
        return self.adjust is not None and self.adjust.active

    @property
    def scores_prompt(self) -> bool:
        return self.echo and self.logprobs is not None

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)


class SlotBatch:
    def __init__(self, shape: GenerationShape, stepper, pad_id: int, rows: int, chunk: int | None = None,
                 prefix_cache: bool = True):
        self.shape, self.stepper, self.pad_id, self.rows = shape, stepper, pad_id, rows
        self.chunk = min(chunk or shape.chunk, shape.chunk)   # prompt positions per call
        self.slots: list[Work | None] = [None] * rows
        self.lengths = np.zeros(rows, dtype=np.int64)      # positions of each row in the buffer
        # the static mask of the buffer's capacity, kept in place: row r has lengths[r] + 1 ones
        # in a decode call (an idle row one, so that its write lands at position 0)
        self.mask = np.zeros((rows, shape.context), dtype=np.int64)
        self.mask[:, 0] = 1
        # prompts of requests that join running ones go in by calls of their row alone, where
        # the stepper can make them (else one token per call, riding along the decode steps)
        self.row_calls = rows > 1 and bool(getattr(stepper, "row_calls", False))
        self.made: list[str] = []      # the kinds of the calls made since the engine last looked
        self.stepper.reset()
        self.state_made = False        # a call of every row made the cache (row calls need it)
        # prefix reuse and n > 1 copy rows of the cache (and need row calls for a prompt's rest)
        self.copies = self.row_calls and bool(getattr(stepper, "copies_rows", False))
        self.cached: list[list[int]] = [[] for _ in range(rows)]   # the tokens each row's cache holds
        self.reused = 0                # prompt positions taken from the cache instead of computed
        self.prefix_cache = prefix_cache

    @property
    def busy(self) -> list[Work]:
        return [w for w in self.slots if w is not None]

    def accepts(self, work: Work | None = None) -> bool:
        free = sum(w is None for w in self.slots)
        return free >= 1 + (len(work.followers) if work is not None else 0)

    def admit(self, work: Work) -> None:
        """Into the free row that reuses the most of the cache (see the module); its
        followers into the lowest free rows, held until its prompt is in."""
        row, reuse = self._place(work)
        self.slots[row] = work
        self.lengths[row] = reuse
        self.mask[row] = 0
        self.mask[row, :reuse + 1] = 1
        self.cached[row] = self.cached[row][:reuse]
        self.reused += reuse
        work.fed, work.started = reuse, time.perf_counter()
        for follower in work.followers:
            other = self.slots.index(None)
            self.slots[other] = follower
            self.lengths[other] = 0
            self.mask[other] = 0
            self.mask[other, 0] = 1
            follower.fed, follower.started, follower.held = 0, work.started, True

    def _place(self, work: Work) -> tuple[int, int]:
        """(row, prompt positions already in it): a free row's own tokens, or another row's
        copied into the lowest free row, whichever reuses more; at least the prompt's last
        token is computed (its logits choose the first new one), and all of a prompt whose
        scores are asked (echo)."""
        free = [r for r, w in enumerate(self.slots) if w is None]
        if (not self.prefix_cache or not self.copies or not self.state_made or work.scores_prompt
                or len(work.prompt) < 2):
            return free[0], 0
        limit = len(work.prompt) - 1

        def common(row: int) -> int:
            held, n = self.cached[row], 0
            for a, b in zip(held[:limit], work.prompt[:limit]):
                if a != b:
                    break
                n += 1
            return n

        own_row = max(free, key=common)
        own = common(own_row)
        source = max(range(self.rows), key=common)
        copied = common(source)
        if own >= copied:
            return (own_row, own) if own else (free[0], 0)
        # (a longer beginning than every free row's is a busy row's: free[0] is not it)
        self.stepper.copy_rows(source, free[0], copied)
        self.cached[free[0]] = self.cached[source][:copied]
        return free[0], copied

    def release(self, work: Work) -> None:
        """Its row is free; the row's cache keeps its tokens for a later prompt to reuse."""
        row = self.slots.index(work)
        self.slots[row] = None
        self.cached[row] = self.cached[row][:int(self.lengths[row])]
        self.lengths[row] = 0
        self.mask[row] = 0
        self.mask[row, 0] = 1

    def room(self, work: Work) -> int:
        """Positions left in its row."""
        return self.shape.context - int(self.lengths[self.slots.index(work)])

    def step(self) -> list[tuple[Work, int]]:
        busy = [(r, w) for r, w in enumerate(self.slots) if w is not None and not w.held]
        fresh = all(self.lengths[r] == 0 for r, _ in busy)
        prefilling = [(r, w) for r, w in busy if w.prefilling]
        longest = max((len(w.prompt) - w.fed for _, w in prefilling), default=0)
        if prefilling and fresh:   # (also the call that makes the state, before any row call)
            return self._first_prompt(busy, min(longest, self.chunk))
        if longest > 1 and self.rows == 1:   # batch 1: the row is the whole batch
            return self._row_piece(*busy[0])
        if prefilling and self.row_calls:
            # the earliest request's next piece in a call of its row alone, then a decode step of
            # the rows whose prompts are in (the others' rows wait: their pad lands at their
            # length, where their next piece goes)
            chosen = self._row_piece(*min(prefilling, key=lambda p: p[1].started))
            decoding = [(r, w) for r, w in busy if not w.prefilling and not any(w is c[0] for c in chosen)]
            return chosen + (self._one_each(decoding) if decoding else [])
        return self._one_each(busy)

    # --- the calls ------------------------------------------------------------------------------

    def _span(self, busy) -> int:
        """How many rows a call covers: the rows up to the last busy one (requests take the
        lowest free slot), where the stepper can call some rows, else all."""
        if not self.row_calls or not self.state_made:
            return self.rows
        return max(r for r, _ in busy) + 1

    def _call(self, feeds: dict, last: int, span: int, works) -> tuple:
        found = _window(self.stepper, works, feeds, last, 0 if span < self.rows else None)
        self.state_made = True
        called = {id(w) for w in works}
        for row in range(span):   # a row the call does not use gets a pad written from position 0
            if self.slots[row] is None or id(self.slots[row]) not in called:
                self.cached[row] = []
        return found

    def _chosen(self, row: int, work: Work, logits, scored: tuple | None = None) -> list[tuple[Work, int]]:
        """Its next token from ``logits`` (``scored``: (``Scores``, its row) of them, made for
        the call's rows together); once its prompt is in, its followers' too, after its row's
        cache is copied into theirs."""
        chosen = [(work, self._choose(work, logits, scored))]
        for follower in work.followers:
            if not follower.held or follower.cancelled:
                continue
            other = self.slots.index(follower)
            self.stepper.copy_rows(row, other, int(self.lengths[row]))
            self.lengths[other] = self.lengths[row]
            self.mask[other] = self.mask[row]
            self.cached[other] = list(self.cached[row])
            follower.fed, follower.held = len(follower.prompt), False
            follower.prompt_scores = list(work.prompt_scores)
            chosen.append((follower, self._choose(follower, logits, scored)))
        return chosen

    def _first_prompt(self, busy, width: int) -> list[tuple[Work, int]]:
        """Every busy row new: up to ``width`` prompt tokens each, padded on the right; the
        mask is as wide as the call (onnxruntime's first prompt: every row's past empty)."""
        span = self._span(busy)
        ids = np.full((span, width), self.pad_id, dtype=np.int64)
        mask = np.zeros((span, width), dtype=np.int64)
        counts = np.ones(span, dtype=np.int64)
        mask[:, 0] = 1
        for row, work in busy:
            part = work.prompt[work.fed:work.fed + width]
            ids[row, :len(part)], mask[row, :len(part)] = part, 1
            counts[row] = len(part)
        last = width if any(w.scores_prompt for _, w in busy) else width - int(counts.min()) + 1
        self.made.append("prompts")
        window, top = self._call(self._feeds(ids, mask, np.zeros(span, dtype=np.int64)), last, span,
                                 [w for _, w in busy])
        chosen = []
        for row, work in busy:
            n = int(counts[row])
            if work.scores_prompt:
                _score_prompt(work, window[row, :n])
            self.cached[row] = list(work.prompt[work.fed:work.fed + n])
            work.fed += n
            self.lengths[row] = n
            self.mask[row] = 0
            self.mask[row, :n + 1] = 1
            if not work.prefilling:
                at = n - 1 - (width - last)
                chosen += self._chosen(row, work, window[row, at], _top_of(top, row * last + at))
        return chosen

    def _row_piece(self, row: int, work: Work) -> list[tuple[Work, int]]:
        """The next prompt tokens of one row, in a call of that row alone (batch 1: onnxruntime
        takes several positions after a past there), up to ``chunk`` of them."""
        start = int(self.lengths[row])
        width = min(len(work.prompt) - work.fed, self.chunk, self.shape.context - start)
        ids = np.array([work.prompt[work.fed:work.fed + width]], dtype=np.int64)
        self.made.append("row")
        feeds = self._feeds(ids, np.ones((1, start + width), dtype=np.int64), np.array([start], dtype=np.int64))
        last = width if work.scores_prompt else 1
        window, top = _window(self.stepper, [work], feeds, last, row) if self.rows > 1 \
            else self._call(feeds, last, self.rows, [work])
        if work.scores_prompt:
            _score_prompt(work, window[0, -width:])
        self.cached[row] = self.cached[row][:start] + list(work.prompt[work.fed:work.fed + width])
        work.fed += width
        self.lengths[row] += width
        self.mask[row, :min(int(self.lengths[row]) + 1, self.shape.context)] = 1
        return self._chosen(row, work, window[0, -1], _top_of(top, last - 1)) if not work.prefilling else []

    def _one_each(self, busy) -> list[tuple[Work, int]]:
        """One new position per row: a prompt token or the last chosen one (idle rows a pad
        at position 0)."""
        span = self._span(busy)
        ids = np.full((span, 1), self.pad_id, dtype=np.int64)
        for row, work in busy:
            ids[row, 0] = work.prompt[work.fed] if work.prefilling else work.ids[-1]
        self.made.append("decode")
        window, top = self._call(self._feeds(ids, self.mask[:span], self.lengths[:span].copy()), 1, span,
                                 [w for _, w in busy])
        scored = _scored(window[:, 0], [(row, work) for row, work in busy if not work.prefilling]) if top is None \
            else {row: (top, row) for row, _ in busy}
        chosen = []
        for row, work in busy:
            self.cached[row] = self.cached[row][:int(self.lengths[row])] + [int(ids[row, 0])]
            if work.prefilling:
                if work.scores_prompt:
                    _score_prompt(work, window[row, :1])
                work.fed += 1
            self.lengths[row] += 1
            if self.lengths[row] < self.shape.context:
                self.mask[row, self.lengths[row]] = 1
            if not work.prefilling:
                chosen += self._chosen(row, work, window[row, 0], scored.get(row))
        return chosen

    def _feeds(self, ids: np.ndarray, mask: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
        shape = self.shape
        feeds = {shape.input_ids: ids}
        if shape.attention_mask:
            feeds[shape.attention_mask] = mask
        if shape.position_ids:
            feeds[shape.position_ids] = starts[:, None] + np.arange(ids.shape[1], dtype=np.int64)[None, :]
        return feeds

    @staticmethod
    def _choose(work: Work, logits: np.ndarray, scored: tuple | None = None) -> int:
        """The next id from a position's logits (adjusted as the request asks), or the id itself
        where the stepper chose it; with ``logprobs``, its score in ``work.score`` (from
        ``scored``, (``Scores`` or ``TopScores``, row), where the call's rows were scored
        together: by the stepper, next to the logits, where it chose the id)."""
        if np.ndim(logits) == 0:
            if work.logprobs is not None:
                if scored is None:
                    raise RuntimeError("a request asks for logprobs but its call brought ids alone")
                work.score = scored[0].of(scored[1], int(logits), work.logprobs)
            return int(logits)
        values = logits
        if work.adjusted:
            values = work.adjust(logits, work.prompt, work.ids, work.eos)
        token = int(work.sampler(values[None, :])[0])
        if work.logprobs is not None:
            scores, row = scored if scored is not None else (Scores(logits[None, :], work.logprobs), 0)
            work.score = scores.of(row, token, work.logprobs)
        return token


def _scored(logits: np.ndarray, rows: list[tuple[int, Work]]) -> dict[int, tuple]:
    """The rows of a call whose requests (or their followers) ask for log-probabilities, scored
    in one call: row → (``Scores``, its index there)."""
    asking = [(row, max(w.logprobs for w in (work, *work.followers) if w.logprobs is not None))
              for row, work in rows if np.ndim(logits) == 2
              and any(w.logprobs is not None for w in (work, *work.followers))]
    if not asking:
        return {}
    scores = Scores(logits[[row for row, _ in asking]], max(count for _, count in asking))
    return {row: (scores, index) for index, (row, _) in enumerate(asking)}


def _score_prompt(work: Work, rows: np.ndarray) -> None:
    """The scores of the prompt tokens that ``rows`` (the logits at the positions from
    ``work.fed`` on) predict: the logits at position p give the log-probability of token p + 1."""
    if np.ndim(rows) < 2:
        raise RuntimeError("the plan's call gave no logits to score the prompt with")
    count = min(len(rows), len(work.prompt) - 1 - work.fed)
    if count <= 0:
        return
    scores = Scores(rows[:count], work.logprobs)
    for offset in range(count):
        work.prompt_scores.append(scores.of(offset, work.prompt[work.fed + offset + 1], work.logprobs))


def _window(stepper, works, feeds: dict, last: int, row: int | None) -> tuple:
    """A call's window of its last positions and their top log-probabilities (or None).

    Where the stepper chooses next to the logits (``JobStepper.choose``: a GPU's job of one
    rank) and every request whose token the call gives is greedy and unadjusted, the window
    is the greedy ids; and where some of them ask for ``logprobs`` (none scoring its
    prompt), the stepper also scores the positions where the logits are
    (``JobStepper.score``). Otherwise the window is the logits, and the host chooses and
    scores."""
    kw = {} if row is None else {"row": row}
    if getattr(stepper, "chooses", False) and all(w.sampler.greedy and not w.adjusted for w in works):
        if all(w.logprobs is None for w in works):
            return stepper.choose(feeds, last, **kw), None
        if getattr(stepper, "scores", False) and not any(w.scores_prompt and w.prefilling for w in works):
            return stepper.score(feeds, last, **kw)
    return stepper.step(feeds, last, **kw), None


def _top_of(top, index: int) -> tuple | None:
    """(``TopScores``, ``index``) where the call's positions were scored by the stepper."""
    return None if top is None else (top, index)


class GrowingBatch:
    """A growing cache (every row's cache has the call's length): requests join running ones
    too. Each call appends its width of positions to every row; a row's real tokens take the
    last columns of the call with mask ones, the columns before them pads with mask zeros
    (an idle row feeds one pad it attends to, so that no row attends to nothing). A request
    that takes a freed row masks out every position before it (its predecessor's), and its
    position ids count only its own ones. The cache grows for every row with every call:
    a request is admitted while its prompt and tokens fit in what is left of the context;
    once the first waiting one does not, no other joins until the batch is empty, and the
    next starts from an empty cache."""

    def __init__(self, shape: GenerationShape, stepper, pad_id: int, rows: int, chunk: int | None = None):
        self.shape, self.stepper, self.pad_id, self.rows = shape, stepper, pad_id, rows
        self.chunk = min(chunk or shape.chunk, shape.chunk)   # prompt positions per call
        self.slots: list[Work | None] = [None] * rows
        self.made: list[str] = []
        self.mask = np.zeros((rows, 0), dtype=np.int64)
        self.draining = False
        self.stepper.reset()

    @property
    def total(self) -> int:
        return self.mask.shape[1]

    @property
    def busy(self) -> list[Work]:
        return [w for w in self.slots if w is not None]

    def accepts(self, work: Work | None = None) -> bool:
        if self.draining or None not in self.slots:
            return False
        if work is not None and self.total + len(work.prompt) + work.max_tokens > self.shape.context:
            self.draining = bool(self.busy)    # it waits for an empty cache
            return not self.draining and len(work.prompt) + work.max_tokens <= self.shape.context
        return True

    def admit(self, work: Work) -> None:
        row = self.slots.index(None)
        self.slots[row] = work
        self.mask[row] = 0                 # its predecessor's positions
        work.fed, work.started = 0, time.perf_counter()

    def release(self, work: Work) -> None:
        self.slots[self.slots.index(work)] = None
        if not self.busy:                  # an empty batch starts again from an empty cache
            self.mask = np.zeros((self.rows, 0), dtype=np.int64)
            self.draining = False
            self.stepper.reset()

    def room(self, work: Work) -> int:
        return self.shape.context - self.total

    def step(self) -> list[tuple[Work, int]]:
        busy = [(r, w) for r, w in enumerate(self.slots) if w is not None]
        pending = [len(w.prompt) - w.fed for _, w in busy if w.prefilling]
        width = min(max(pending), self.chunk) if pending else 1
        left = self.shape.context - self.total
        for _, work in busy:   # no row's pads may eat the positions its own tokens need
            ahead = len(work.prompt) - work.fed
            slack = left - ahead - (work.max_tokens - len(work.ids))
            if not work.prefilling:
                width = min(width, slack + 1)
            elif ahead < width:
                width = min(width, slack + ahead)
        ids = np.full((self.rows, width), self.pad_id, dtype=np.int64)
        new = np.zeros((self.rows, width), dtype=np.int64)
        new[:, -1] = 1                     # idle rows: one pad they attend to
        counts = {}
        for row, work in busy:
            part = work.prompt[work.fed:work.fed + width] if work.prefilling else work.ids[-1:]
            ids[row, width - len(part):] = part
            new[row, width - len(part):] = 1
            counts[row] = len(part)
        self.mask = np.concatenate([self.mask, new], axis=1)
        self.made.append("prompts" if pending else "decode")
        feeds = {self.shape.input_ids: ids}
        if self.shape.attention_mask:
            feeds[self.shape.attention_mask] = self.mask
        if self.shape.position_ids:
            positions = np.maximum(np.cumsum(self.mask, axis=1) - 1, 0)[:, -width:]
            feeds[self.shape.position_ids] = np.ascontiguousarray(positions)
        last = width if any(w.scores_prompt and w.prefilling for _, w in busy) else 1
        window, top = _window(self.stepper, [w for _, w in busy], feeds, last, None)
        chosen = []
        for row, work in busy:
            if work.prefilling:
                if work.scores_prompt:
                    _score_prompt(work, window[row, last - counts[row]:])
                work.fed += counts[row]
                if work.prefilling:
                    continue
            chosen.append((work, SlotBatch._choose(work, window[row, -1], _top_of(top, row * last + last - 1))))
        return chosen


def batch_for(shape: GenerationShape, stepper, pad_id: int, chunk: int | None = None, prefix_cache: bool = True):
    """The batching the plan's cache allows, over the plan's largest batch; prompts in pieces
    of up to ``chunk`` positions (at most the plan's longest call, its default); a shared
    buffer's slots reuse cached prefixes unless ``prefix_cache`` is False."""
    if shape.shared:
        return SlotBatch(shape, stepper, pad_id, shape.batch[1], chunk, prefix_cache)
    return GrowingBatch(shape, stepper, pad_id, shape.batch[1], chunk)
