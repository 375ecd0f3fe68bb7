"""A pipelined training plan's programs: each stage's parts as ONNX files in the plan
directory, and the record plan.json keeps of them (``training["pipeline"]``).

The parts lie beside the step model in ``training/`` (``stage{S}.{phase}.onnx``); a frozen
weight a part reads stays in the step model's data file, which the part points to. The
record holds each part's file, digest, inputs and outputs, the crossings (tensors one stage
makes and another reads), the stage that holds each state input, the schedule's kind and
the replicas of each stage (each stage data-parallel over that many devices: one count, or
one a stage, with ``rows``, the axis of samples of each crossing split between stages of
different counts: ``meshplan.stage_ranks``) and the tensors
those replicas hold in row blocks (``training.sharded_update``: the norm and update parts
written to take them in any number of rows), and the groups each stage's update is run in
(``training.pipeline_step.update_chunks``). Where T devices shard each stage's operators
(``emit.rank_parts``) each device has its own parts (``stage{S}.{phase}.d{J}.onnx``, the
record's ``device``), and the record holds T (``tensor``) and each input's layout on their
[1, T] mesh (``specs``); where the stages' T differ, each stage's (``tensors``, T the most),
its layouts (``stage_specs``; a stage of one device has its parts as device 0's) and how each
crossing between stages of different layouts goes (``relayouts``,
``meshplan.crossing_layouts``).
``read_pipeline`` gives back the ``PipelineStep`` a runner needs, the parts as paths.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import onnx

from meshplan.crossing_layouts import Relayout
from meshplan.errors import PlanError
from meshplan.files import file_sha256
from meshplan.stage_ranks import per_stage
from meshplan.training.pipeline_step import NORM, PHASES, SCHEDULES, UPDATE_PHASE, Crossing, Part, PipelineStep
from meshplan.training.sharded_update import relaxed
from meshplan.training.step_model import StepModel


def part_file(stage: int, phase: str, device: int | None = None) -> str:
    return f"stage{stage}.{phase}.onnx" if device is None else f"stage{stage}.{phase}.d{device}.onnx"


def write_parts(pipeline: PipelineStep, folder: Path, kind: str, microbatches: int, replicas=1) -> dict:
    """Each part of ``pipeline`` into ``folder`` (a plan directory's ``training/``, being
    written); returns plan.json's record of them. A pipeline whose stages shard their
    operators (``pipeline.device_parts``) has each device's parts, each with its ``device``."""
    parts = []
    devices = list(enumerate(pipeline.device_parts)) if pipeline.device_parts else [(None, pipeline.parts)]
    for device, found in devices:
        for (stage, phase), part in sorted(found.items()):
            path = Path(folder) / part_file(stage, phase, device)
            model = relaxed(part.model, pipeline.sharded) if pipeline.sharded and phase in (NORM, UPDATE_PHASE) \
                and pipeline.tensor_of(stage) == 1 else part.model
            onnx.save(model, str(path))
            entry = {"stage": stage, "phase": phase, "file": f"{Path(folder).name}/{path.name}",
                     "sha256": file_sha256(path), "inputs": part.inputs, "outputs": part.outputs}
            if device is not None:
                entry["device"] = device
            parts.append(entry)
    replicas = per_stage(replicas, pipeline.stages)
    record = {"stages": pipeline.stages, "replicas": replicas[0] if len(set(replicas)) == 1 else replicas,
              "schedule": kind, "microbatches": microbatches,
              "parts": parts, "crossings": [_crossing_record(c) for c in pipeline.crossings], "home": dict(pipeline.home),
              "data_inputs": pipeline.data_inputs, "controls": pipeline.controls, "loss_count": pipeline.loss_count,
              "sharded": sorted(pipeline.sharded),
              "update_chunks": {str(stage): groups for stage, groups in sorted(pipeline.chunks.items())}}
    if pipeline.rows:
        record["rows"] = {str(index): axis for index, axis in sorted(pipeline.rows.items())}
    if pipeline.device_parts:
        record["tensor"] = pipeline.tensor
        record["specs"] = dict(pipeline.specs)
    if pipeline.tensors:
        record["tensors"] = list(pipeline.tensors)
        record["stage_specs"] = [dict(s) for s in pipeline.stage_specs]
        record["relayouts"] = {str(i): r.to_dict() for i, r in sorted(pipeline.relayouts.items())}
    return record


