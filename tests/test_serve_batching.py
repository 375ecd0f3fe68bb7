"""Continuous batching (``serving.batching``) gives every request the ids it gets alone.

In one process, with onnxruntime on the original model as the stepper: requests admitted
into the slots of a shared key/value buffer at different steps (so that calls mix rows
that prefill with rows that decode, and rows that were freed and taken again), prompts
longer than the plan's longest call, the prompts of requests joining running ones in calls
of their row alone (or one token per call), batch 1 (prompts in pieces), and requests joining running batches of a growing cache. Each request's greedy ids must equal the ids of the generation
loop run on that prompt alone.
"""

from __future__ import annotations

import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.generation.loop import Generation, GenerationShape, SessionStepper
from meshplan.generation.sampling import Sampler
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import generation_plan_dims, make_plan
from meshplan.runtime.sessions import StageSession, providers_for
from meshplan.serving.batching import GrowingBatch, SlotBatch, Work, batch_for
from sample_models import SAMPLE_DIR

CONTEXT, CHUNK = 48, 8


def model_path(name: str):
    return SAMPLE_DIR / "genai" / name / "model.onnx" if "_" in name and "optimum" not in name \
        and "dynamo" not in name else SAMPLE_DIR / f"{name}.onnx"


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """name, batch → (shape, a stepper on the original model)."""
    found = {}

    def get(name: str, batch: int):
        if (name, batch) not in found:
            dims, _ = generation_plan_dims(model_path(name), batch, CONTEXT, CHUNK)
            out = tmp_path_factory.mktemp(f"{name}_{batch}")
            plan = make_plan(model_path(name), make_cluster((1, 1), "cpu"), dims, out, PlanOptions())
            shape = GenerationShape.of_plan(plan)
            session = StageSession(plan.model["path"], providers_for("cpu"), optimization="basic")
            found[name, batch] = (shape, session)
        shape, session = found[name, batch]
        return shape, SessionStepper(shape, session.run)
    return get


def alone(shape, stepper, prompt, count) -> list[int]:
    sequences, _ = Generation(shape, stepper).run([prompt], count, Sampler())
    return sequences[0].ids


def drive(batch, arrivals: dict[int, list[tuple[list[int], int]]]) -> tuple[list[list[int]], int]:
    """Admit each (prompt, tokens) at its step (or as soon as a slot is free after it), step
    until all are done; the ids in order of arrival and the number of calls."""
    queue, works, calls = [], [], 0
    step = 0
    while True:
        for prompt, count in arrivals.get(step, []):
            work = Work(prompt, count, Sampler())
            queue.append(work)
            works.append(work)
        while queue and batch.accepts(queue[0]):
            batch.admit(queue.pop(0))
        if not batch.busy:
            if step > max(arrivals):
                return [w.ids for w in works], calls
            step += 1
            continue
        for work, token in batch.step():
            work.ids.append(token)
            if len(work.ids) >= work.max_tokens:
                batch.release(work)
        calls += 1
        step += 1


PROMPTS = [[295, 277, 75, 312, 223, 311, 89], [17, 42, 7], [5, 9, 11, 13, 200, 201, 202, 203, 204, 205, 206, 207, 3],
           [100], [250, 251, 252, 253, 254]]


@pytest.mark.parametrize("rows_alone", [True, False], ids=["prompts in row calls", "prompts token by token"])
@pytest.mark.parametrize("name", ["llama_fp32", "qwen2_int4", "phi3_fp32"])
def test_requests_joining_running_ones_get_their_own_ids(setups, name, rows_alone):
    shape, stepper = setups(name, 4)
    assert shape.shared and shape.batch == (1, 4)
    arrivals = {0: [(PROMPTS[0], 12), (PROMPTS[1], 5)], 3: [(PROMPTS[2], 6)], 4: [(PROMPTS[3], 9)],
                9: [(PROMPTS[4], 7), (PROMPTS[1], 4)]}
    batch = batch_for(shape, stepper, 0)
    assert isinstance(batch, SlotBatch) and batch.rows == 4 and batch.row_calls
    batch.row_calls = rows_alone
    got, calls = drive(batch, arrivals)
    expected = [alone(*setups(name, 1), p, n) for step in sorted(arrivals) for p, n in arrivals[step]]
    assert got == expected
    # the requests shared calls: fewer than their prompts' and tokens' calls one after the other
    assert calls < sum(len(p) + n for step in arrivals.values() for p, n in step) // 2


