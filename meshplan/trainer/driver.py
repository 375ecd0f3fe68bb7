"""``meshplan train`` as a driver of the resident job (``runtime.job.Job``).

Rank 0 reads the data and drives; every rank holds its shards of the weights and of the
optimizer's state as the job's state, updated in place by each step. The weights start
from the source model the plan was made from (streamed one tensor at a time) or from a
checkpoint. ``Trainer`` is the Python interface: ``Trainer(job).step(batch, lr)``.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshplan.errors import MeshplanError, TrainError
from meshplan.files import file_sha256
from meshplan.model.weights import read_initializers
from meshplan.plan_format import Plan, read_plan
from meshplan.trainer.checkpoint import Checkpoint, finish_checkpoint, plan_digest, staging_folder
from meshplan.trainer.data import Batches
from meshplan.trainer.loss_scale import LossScale
from meshplan.trainer.schedule import learning_rate
from meshplan.training.master_weights import LOSS_SCALE, as_held


def require_training(plan: Plan, plan_dir) -> None:
    if not plan.training:
        raise TrainError(f"plan {plan_dir} is not a training plan", hint="plan it with meshplan plan --train")
    if plan.training.get("estimate_only"):
        raise TrainError(f"plan {plan_dir} is a training estimate: it was planned with --no-programs",
                         hint="plan again without --no-programs, with the model's weights, to train it")


def source_weights(plan: Plan, names) -> "iter":
    """(name, array) of the trained weights' starting values, one at a time, from the source
    model (which must be the file the plan was made from); a float32 master's widened from
    the model's float16 or bfloat16 (``training.master_weights``)."""
    source = plan.training["source"]
    path = Path(source["path"])
    if not path.is_file():
        raise TrainError(f"the source model {path} is gone", hint="resume from a checkpoint, or plan again")
    if file_sha256(path) != source["sha256"]:
        raise TrainError(f"the source model {path} changed since planning", hint="plan again")
    return as_held(plan.training["weights"], read_initializers(path, names))


def state_names(training: dict) -> list[str]:
    """Every state a training plan holds: weights, slots, statistics, accumulators."""
    return [n for w in training["weights"] for n in [w] + [f"{w}.{s}" for s in training["slots"]]] \
        + list(training.get("statistics", {})) + list(training.get("accumulators", []))


def trained_record(training: dict) -> dict:
    """What a checkpoint must share with a plan to be resumed by it: weights, slots, optimizer."""
    return {"weights": training["weights"], "slots": training["slots"], "optimizer": training["optimizer"],
            "statistics": training.get("statistics", {})}


def check_loss_scale(plan: Plan, scale: LossScale) -> None:
    """``--loss-scale`` only for a plan whose step reads it (one with float32 master weights:
    ``training.master_weights``)."""
    if scale.given and LOSS_SCALE not in (plan.training or {}).get("hyperparameters", []):
        said = "dynamic" if scale.dynamic else f"{scale.scale:g}"
        raise TrainError(f"--loss-scale {said}: the plan's step has no loss scale (its weights train in their "
                         "own dtype)", hint="plan it with --master-weights (a float16 or bfloat16 model)")


def checkpoint_due(options, done: int, end: int) -> bool:
    """Whether a checkpoint is written after step ``done`` of a run ending at ``end``."""
    every = options.checkpoint_every
    return options.checkpoint is not None and (done == end or bool(every and done % every == 0))


