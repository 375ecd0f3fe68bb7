"""The instruction lists of a pipelined training step: 1F1B or GPipe, as data.

Each stage's list (one per stage: ``training.pipeline_step`` cuts the step into stages) is
made of the ``emit.schedule.Instruction`` ops ``run`` (a ``part``: forward or backward for a
microbatch, then norm, clip and update once a step), ``send`` and ``receive`` (a
``crossing``: its index in ``PipelineStep.crossings``). The order of a stage's runs:

- ``gpipe``: every microbatch's forward, then every backward (all B microbatches'
  activations in flight);
- ``1f1b`` (PipeDream-Flush, as Alpa and Megatron-LM run it): stage i of S first runs
  min(S − i − 1, B) forwards, then alternates one forward and one backward, then drains the
  backwards: at most S − i microbatches in flight;

then, after the last microbatch's backward, ``norm``, ``clip`` (the last stage) and
``update``. A tensor is sent right after the run that makes it and received right before
the first run that reads it; a state another stage reads (a tied weight) is sent when the
step starts. Backwards take their microbatches in order on every stage, so gradients
accumulate in the same order as one device's steps. ``play`` runs the lists against each
other (sends never wait, a receive waits for its send) and says where they would deadlock.
"""

from __future__ import annotations

import json
from pathlib import Path

from meshplan.emit.schedule import SCHEDULE_FILE, Instruction, Schedule, read_lists
from meshplan.errors import PlanError
from meshplan.files import atomic_write_bytes
from meshplan.stage_ranks import per_stage
from meshplan.training.pipeline_step import (CLIP, GPIPE, NORM, ONE_F_ONE_B, PER_MICROBATCH, SCHEDULES, STATE,
                                             UPDATE_PHASE, Crossing, PipelineStep, per_microbatch)
from meshplan.training.step_model import BACKWARD, FORWARD

TRAINING_KINDS = SCHEDULES


def run_order(stage: int, stages: int, microbatches: int, kind: str) -> list[tuple[str, int]]:
    """Stage ``stage``'s runs in a step: (phase, microbatch); a step's own phases carry the
    last microbatch."""
    B = microbatches
    if kind == GPIPE:
        runs = [(FORWARD, m) for m in range(B)] + [(BACKWARD, m) for m in range(B)]
    elif kind == ONE_F_ONE_B:
        warm = min(stages - stage - 1, B)
        runs = [(FORWARD, m) for m in range(warm)]
        for m in range(B - warm):
            runs += [(FORWARD, warm + m), (BACKWARD, m)]
        runs += [(BACKWARD, m) for m in range(B - warm, B)]
    else:
        raise PlanError(f"unknown pipeline schedule {kind!r} (known: {', '.join(TRAINING_KINDS)})")
    runs.append((NORM, B - 1))
    if stage == stages - 1:
        runs.append((CLIP, B - 1))
    runs.append((UPDATE_PHASE, B - 1))
    return runs


def timed_step(stages: int, microbatches: int, kind: str, took: dict[tuple[int, str], float],
               sent: dict[tuple[int, str], float], scalar: float = 0.0, orders: list | None = None):
    """The step as its schedule plays it: ``took[(stage, phase)]`` a run's seconds (a norm's
    with the replicas' sum before it), ``sent[(stage, phase)]`` the seconds from the end of
    that stage's forward or backward of a microbatch until the next (or previous) stage has
    what it sends, ``scalar`` a small message's (the norm's partials and the clipping factor).
    A stage's run starts when the stage is free and what it reads has arrived: a forward the
    stage before's forward of its microbatch, a backward the stage after's backward, the
    clipping (on the last stage) every stage's norm, an update the clipping factor.
    ``orders``: each stage's runs (default ``run_order``'s). Returns per stage its runs
    (phase, microbatch, start, end) and the step's end."""
    S, B = stages, microbatches
    orders = orders if orders is not None else [run_order(s, S, B, kind) for s in range(S)]

    def needs(s: int, phase: str, mb: int) -> list[tuple[tuple[str, int, int], float]]:
        if phase == FORWARD:
            return [((FORWARD, s - 1, mb), sent.get((s - 1, FORWARD), 0.0))] if s else []
        if phase == BACKWARD:
            return [((BACKWARD, s + 1, mb), sent.get((s + 1, BACKWARD), 0.0))] if s < S - 1 else []
        if phase == CLIP:
            return [((NORM, t, mb), scalar if t != s else 0.0) for t in range(S)]
        if phase == UPDATE_PHASE and s != S - 1:
            return [((CLIP, S - 1, mb), scalar)]
        return []

    done: dict[tuple[str, int, int], float] = {}
    rows: list[list[tuple[str, int, float, float]]] = [[] for _ in range(S)]
    at, free = [0] * S, [0.0] * S
    moved = True
    while moved:
        moved = False
        for s in range(S):
            while at[s] < len(orders[s]):
                phase, mb = orders[s][at[s]]
                wanted = needs(s, phase, mb)
                if any(key not in done for key, _ in wanted):
                    break
                start = max([free[s]] + [done[key] + delay for key, delay in wanted])
                done[(phase, s, mb)] = free[s] = start + took.get((s, phase), 0.0)
                rows[s].append((phase, mb, start, free[s]))
                at[s] += 1
                moved = True
    return rows, max(free, default=0.0)