@pytest.mark.parametrize("rows_alone", [True, False], ids=["prompts in row calls", "prompts token by token"])
def test_prompt_longer_than_a_call_and_a_freed_slot_taken_again(setups, rows_alone):
    shape, stepper = setups("llama_fp32", 2)
    long = list(range(20, 20 + 3 * CHUNK + 2))
    arrivals = {0: [(long, 4), (PROMPTS[1], 2)], 1: [(PROMPTS[0], 5), (PROMPTS[3], 3)], 3: [(long[::-1], 3)]}
    batch = batch_for(shape, stepper, 0)
    batch.row_calls = rows_alone
    got, _ = drive(batch, arrivals)
    expected = [alone(*setups("llama_fp32", 1), p, n) for step in sorted(arrivals) for p, n in arrivals[step]]
    assert got == expected


def test_batch_of_one_takes_prompts_in_pieces(setups):
    shape, stepper = setups("llama_fp32", 1)
    long = list(range(40, 40 + 2 * CHUNK + 3))
    calls = []
    original = stepper.step
    stepper.step = lambda feeds, last: (calls.append(feeds[shape.input_ids].shape[1]), original(feeds, last))[1]
    got, _ = drive(batch_for(shape, stepper, 0), {0: [(long, 3)], 1: [(PROMPTS[0], 4)]})
    reference = setups("llama_fp32", 1)
    assert got == [alone(*reference, long, 3), alone(*reference, PROMPTS[0], 4)]
    assert calls[:3] == [CHUNK, CHUNK, 3]     # the long prompt in three calls, not one per token


def test_a_row_at_the_end_of_the_context_stops_with_room_zero(setups):
    shape, stepper = setups("llama_fp32", 2)
    batch = batch_for(shape, stepper, 0)
    work = Work(list(range(30, 30 + CONTEXT - 3)), 10, Sampler())
    batch.admit(work)
    while batch.room(work) > 0:
        for w, token in batch.step():
            w.ids.append(token)
    assert len(work.ids) == 4 and batch.room(work) == 0


@pytest.mark.parametrize("name", ["llama_optimum", "llama_dynamo"])
def test_a_growing_cache_takes_requests_into_running_batches(setups, name):
    shape, stepper = setups(name, 2)
    assert not shape.shared
    batch = batch_for(shape, stepper, 0)
    assert isinstance(batch, GrowingBatch)
    arrivals = {0: [([5, 17, 42, 7, 9, 3], 6), ([11, 12], 3)], 2: [([7, 8, 9], 4)], 3: [([21, 22, 23, 24], 2)],
                9: [(list(range(30, 41)), 5)]}
    got, calls = drive(batch, arrivals)
    reference = setups(name, 1)
    assert got == [alone(*reference, p, n) for step in sorted(arrivals) for p, n in arrivals[step]]
    assert calls < sum(len(p) + n for step in arrivals.values() for p, n in step) // 2


def test_a_growing_cache_drains_when_the_next_request_does_not_fit(setups):
    shape, stepper = setups("llama_optimum", 2)
    batch = batch_for(shape, stepper, 0)
    first = Work(list(range(5, 25)), 10, Sampler())
    batch.admit(first)
    for _ in range(3):
        for work, token in batch.step():
            work.ids.append(token)
    late = Work(list(range(40, 60)), CONTEXT - 20, Sampler())   # fits an empty cache only
    assert not batch.accepts(late) and batch.draining
    assert not batch.accepts(Work([5], 1, Sampler()))          # nothing joins while it drains
    batch.release(first)
    assert batch.total == 0 and batch.accepts(late)


def test_a_joining_prompt_goes_in_by_row_calls_of_whole_pieces(setups):
    shape, stepper = setups("llama_fp32", 4)
    calls = []
    original = stepper.step
    stepper.step = lambda feeds, last, row=None: (calls.append((row, feeds[shape.input_ids].shape)),
                                                   original(feeds, last, row))[1]
    long = list(range(60, 60 + CHUNK + 3))
    got, _ = drive(batch_for(shape, stepper, 0), {0: [(PROMPTS[0], 10)], 2: [(long, 3)]})
    reference = setups("llama_fp32", 1)
    assert got == [alone(*reference, PROMPTS[0], 10), alone(*reference, long, 3)]
    assert [(row, s) for row, s in calls if row] == [(1, (1, CHUNK)), (1, (1, 3))]   # its prompt: two calls of its row
    assert calls[0] == (None, (4, len(PROMPTS[0])))    # the call that makes the cache covers every row
    assert calls[1] == (0, (1, 1))                     # then the lone request decodes at batch 1
    assert (0, (2, 1)) in calls                        # and both busy rows together