class Trainer:
    """Steps of a training plan's job (rank 0)."""

    def __init__(self, job, hyper: dict[str, float] | None = None, loss_scale: LossScale | None = None):
        require_training(job.plan, job.plan_dir)
        self.job, self.plan = job, job.plan
        self.training = job.plan.training
        self.hyper = {k.removeprefix("train."): float(v) for k, v in (hyper or {}).items()}
        self.loss_scale = loss_scale or LossScale()
        self.skipped = False      # whether the last step left the weights as they were (``loss_scale``)

    @property
    def steps_done(self) -> int:
        return self.job.train_steps

    @property
    def weights(self) -> list[str]:
        return list(self.training["weights"])

    @property
    def statistics(self) -> list[str]:
        """Running statistics (BatchNormalization in training mode): state, not trained."""
        return list(self.training.get("statistics", {}))

    def state_names(self) -> list[str]:
        return state_names(self.training)

    def load_source(self) -> None:
        """Set every trained weight and running statistic from the source model (the slots
        start at zero)."""
        for name, array in source_weights(self.plan, self.weights + self.statistics):
            self.job.set_state({name: array})

    def step(self, batch: dict[str, np.ndarray], lr: float) -> tuple[float, float]:
        """One step on ``batch`` at learning rate ``lr``: the loss (before the update) and the
        gradients' global norm (before clipping)."""
        loss = self.job.train_step(batch, lr, **{**self.hyper, "loss_scale": self.loss_scale.scale})
        self.skipped = not self.loss_scale.after(self.job.grad_norm) and bool(self.training.get("guarded"))
        return loss, self.job.grad_norm

    def save(self, directory, batches: Batches | None) -> Path:
        """A checkpoint in ``directory``: every rank writes its own pieces of the state."""
        from meshplan.runtime.state_files import layouts

        staging = staging_folder(directory, self.steps_done)
        try:
            self.job.save_state_files(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        manifest = {"plan_sha256": plan_digest(self.job.plan_dir), "weights": self._trained_record(),
                    "data": batches.get_state() if batches is not None else None,
                    "optimizer_steps": self.job.optimizer_steps, "loss_scale": self.loss_scale.state(),
                    "layouts": {n: v for n, v in layouts(self.plan).items() if n in set(self.state_names())}}
        return finish_checkpoint(staging, directory, self.steps_done, manifest)

    def resume(self, directory, batches: Batches | None) -> Checkpoint:
        """Continue from the newest checkpoint in ``directory``: each rank reads its own pieces
        where this plan wrote them, else the tensors are put together and sent one at a time."""
        checkpoint = Checkpoint(directory)
        if checkpoint.manifest.get("weights") != self._trained_record():
            raise TrainError(f"{checkpoint.path} is a checkpoint of another model or optimizer (its weights and "
                             "slots differ from the plan's)")
        if checkpoint.manifest.get("plan_sha256") == plan_digest(self.job.plan_dir):
            self.job.load_state_files(checkpoint.path)
        else:
            for name in self.state_names():
                self.job.set_state({name: checkpoint.tensor(name)})
        self.job.train_steps = checkpoint.step
        self.job.optimizer_steps = int(checkpoint.manifest.get("optimizer_steps", checkpoint.step))
        self.loss_scale.resume(checkpoint.manifest.get("loss_scale"))
        if batches is not None and checkpoint.manifest.get("data"):
            batches.set_state(checkpoint.manifest["data"])
        return checkpoint

    def _trained_record(self) -> dict:
        return trained_record(self.training)


@dataclass
class TrainOptions:
    data: Path
    steps: int
    lr: float = 1e-3
    schedule: str = "constant"
    warmup: int = 0
    hyper: dict = field(default_factory=dict)
    shuffle: bool = False
    seed: int = 0
    checkpoint: Path | None = None
    checkpoint_every: int = 0
    resume: Path | None = None
    total_steps: int | None = None     # the schedule's length (default: where this run ends)
    loss_scale: LossScale = field(default_factory=LossScale)   # a plan with float32 master weights'
    trace: bool = False                # keep the last step's trace events (``TrainReport.trace_events``)


@dataclass
class TrainReport:
    losses: list = field(default_factory=list)
    lrs: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)
    step_seconds: list = field(default_factory=list)
    first_step: int = 0
    batch: int = 0
    ranks: int = 1
    provider: str = ""
    transfer_path: str = ""
    estimate_seconds: float = 0.0
    checkpoints: list = field(default_factory=list)
    peak_rss_bytes: list = field(default_factory=list)
    memory_estimates: list = field(default_factory=list)
    # a pipelined plan: each rank's share of its steps spent running its parts, and the idle
    # share a pipeline of equal stages has, (S - 1) / (M + S - 1)
    busy_fractions: list = field(default_factory=list)
    bubble: float | None = None
    trace_events: list = field(default_factory=list)   # the last step's, every rank's (``TrainOptions.trace``)
    loss_scales: list = field(default_factory=list)    # each step's, where one was given (``--loss-scale``)
    skipped: list = field(default_factory=list)        # and whether its update was skipped

    def add_step(self, loss: float, lr: float, norm: float, seconds: float, done: int, end: int,
                 progress=None, loss_scale: float | None = None, skipped: bool = False) -> None:
        """Record a step (``done`` of ``end`` now done) and tell ``progress``; ``loss_scale``:
        the scale the step ran at (a plan with master weights), ``skipped``: whether its
        update was skipped."""
        self.losses.append(loss)
        self.lrs.append(lr)
        self.grad_norms.append(norm)
        self.step_seconds.append(seconds)
        if loss_scale is not None:
            self.loss_scales.append(loss_scale)
            self.skipped.append(bool(skipped))
        if progress is not None:
            progress(done, end, loss, lr, norm, self.batch / seconds, loss_scale, skipped)

    def log(self) -> dict:
        """The ``--log`` JSON (a norm that is not finite, a skipped step's, as null)."""
        norms = [n if math.isfinite(n) else None for n in self.grad_norms]
        return {"first_step": self.first_step, "losses": self.losses, "lr": self.lrs, "grad_norm": norms,
                "step_seconds": self.step_seconds, "batch": self.batch, "ranks": self.ranks,
                "estimate_seconds": self.estimate_seconds,
                **({"loss_scale": self.loss_scales, "skipped": self.skipped} if self.loss_scales else {}),
                **({"busy_fractions": self.busy_fractions, "bubble": self.bubble} if self.busy_fractions else {})}