def _crossing_record(crossing: Crossing) -> dict:
    entry = asdict(crossing)
    if not crossing.into:
        del entry["into"]
    return entry


def read_pipeline(plan_dir: Path, training: dict, check: bool = True) -> PipelineStep:
    """The pipeline a plan's record describes, each part's model the path of its file
    (checked against its digest, unless ``check`` is False)."""
    record = training.get("pipeline")
    try:
        tensor = int(record.get("tensor", 1))
        tensors = [int(t) for t in record.get("tensors", ())]
        if tensors and (len(tensors) != int(record["stages"]) or max(tensors) != tensor or min(tensors) < 1):
            raise PlanError(f"plan.json's devices of each stage {tensors} do not fit its {record['stages']} stages of "
                            f"at most {tensor}", hint="re-run meshplan plan")
        devices: list[dict] = [{} for _ in range(tensor)]
        for entry in record["parts"]:
            if entry["phase"] not in PHASES:
                raise PlanError(f"plan.json names an unknown part {entry['phase']!r}", hint="re-run meshplan plan")
            path = Path(plan_dir) / entry["file"]
            if not path.is_file():
                raise PlanError(f"the plan's program {path} is missing", hint="re-run meshplan plan")
            if check and file_sha256(path) != entry["sha256"]:
                raise PlanError(f"the plan's program {path} changed since planning", hint="re-run meshplan plan")
            device = int(entry.get("device", 0)) if tensor > 1 else 0
            if not 0 <= device < tensor:
                raise PlanError(f"plan.json names a part of device {device} of a stage of {tensor}",
                                hint="re-run meshplan plan")
            devices[device][(int(entry["stage"]), entry["phase"])] = Part(
                int(entry["stage"]), entry["phase"], str(path), list(entry["inputs"]), list(entry["outputs"]))
        parts = devices[0]
        if any(set(found) != {(s, p) for s, p in parts if not tensors or tensors[s] > j}
               for j, found in enumerate(devices)):
            raise PlanError("plan.json's devices of a stage have different parts", hint="re-run meshplan plan")
        crossings = [Crossing(c["tensor"], int(c["src"]), c["made_in"], int(c["dst"]), tuple(c["read_in"]),
                              str(c.get("into", ""))) for c in record["crossings"]]
        if record["schedule"] not in SCHEDULES:
            raise PlanError(f"plan.json names an unknown pipeline schedule {record['schedule']!r}",
                            hint="re-run meshplan plan")
        step = StepModel(None, {}, {k: v for k, v in training.items() if k != "pipeline"})
        chunks = {int(k): [list(g) for g in v] for k, v in dict(record.get("update_chunks", {})).items()}
        for stage, groups in chunks.items():   # each output of the stage's update in one group
            update = parts.get((stage, UPDATE_PHASE))
            if update is None or sorted(n for g in groups for n in g) != sorted(update.outputs):
                raise PlanError(f"plan.json's update groups of stage {stage} are not its update's outputs",
                                hint="re-run meshplan plan")
        return PipelineStep(int(record["stages"]), parts, crossings, {k: int(v) for k, v in record["home"].items()},
                            {}, step, list(record["data_inputs"]), list(record["controls"]), record.get("loss_count"),
                            sharded=set(record.get("sharded", ())), chunks=chunks,
                            device_parts=devices if tensor > 1 else [], specs=dict(record.get("specs", {})),
                            rows={int(k): int(v) for k, v in dict(record.get("rows", {})).items()},
                            tensors=tensors, stage_specs=[dict(s) for s in record.get("stage_specs", ())],
                            relayouts={int(k): Relayout.from_dict(v)
                                       for k, v in dict(record.get("relayouts", {})).items()})
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"plan.json's pipeline record is malformed ({type(exc).__name__}: {exc})",
                        hint="re-run meshplan plan") from None