def test_calls_cover_the_rows_up_to_the_last_busy_one(setups):
    shape, stepper = setups("llama_fp32", 4)
    widths = []
    original = stepper.step
    stepper.step = lambda feeds, last, row=None: (widths.append(len(feeds[shape.input_ids])),
                                                   original(feeds, last, row))[1]
    batch = batch_for(shape, stepper, 0)
    works = [Work(p, 6, Sampler()) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[3])]
    for work in works:
        batch.admit(work)
    for _ in range(2):
        for work, token in batch.step():
            work.ids.append(token)
    batch.release(works[2])           # the last busy row leaves: calls shrink to two rows
    widths.clear()
    batch.step()
    batch.release(works[0])           # a hole below the last busy row: still two rows
    batch.step()
    assert widths == [2, 2]
    batch.admit(Work(PROMPTS[4], 3, Sampler()))   # takes the lowest free slot, row 0
    assert batch.slots[0] is not None and batch.slots[0].prompt == PROMPTS[4]


@pytest.mark.parametrize("name", ["llama_fp32", "llama_optimum"])
def test_any_schedule_of_arrivals_gives_each_request_its_own_ids(setups, name):
    """Random schedules (hypothesis): requests of random prompts and lengths arriving at
    random steps into 3 slots (a shared buffer: prompts by row calls or token by token; a
    growing cache: joining running batches)."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    shape, stepper = setups(name, 3)
    reference = setups(name, 1)
    memo: dict[tuple, list[int]] = {}

    def expected(prompt: list[int], count: int) -> list[int]:
        key = tuple(prompt)
        if key not in memo:   # greedy: fewer tokens are a prefix of more
            memo[key] = alone(*reference, prompt, 8)
        return memo[key][:count]

    vocab = shape.vocab or 320
    request = st.tuples(st.lists(st.integers(3, min(319, vocab - 1)), min_size=1, max_size=20), st.integers(1, 8),
                        st.integers(0, 10))

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(request, min_size=1, max_size=6), st.booleans())
    def check(requests, rows_alone):
        arrivals: dict[int, list] = {}
        for prompt, count, step in requests:
            arrivals.setdefault(step, []).append((prompt, count))
        batch = batch_for(shape, stepper, 0)
        if isinstance(batch, SlotBatch):
            batch.row_calls = rows_alone
        got, _ = drive(batch, arrivals)
        assert got == [expected(p, n) for step in sorted(arrivals) for p, n in arrivals[step]]

    check()


def test_a_smaller_prefill_chunk_cuts_prompts_finer(setups):
    shape, stepper = setups("llama_fp32", 4)
    widths = []
    original = stepper.step
    stepper.step = lambda feeds, last, row=None: (widths.append((row, feeds[shape.input_ids].shape[1])),
                                                   original(feeds, last, row))[1]
    long = list(range(60, 60 + 2 * CHUNK + 1))
    batch = batch_for(shape, stepper, 0, chunk=3)
    assert batch.chunk == 3 and batch_for(shape, stepper, 0, chunk=10 * CHUNK).chunk == CHUNK
    got, _ = drive(batch, {0: [(PROMPTS[0], 6)], 2: [(long, 3)]})
    reference = setups("llama_fp32", 1)
    assert got == [alone(*reference, PROMPTS[0], 6), alone(*reference, long, 3)]
    assert max(width for _, width in widths) == 3
    assert [w for row, w in widths if row == 1] == [3] * (len(long) // 3) + ([len(long) % 3] if len(long) % 3 else [])


def test_a_job_that_chooses_next_to_the_logits_serves_each_request_its_own_ids(setups, tmp_path):
    """A job that chooses greedy ids next to its logits (a GPU's job of one rank; here the
    path a GPU runs, on the CPU): calls whose requests are all greedy bring ids, a call with
    a sampled request among them brings logits, and every greedy request gets its ids alone."""
    from meshplan.runtime.job import Job

    dims, _ = generation_plan_dims(model_path("llama_fp32"), 4, CONTEXT, CHUNK)
    make_plan(model_path("llama_fp32"), make_cluster((1, 1), "cpu"), dims, tmp_path, PlanOptions())
    job = Job(tmp_path, "cpu", cache_in_place=True, on_device=True, choose=True)
    try:
        stepper, calls = _counting_stepper(job, ("choose", "step"))
        shape = GenerationShape.of_plan(job.plan)
        arrivals = {0: [(PROMPTS[0], 8), (PROMPTS[1], 5)], 2: [(PROMPTS[2], 6)], 6: [(PROMPTS[4], 4)]}
        got, _ = drive(batch_for(shape, stepper, 0), arrivals)
        expected = [alone(*setups("llama_fp32", 1), p, n) for step in sorted(arrivals) for p, n in arrivals[step]]
        assert got == expected
        assert calls["choose"] > 0 and calls["step"] == 0
        # a sampled request in the batch: the calls it shares bring logits
        batch = batch_for(shape, stepper, 0)
        greedy, sampled = Work(PROMPTS[0], 6, Sampler()), Work(PROMPTS[3], 3, Sampler(temperature=0.7, seed=1))
        batch.admit(greedy)
        batch.admit(sampled)
        while batch.busy:
            for work, token in batch.step():
                work.ids.append(token)
                if len(work.ids) >= work.max_tokens:
                    batch.release(work)
        assert calls["step"] > 0 and greedy.ids == alone(*setups("llama_fp32", 1), PROMPTS[0], 6)
        assert len(sampled.ids) == 3
    finally:
        job.close()


def _counting_stepper(job, names):
    """A ``JobStepper`` on ``job`` whose calls ``names`` are counted in the dict returned with it."""
    from meshplan.generation.driver import JobStepper

    stepper, calls = JobStepper(job), dict.fromkeys(names, 0)
    for name in names:
        method = getattr(stepper, name)

        def counted(*args, _method=method, _name=name, **kwargs):
            calls[_name] += 1
            return _method(*args, **kwargs)
        setattr(stepper, name, counted)
    return stepper, calls


def _scored_run(job, arrivals, logprobs, echo_at=None):
    """Each request's tokens and their scores ((id, logprob, top) per token) through a
    ``SlotBatch`` on ``job``, and the count of each kind of stepper call; the request at
    ``echo_at`` scores its prompt too."""
    stepper, calls = _counting_stepper(job, ("choose", "step", "score"))
    batch = batch_for(GenerationShape.of_plan(job.plan), stepper, 0)
    queue, works, step = [], [], 0
    while True:
        for prompt, count in arrivals.get(step, []):
            work = Work(prompt, count, Sampler(), logprobs=logprobs, echo=len(works) == echo_at)
            work.scores = []
            queue.append(work)
            works.append(work)
        while queue and batch.accepts(queue[0]):
            batch.admit(queue.pop(0))
        if not batch.busy and step > max(arrivals):
            return [(w.ids, w.scores, w.prompt_scores) for w in works], calls
        for work, token in batch.step():
            work.ids.append(token)
            work.scores.append(work.score)
            if len(work.ids) >= work.max_tokens:
                batch.release(work)
        step += 1


def test_logprobs_scored_next_to_the_logits_equal_the_hosts(tmp_path):
    """Where the job chooses next to its logits (a GPU's job of one rank; here its path on
    the CPU), greedy requests that ask for logprobs get them from the job's scorer (the
    log-softmax and top k where the logits are: ``JobStepper.score``), equal to the host's
    scores of the whole logits; a request scoring its prompt (echo) has its prefill bring
    the logits."""
    from meshplan.runtime.job import Job

    dims, _ = generation_plan_dims(model_path("llama_fp32"), 4, CONTEXT, CHUNK)
    make_plan(model_path("llama_fp32"), make_cluster((1, 1), "cpu"), dims, tmp_path, PlanOptions())
    arrivals = {0: [(PROMPTS[0], 6), (PROMPTS[1], 5)], 2: [(PROMPTS[2], 4)], 4: [(PROMPTS[4], 4)]}
    found = {}
    for choose in (True, False):
        job = Job(tmp_path, "cpu", cache_in_place=True, on_device=True, choose=choose)
        try:
            found[choose] = _scored_run(job, arrivals, 5) + _scored_run(job, arrivals, 3, echo_at=1)
        finally:
            job.close()
    device, device_calls, echoed, echo_calls = found[True]
    host, host_calls, host_echoed, _ = found[False]
    assert device_calls["score"] > 0 and device_calls["step"] == 0 and device_calls["choose"] == 0
    assert host_calls["score"] == host_calls["choose"] == 0
    assert echo_calls["step"] > 0 and echo_calls["score"] > 0      # the echoed prompt's calls bring logits
    for (ids, scores, _), (host_ids, host_scores, _) in zip(device + echoed, host + host_echoed):
        assert ids == host_ids and len(scores) == len(ids) > 0
        for (token, logprob, top), (host_token, host_logprob, host_top) in zip(scores, host_scores):
            assert token == host_token == top[0][0]
            assert logprob == pytest.approx(host_logprob, abs=1e-5) and logprob < 0
            assert [i for i, _ in top] == [i for i, _ in host_top] and len(top) in (3, 5)
            assert [v for _, v in top] == pytest.approx([v for _, v in host_top], abs=1e-5)
    assert echoed[1][2] and echoed[1][2] == host_echoed[1][2]      # the prompt's own scores


SYSTEM = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83]


@pytest.mark.parametrize("rows_alone", [True, False], ids=["prompts in row calls", "prompts token by token"])
def test_prompts_sharing_a_prefix_reuse_it_and_get_their_own_ids(setups, rows_alone):
    """A request whose prompt begins with what a running request's row holds has it copied
    into its row; one that comes after a request of the same beginning has finished takes
    that freed row as it is; neither computes those positions, and each gets the ids it
    gets alone."""
    shape, stepper = setups("llama_fp32", 4)
    reference = setups("llama_fp32", 1)
    first, second, third = SYSTEM + [101, 102, 103], SYSTEM + [201, 202], SYSTEM[:12] + [5]
    batch = batch_for(shape, stepper, 0)
    assert batch.copies
    batch.row_calls = rows_alone
    got, _ = drive(batch, {0: [(first, 10)], 3: [(second, 6)], 20: [(third, 5)], 40: [(SYSTEM + [201], 4)]})
    assert got == [alone(*reference, p, n) for p, n in ((first, 10), (second, 6), (third, 5), (SYSTEM + [201], 4))]
    # second: the 20 shared positions copied from the first's row; third: 12 from a freed row;
    # the last: 20 from the freed row of the second (all its prompt but the last token, whose
    # logits choose the first new one). Calls of every row (no row calls) write a pad into
    # each free row at its position 0, so there a freed row is reused only where no call
    # covered it since.
    if rows_alone:
        assert batch.reused == len(SYSTEM) + 12 + len(SYSTEM)
    else:
        assert len(SYSTEM) <= batch.reused < len(SYSTEM) + 12 + len(SYSTEM)


def test_a_prompt_that_is_scored_or_too_short_reuses_nothing(setups):
    shape, stepper = setups("llama_fp32", 4)
    batch = batch_for(shape, stepper, 0)
    drive(batch, {0: [(SYSTEM + [5], 3)]})
    scored = Work(SYSTEM + [5, 6], 2, Sampler(), logprobs=1, echo=True)
    batch.admit(scored)
    assert batch.reused == 0 and scored.fed == 0
    batch.release(scored)
    batch.admit(Work([SYSTEM[0]], 2, Sampler()))
    assert batch.reused == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_n_choices_prefill_once_and_each_draws_as_a_request_alone(setups, temperature):
    """n = 3: the prompt computed in one row and copied into two more; choice i with seed
    s + i gives the ids a request alone with that seed gets (greedy: the same ids thrice)."""
    shape, stepper = setups("llama_fp32", 4)
    reference = setups("llama_fp32", 1)
    prompt = PROMPTS[2]
    batch = batch_for(shape, stepper, 0)
    works = [Work(prompt, 6, Sampler(temperature, seed=5 + i)) for i in range(3)]
    works[0].followers = works[1:]
    other = Work(PROMPTS[1], 4, Sampler())
    batch.admit(other)
    assert batch.accepts(works[0]) and not batch.accepts(Work(prompt, 1, Sampler(), followers=works[:3]))
    batch.admit(works[0])
    prompt_calls = []
    original = stepper.step
    stepper.step = lambda feeds, last, row=None: (prompt_calls.append(feeds[shape.input_ids].shape),
                                                  original(feeds, last, row))[1]
    try:
        while batch.busy:
            for work, token in batch.step():
                work.ids.append(token)
                if len(work.ids) >= work.max_tokens:
                    batch.release(work)
    finally:
        stepper.step = original
    for i, work in enumerate(works):
        lone, _ = Generation(*reference).run([prompt], 6, Sampler(temperature, seed=5 + i))
        assert work.ids == lone[0].ids, i
    if temperature == 0:
        assert works[0].ids == works[1].ids == works[2].ids
    # the prompt's positions went into the cache in calls of one row (or the first call), never thrice
    assert sum(width for _, width in prompt_calls if width > 1) <= len(prompt)