def train_rank(plan_dir, options: TrainOptions, provider: str = "auto", transfer: str = "auto",
               progress=None) -> TrainReport | None:
    """Every rank: load the job, then rank 0 drives ``options.steps`` steps (the others
    serve). Rank 0 returns the report; ``progress(step, steps, loss, lr, grad_norm,
    samples_per_second)`` is called after each step."""
    from meshplan.process_memory import peak_rss_bytes
    from meshplan.runtime.job import Job
    from meshplan.runtime.transport import world

    plan_dir = Path(plan_dir)
    plan = read_plan(plan_dir)
    check_loss_scale(plan, options.loss_scale)
    if plan.training.get("pipeline"):
        from meshplan.trainer.pipeline_driver import train_pipeline_rank

        return train_pipeline_rank(plan_dir, plan, options, provider, progress, transfer)
    held: dict = {}

    def check(plan: Plan) -> None:
        require_training(plan, plan_dir)
        if options.steps < 1:
            raise TrainError(f"--steps must be at least 1, got {options.steps}")
        held["batches"] = Batches(options.data, plan, options.shuffle, options.seed)
        if options.resume is not None:
            Checkpoint(options.resume)   # there and readable, before any work

    job = Job(plan_dir, provider, transfer, check=check)
    if not job.is_driver:
        job.serve()
        _gather_rss(world()[1], peak_rss_bytes())
        return None
    plan = job.plan
    batches: Batches = held["batches"]
    trainer = Trainer(job, options.hyper, options.loss_scale)
    report = TrainReport(batch=batches.batch, ranks=job.size, provider=job.provider,
                         transfer_path=job.transfer_path,
                         estimate_seconds=plan.step_seconds)
    try:
        if options.resume is not None:
            trainer.resume(options.resume, batches)
        else:
            trainer.load_source()
        report.first_step = trainer.steps_done
        end = trainer.steps_done + options.steps
        while trainer.steps_done < end:
            k = trainer.steps_done
            lr = learning_rate(options.schedule, options.lr, k, options.total_steps or end, options.warmup)
            batch = batches.next()
            started = time.perf_counter()
            scale = trainer.loss_scale.scale
            loss, norm = trainer.step(batch, lr)
            report.add_step(loss, lr, norm, time.perf_counter() - started, trainer.steps_done, end, progress,
                            scale if trainer.loss_scale.given else None, trainer.skipped)
            if checkpoint_due(options, trainer.steps_done, end):
                report.checkpoints.append(str(trainer.save(options.checkpoint, batches)))
        if options.trace:
            report.trace_events = job.stats().trace
    except MeshplanError:
        job.close()
        raise
    job.close()
    report.peak_rss_bytes = _gather_rss(world()[1], peak_rss_bytes())
    report.memory_estimates = [float(plan.stage_of_rank(r).memory_bytes) if plan.stage_of_rank(r) else 0.0
                               for r in range(job.size)]
    return report


def _gather_rss(comm, rss: int) -> list[int] | None:
    found = comm.gather(int(rss), root=0)
    return found if comm.Get_rank() == 0 else None
