"""``meshplan generate`` under mpiexec: a driver of the resident job.

Every rank loads its program once (``Job``); rank 0 tokenizes, runs the loop
(``loop.Generation``) with each call a ``Job.run`` that brings it only the last
positions' logits, chooses the tokens and feeds them back; the key/value cache is state
and stays on the ranks that hold its heads. The other ranks serve. Rank 0 returns a
``GenerateReport``: the sequences, the timings, and each rank's weight and cache bytes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshplan.errors import RunError
from meshplan.generation.loop import Generation, GenerationShape, Metrics, Sequence
from meshplan.generation.sampling import Sampler
from meshplan.model.llm import ModelFolder
from meshplan.runtime.threads import ThreadChoice

# Decode steps of the warm-up where decode steps become CUDA graphs: a step's shapes get a graph
# id at their second run and onnxruntime's CUDA provider captures an id at its third run, so the
# fourth step captures and the fifth replays: the capture (milliseconds) is then the load's, not
# the first request's.
GRAPH_WARM_UP_STEPS = 5


def warm_up_steps(job, graphs: bool) -> int:
    """Decode steps a warm-up runs: enough to capture the decode step's graph where the job
    replays graphs (CUDA), else one."""
    from meshplan.providers import CUDA

    return GRAPH_WARM_UP_STEPS if graphs and job.provider == CUDA else 1


class JobStepper:
    """The job as a stepper: the cache stays on the ranks between calls. The logits a step
    returns are valid until the next step (``Job.run(copy=False)``): the generation loop and
    the server choose from them at once."""

    def __init__(self, job):
        self.job = job
        self._outputs: dict[int, dict] = {}    # the outputs asked for, by last positions: the same object each
                                               # step, so the job reads it once (``Job._wanted``)
        self._chosen: dict[int, dict] = {}     # … of the greedy ids (``choose``)
        self._scored: dict[int, dict] = {}     # … of the top log-probabilities (``score``)

    @property
    def chooses(self) -> bool:
        """Whether the job chooses greedy ids next to its logits (``Job.chosen``: on a GPU)."""
        return self.job.chosen is not None

    @property
    def scores(self) -> bool:
        """Whether the job scores its logits where they are (``Job.scorer``: where it chooses)."""
        return self.job.scorer is not None

    def reset(self) -> None:
        self.job.reset_state()

    @property
    def row_calls(self) -> bool:
        return self.job.row_calls

    @property
    def copies_rows(self) -> bool:
        """Whether ``copy_rows`` works (what ``row_calls`` needs)."""
        from meshplan.runtime.buffers import HOST

        return self.job.row_calls and self.job.state_buffers is HOST

    def copy_rows(self, source: int, target: int, positions: int) -> None:
        self.job.copy_rows(source, target, positions)

    def step(self, feeds: dict[str, np.ndarray], last: int, row: int | None = None) -> np.ndarray:
        outputs = self._outputs.get(last)
        if outputs is None:
            outputs = self._outputs[last] = {"logits": np.s_[:, -last:]}
        return self.job.run(feeds, outputs=outputs, row=row, copy=False)["logits"]

    def choose(self, feeds: dict[str, np.ndarray], last: int, row: int | None = None) -> np.ndarray:
        """The greedy ids of the call's ``last`` positions ([batch, last]), chosen where the
        logits are: only the ids reach the host."""
        name = self.job.chosen
        outputs = self._chosen.get(last)
        if outputs is None:
            outputs = self._chosen[last] = {name: np.s_[:, -last:]}
        return self.job.run(feeds, outputs=outputs, row=row, copy=False)[name]

    def score(self, feeds: dict[str, np.ndarray], last: int, row: int | None = None):
        """The greedy ids of the call's ``last`` positions ([batch, last]) and the top
        log-probabilities there (``TopScores``, a row per position), both computed where the
        logits are: only k values and ids per position reach the host."""
        from meshplan.generation.scoring import TopScores

        top, ids = self.job.scorer.outputs
        outputs = self._scored.get(last)
        if outputs is None:
            outputs = self._scored[last] = {top: np.s_[:, -last:], ids: np.s_[:, -last:]}
        found = self.job.run(feeds, outputs=outputs, row=row, copy=False)
        return found[ids][..., 0], TopScores(found[top], found[ids])


class TextStream:
    """One sequence's text as its ids come, decoded a few tokens at a time: the text of the
    ids since an earlier boundary, less what that window gave before, so each step costs
    the same however long the sequence (a token that ends inside a multi-byte character
    waits for the next). The pieces put together are the decoded sequence."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0    # the window starts at prefix; up to read is streamed

    @property
    def count(self) -> int:
        return len(self.ids)

    def add(self, ids) -> str:
        """The new text that ``ids`` (the tokens after those added before) complete."""
        self.ids.extend(int(i) for i in ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """What is left once the sequence has ended (a character left incomplete)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


@dataclass
class Request:
    """What to generate: prompts as text (``texts``) or token ids (``ids``)."""

    texts: list[str] = field(default_factory=list)
    ids: list[list[int]] = field(default_factory=list)
    max_new_tokens: int = 32
    sampler: Sampler = field(default_factory=Sampler)
    eos: list[int] | None = None           # None: the model folder's
    tokenizer: str | Path | None = None    # a folder or file; None: the model folder's


@dataclass
class GenerateReport:
    sequences: list[Sequence]
    metrics: Metrics
    ranks: int
    weight_bytes: list[int]      # per rank: its program's files
    cache_bytes: list[int]       # per rank: the key/value cache it holds
    eos: list[int]
    threads: list = field(default_factory=list)   # per rank: its ThreadChoice (None: idle)
    load_seconds: float = 0.0          # from the start to a warm job (loading, a warm-up call)
    estimate_seconds: float = 0.0      # the plan's estimate of a decode step (at a full cache)
    graphs: dict | None = None         # on CUDA: rank 0's CUDA graphs (``ProgramRunner.graphs``)
    token_choice: str = "host"         # where a greedy token is chosen: "device" (next to the logits) or "host"

    def to_dict(self) -> dict:
        metrics = self.metrics.to_dict()
        metrics["token_choice"] = self.token_choice
        metrics["load_seconds"] = self.load_seconds
        metrics["estimate_step_seconds"] = self.estimate_seconds
        if self.graphs is not None:
            metrics["cuda_graphs"] = self.graphs
        metrics["ranks"] = [{"rank": r, "weight_bytes": w, "kv_cache_bytes": c,
                             **({"threads": t.threads, "spinning": t.spinning, "one_pool": t.shared_pool,
                                 "threads_why": t.why} if t else {})}
                            for r, (w, c, t) in enumerate(zip(self.weight_bytes, self.cache_bytes,
                                                              self.threads or [None] * len(self.weight_bytes)))]
        return {"sequences": [{"prompt_ids": s.prompt_ids, "ids": s.ids, "text": s.text} for s in self.sequences],
                "metrics": metrics}


def load_tokenizer(path: str | Path):
    """A ``tokenizers`` tokenizer from ``tokenizer.json`` (or a folder holding one)."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise RunError(f"no tokenizer.json in {path}", hint="give --tokenizer DIR, or token ids with --prompt-ids")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise RunError("the tokenizers library is not installed", hint="pip install tokenizers") from None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:
        raise RunError(f"cannot read tokenizer {file}: {str(exc).splitlines()[0] if str(exc) else exc}") from None


def read_prompt_ids(path: str | Path) -> list[list[int]]:
    """A JSON list of token-id lists."""
    path = Path(path)
    if not path.is_file():
        raise RunError(f"prompt ids file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise RunError(f"cannot read {path}: not JSON ({exc})") from None
    if not isinstance(data, list) or not all(isinstance(row, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                                              for t in row) for row in data):
        raise RunError(f"{path} must hold a JSON list of token-id lists, like [[1, 2, 3]]")
    return data


@dataclass
class Prepared:
    """A request checked against the plan on rank 0, before any rank runs."""

    shape: GenerationShape
    prompts: list[list[int]]
    eos: list[int]
    pad_id: int
    tokenizer: object | None


def prepare(plan, request: Request) -> Prepared:
    """Tokenize and check a request against the plan (one ``RunError`` line for what the plan
    cannot generate)."""
    shape = GenerationShape.of_plan(plan)
    folder = ModelFolder.read(plan.model["path"])
    tokenizer = None
    if request.texts and request.ids:
        raise RunError("give prompts as text or as token ids, not both")
    if request.texts:
        source = request.tokenizer or folder.tokenizer
        if source is None:
            raise RunError(f"no tokenizer beside the model ({folder.path}) to encode --prompt",
                           hint="give --tokenizer DIR, or token ids with --prompt-ids")
        tokenizer = load_tokenizer(source)
        prompts = [tokenizer.encode(text).ids for text in request.texts]
    elif request.tokenizer is not None:
        tokenizer = load_tokenizer(request.tokenizer)
        prompts = request.ids
    else:
        prompts = request.ids
        if folder.tokenizer is not None:
            tokenizer = load_tokenizer(folder.tokenizer)
    if shape.vocab is None and folder.vocab_size:
        shape.vocab = folder.vocab_size
    eos = list(request.eos) if request.eos is not None else list(folder.eos_ids)
    pad = folder.pad_id if folder.pad_id is not None else (eos[0] if eos else 0)
    Generation(shape, None, pad).check(prompts, request.max_new_tokens)
    return Prepared(shape, prompts, eos, pad, tokenizer)


def generate_rank(plan_dir: str | Path, request: Request, provider: str = "auto", transfer: str = "auto",
                  on_text=None, output_path: str | Path | None = None, graphs: bool = True) -> GenerateReport | None:
    """Every rank: load the job; rank 0 generates and returns the report, the others serve
    and return None. ``on_text(text)`` on rank 0 streams a single sequence's text as its
    tokens come (``on_text`` gets the ids of every sequence otherwise: ``on_text(None,
    step, ids)``)."""
    from meshplan.providers import CUDA
    from meshplan.runtime.job import Job, driving
    from meshplan.runtime.mpi_runner import _gather_memory
    from meshplan.runtime.transport import world

    plan_dir = Path(plan_dir)
    held: dict = {}
    loading = time.perf_counter()

    def check(plan) -> None:
        if output_path is not None:
            out = Path(output_path)
            if out.suffix != ".json":
                raise RunError(f"output file must end in .json: {out}")
            if not out.parent.is_dir():
                raise RunError(f"output directory does not exist: {out.parent}")
        held["prepared"] = prepare(plan, request)

    job = Job(plan_dir, provider, transfer, check=check, cache_in_place=True, graphs=graphs, choose=None)
    if not job.is_driver:
        job.serve()
        _gather_memory(job.plan, plan_dir, world()[1], job.threads)
        return None
    prepared: Prepared = held["prepared"]
    tokenizer = prepared.tokenizer
    stream = TextStream(tokenizer) if tokenizer is not None else None

    def on_tokens(step, ids, sequences):
        if on_text is None:
            return
        if len(sequences) == 1 and stream is not None:
            text = stream.add(sequences[0].ids[stream.count:])
            if text:
                on_text(text)
        else:
            on_text(None, step, ids)

    # (the workers gather each rank's memory once the job has closed, whatever closed it)
    with driving(job, closed=lambda: _gather_memory(job.plan, plan_dir, world()[1], job.threads)):
        generation = Generation(prepared.shape, JobStepper(job), prepared.pad_id)
        # a warm-up of the prompts' prefill and a decode step (on CUDA with graphs, until the
        # step's graph is captured: ``warm_up_steps``), so that the first token's time is not the
        # process's start-up (kernels loaded at their first use, the allocator's first blocks, a
        # prefill shape's first run: 55 ms of a 0.4 B model's on an H200 where a one-token
        # warm-up was used), at most one prefill call of each (a long prompt's first piece has
        # the longest call's shape); the load is reported apart
        pieces = [prompt[:prepared.shape.chunk] for prompt in prepared.prompts]
        room = prepared.shape.context - max(len(piece) for piece in pieces)
        generation.run(pieces, max(1, min(1 + warm_up_steps(job, graphs), room)), Sampler(), ())
        load_seconds = time.perf_counter() - loading
        sequences, metrics = generation.run(prepared.prompts, request.max_new_tokens, request.sampler,
                                            prepared.eos, on_tokens)
        rest = stream.finish() if on_text is not None and len(sequences) == 1 and stream is not None else ""
        if rest:
            on_text(rest)
        stats = job.stats()
        job.close()
    memory = _gather_memory(job.plan, plan_dir, world()[1], job.threads)
    if tokenizer is not None:
        for sequence in sequences:
            sequence.text = tokenizer.decode(sequence.ids, skip_special_tokens=True)
    report = GenerateReport(sequences, metrics, job.size, [int(m) for m in memory[:, 1]],
                            [int(b) for b in stats.state_bytes], prepared.eos,
                            [ThreadChoice.from_row(row[2:]) if row[2] else None for row in memory],
                            load_seconds, float(job.plan.estimate["latency_seconds"]),
                            job.session.graphs if job.session is not None and job.provider == CUDA else None,
                            "device" if job.chosen is not None and request.sampler.greedy else "host")
    if output_path is not None:
        from meshplan.files import atomic_write_bytes

        atomic_write_bytes(Path(output_path), (json.dumps(report.to_dict(), indent=1) + "\n").encode())
    return report