def training_schedule(pipeline: PipelineStep, microbatches: int, kind: str = ONE_F_ONE_B,
                      replicas=1) -> list[list[Instruction]]:
    """Each stage's instruction list for one step (see the module); on a stage of
    ``replicas`` > 1 (one count, or one a stage: each stage data-parallel over that many
    devices) a ``reduce`` after the last microbatch's backward sums the stage's accumulated
    gradients over its replicas."""
    if microbatches < 1:
        raise PlanError(f"--microbatches must be 1 or more, not {microbatches}")
    S, last_mb = pipeline.stages, microbatches - 1
    replicas = per_stage(replicas, S)
    lists: list[list[Instruction]] = []
    for stage in range(S):
        runs = [r for r in run_order(stage, S, microbatches, kind) if (stage, r[0]) in pipeline.parts]
        out: list[Instruction] = []
        out += [Instruction("send", 0, crossing=i) for i, c in enumerate(pipeline.crossings)
                if c.src == stage and c.made_in == STATE]
        received: set[tuple[int, int]] = set()
        for phase, mb in runs:
            for i, c in enumerate(pipeline.crossings):
                if c.dst != stage or phase not in c.read_in:
                    continue
                key = (i, mb if per_microbatch(c) else (0 if c.made_in == STATE else last_mb))
                if key in received or (not per_microbatch(c) and phase in PER_MICROBATCH and mb != key[1]
                                       and c.made_in != STATE):
                    continue
                received.add(key)
                out.append(Instruction("receive", key[1], crossing=i))
            out.append(Instruction("run", mb, part=phase))
            if replicas[stage] > 1 and phase == BACKWARD and mb == last_mb:
                out.append(Instruction("reduce", mb))
            for i, c in enumerate(pipeline.crossings):
                if c.src != stage or c.made_in != phase:
                    continue
                if per_microbatch(c) or mb == last_mb:
                    out.append(Instruction("send", mb, crossing=i))
        lists.append(out)
    return lists


def play(lists: list[list[Instruction]]) -> list[tuple[int, Instruction]]:
    """The order the stages' lists carry out in when each goes as far as it can (sends never
    wait; a receive waits for its send). Raises ``PlanError`` naming the stuck instructions
    where they would wait on each other forever."""
    at = [0] * len(lists)
    sent: set[tuple[int, int]] = set()
    done: list[tuple[int, Instruction]] = []
    while True:
        moved = False
        for stage, items in enumerate(lists):
            while at[stage] < len(items):
                ins = items[at[stage]]
                if ins.op == "receive" and (ins.crossing, ins.mb) not in sent:
                    break
                if ins.op == "send":
                    sent.add((ins.crossing, ins.mb))
                done.append((stage, ins))
                at[stage] += 1
                moved = True
        if not moved:
            break
    stuck = [(s, lists[s][at[s]]) for s in range(len(lists)) if at[s] < len(lists[s])]
    if stuck:
        where = "; ".join(f"stage {s}: {i.op} crossing {i.crossing} mb {i.mb}" for s, i in stuck)
        raise PlanError(f"the training schedule would deadlock ({where})")
    return done


