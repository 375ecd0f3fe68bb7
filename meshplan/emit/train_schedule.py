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

from meshplan.emit.schedule import Instruction
from meshplan.errors import PlanError
from meshplan.training.pipeline_step import (CLIP, NORM, PER_MICROBATCH, STATE, UPDATE_PHASE, Crossing,
                                             PipelineStep)
from meshplan.training.step_model import BACKWARD, FORWARD

ONE_F_ONE_B, GPIPE = "1f1b", "gpipe"
TRAINING_KINDS = (ONE_F_ONE_B, GPIPE)


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


def per_microbatch(crossing: Crossing) -> bool:
    """Whether a crossing carries a tensor every microbatch (else once a step)."""
    return crossing.made_in in PER_MICROBATCH and any(p in PER_MICROBATCH for p in crossing.read_in)


def training_schedule(pipeline: PipelineStep, microbatches: int, kind: str = ONE_F_ONE_B) -> list[list[Instruction]]:
    """Each stage's instruction list for one step (see the module)."""
    if microbatches < 1:
        raise PlanError(f"--microbatches must be 1 or more, not {microbatches}")
    S, last_mb = pipeline.stages, microbatches - 1
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