def check_training_schedule(pipeline: PipelineStep, lists: list[list[Instruction]], microbatches: int,
                            kind: str, replicas=1) -> None:
    """Lists a job can carry out for ``pipeline``: each stage's holds what
    ``training_schedule`` gives it, no more and no less; a stage receives what a run reads
    before the run and sends what a run made after it; and the lists, played against each
    other, come to their end. Raises ``PlanError`` (one line) where they do not."""
    if len(lists) != pipeline.stages:
        raise PlanError(f"{SCHEDULE_FILE} does not fit the plan (it has {len(lists)} lists for {pipeline.stages} "
                        "stages)", hint="re-run meshplan plan")
    whole = training_schedule(pipeline, microbatches, kind, replicas)
    replicas = per_stage(replicas, pipeline.stages)
    key = lambda i: (i.op, i.mb, i.part or "", -1 if i.crossing is None else i.crossing)   # noqa: E731
    for stage, (given, wanted) in enumerate(zip(lists, whole)):
        if sorted(given, key=key) != sorted(wanted, key=key):
            raise PlanError(f"{SCHEDULE_FILE}: stage {stage}'s list leaves out or repeats what the plan does",
                            hint="re-run meshplan plan")
        if [i for i in given if i.op == "run"] != [i for i in wanted if i.op == "run"]:
            raise PlanError(f"{SCHEDULE_FILE}: stage {stage} does not run its parts in the {kind} order",
                            hint="re-run meshplan plan")
        received, ran = set(), set()
        for item in given:
            if item.op == "receive":
                received.add((item.crossing, item.mb))
            elif item.op == "run":
                needed = next((i.crossing for i in wanted if i.op == "receive"
                               and _before(wanted, i, item) and (i.crossing, i.mb) not in received), None)
                if needed is not None:
                    raise PlanError(f"{SCHEDULE_FILE}: stage {stage} runs {item.part} mb {item.mb} before it "
                                    f"receives crossing {needed}", hint="re-run meshplan plan")
                ran.add((item.part, item.mb))
            elif item.op == "send" and pipeline.crossings[item.crossing].made_in != STATE \
                    and ((pipeline.crossings[item.crossing].made_in, item.mb) not in ran
                         or _reduced_first(pipeline.crossings[item.crossing], item, given, microbatches,
                                            replicas[stage])):
                raise PlanError(f"{SCHEDULE_FILE}: stage {stage} sends crossing {item.crossing} mb {item.mb} before "
                                "the run that makes it, or before its replicas' sum", hint="re-run meshplan plan")
            elif item.op == "reduce" and (BACKWARD, microbatches - 1) not in ran:
                raise PlanError(f"{SCHEDULE_FILE}: stage {stage} sums its replicas' gradients before its last "
                                "backward", hint="re-run meshplan plan")
    play(lists)


def _reduced_first(c: Crossing, send: Instruction, given: list[Instruction], microbatches: int,
                   replicas: int) -> bool:
    """Whether ``send`` of a step's sum (a backward's tensor of the last microbatch read once a
    step) comes before the ``reduce`` that completes it: it must come after."""
    if replicas == 1 or c.made_in != BACKWARD or per_microbatch(c) or send.mb != microbatches - 1:
        return False
    reduce = next((i for i, item in enumerate(given) if item.op == "reduce"), None)
    return reduce is None or given.index(send) < reduce


def _before(wanted: list[Instruction], receive: Instruction, run: Instruction) -> bool:
    """Whether ``receive`` comes before ``run`` in the list ``training_schedule`` writes."""
    return wanted.index(receive) < wanted.index(run)


def write_training_schedule(plan_checksum: str, lists: list[list[Instruction]], kind: str, microbatches: int,
                            directory: Path) -> Path:
    path = Path(directory) / SCHEDULE_FILE
    body = Schedule(kind, microbatches, lists).to_dict(plan_checksum)
    atomic_write_bytes(path, (json.dumps(body) + "\n").encode())
    return path


def read_training_schedule(plan_checksum: str, directory: Path, pipeline: PipelineStep, microbatches: int,
                           kind: str, replicas=1) -> list[list[Instruction]]:
    """The stages' lists in ``directory``'s ``schedule.json``, checked
    (``check_training_schedule``) and belonging to the plan.json of ``plan_checksum``."""
    path = Path(directory) / SCHEDULE_FILE
    if not path.is_file():
        raise PlanError(f"{path} is missing", hint="re-run meshplan plan")
    lists = read_lists(path, plan_checksum, (kind,), microbatches).ranks
    check_training_schedule(pipeline, lists, microbatches, kind, replicas)
    return lists
