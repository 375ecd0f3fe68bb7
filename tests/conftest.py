"""Shared helpers: planning a model into a temporary directory, running the CLI, mpiexec."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def meshplan_command() -> list[str]:
    """The installed console script when there is one, else the module."""
    script = BIN / "meshplan"
    return [str(script)] if script.exists() else [sys.executable, "-m", "cli.main"]


def mpiexec_path() -> str:
    found = shutil.which("mpiexec", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        raise RuntimeError("mpiexec not found: install the project (make test does) or put an MPI on PATH")
    return found


def run_cli(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([*meshplan_command(), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def run_mpi(ranks: int, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [mpiexec_path(), "-n", str(ranks), *meshplan_command(), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def run_mpi_script(name: str, ranks: int = 4, timeout: float = 180, args=()) -> list[str]:
    """Run tests/mpi_scripts/NAME (given ``args``) under mpiexec; it must exit 0. Its
    ``ok``/``FAIL`` lines (one per case, printed by rank 0), all of which must be ``ok``."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [mpiexec_path(), "-n", str(ranks), sys.executable, str(REPO / "tests" / "mpi_scripts" / name),
               *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok ", "FAIL"))]
    assert lines and all(line.startswith("ok ") for line in lines), report
    return lines


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    np.savez(path, **arrays)
    return path


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as archive:
        return {k: archive[k] for k in archive.files}


def assert_close(actual: dict, expected: dict, rtol: float | None = None, atol: float | None = None,
                 bounds: dict[str, float] | None = None) -> None:
    """Every output within the tolerance of its dtype (``meshplan verify``'s defaults), or
    ``rtol`` / ``atol`` where given, plus its quantization bound (``bounds``, from
    ``reference_with_bounds``: verify's rule); integer and bool outputs exactly."""
    from meshplan.runtime.inprocess import tolerance_for

    assert set(actual) == set(expected)
    for name, want in expected.items():
        out_rtol, out_atol = tolerance_for(want.dtype, rtol, atol)
        np.testing.assert_allclose(actual[name].astype(np.float64), want.astype(np.float64),
                                   rtol=out_rtol, atol=out_atol + (bounds or {}).get(name, 0.0), err_msg=name)


def check_against_onnxruntime(plan, plan_dir: Path, inputs: dict, tmp_path: Path, *run_options: str) -> str:
    """The plan's outputs equal onnxruntime on the original model: in-process, then under
    mpiexec with the plan's number of ranks (``meshplan run`` given ``run_options``).
    Returns what the run printed."""
    from meshplan.runtime.inprocess import reference_outputs, run_in_process

    expected = reference_outputs(plan, inputs)
    assert_close(run_in_process(plan, plan_dir, inputs), expected)
    in_path = save_npz(tmp_path / "in.npz", inputs)
    out_path = tmp_path / "out.npz"
    result = run_mpi(plan.num_ranks, "run", plan_dir, "--inputs", in_path, "--output", out_path, *run_options)
    assert result.returncode == 0, result.stderr
    assert "measured: latency" in result.stdout and "estimate: latency" in result.stdout
    assert_close(load_npz(out_path), expected)
    return result.stdout


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="session")
def llama_batch4(tmp_path_factory) -> Path:
    """The sample builder Llama planned for generation on 1x2 (heads and cache split over both
    ranks), 4 sequences, a context of 1024, calls of up to 16 positions: ``test_serve``'s
    server and ``test_job_failures``' generate."""
    from sample_models import SAMPLE_DIR

    out = tmp_path_factory.mktemp("llama_batch4")
    done = run_cli("plan", SAMPLE_DIR / "genai" / "llama_fp32" / "model.onnx", "--mesh", "1x2", "--generate",
                   "--max-length", "1024", "--prefill-chunk", "16", "--policy", "megatron", "--max-stages", "1",
                   "--batch", "4", "-o", out)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def _strip(data: dict) -> dict:
    """The plan less what differs from run to run: the solver's wall-clock seconds, the
    checksum over them, and where the model was read from."""
    data = dict(data, model={k: v for k, v in data["model"].items() if k != "path"})
    data.pop("checksum", None)

    def timeless(value):
        if isinstance(value, dict):
            return {k: timeless(v) for k, v in value.items() if not k.endswith("seconds")}
        return value

    data["solver"] = timeless(data["solver"])
    return data


def plan_digest(plan_dir: Path) -> str:
    """sha256 of the plan without its volatile fields; the programs' sha256 are in it."""
    data = json.loads((plan_dir / "plan.json").read_text())
    body = json.dumps(_strip(data), sort_keys=True, separators=(",", ":")).encode()
    for program in data["programs"]:
        files = [program["file"]] + [d["file"] for d in program.get("data_files", [])]
        for name in files:
            body += hashlib.sha256((plan_dir / name).read_bytes()).hexdigest().encode()
    return hashlib.sha256(body).hexdigest()


def sharded_signatures(model_path: Path, dims: dict, mesh: tuple[int, int], op_type: str, workdir: Path) -> list:
    """The profiler's sharded-variant signatures of ``op_type`` in the canonical model."""
    from meshplan.cost.cluster import make_cluster
    from meshplan.model.graph import build_graph
    from meshplan.model.load import canonicalize
    from meshplan.profile.signatures import collect_signatures
    from meshplan.profile.variants import sharded_variants

    canonical = canonicalize(model_path, dims, workdir)
    found = collect_signatures(build_graph(canonical.model), canonical.model, canonical.path.parent,
                               variants=sharded_variants(make_cluster(mesh, "cpu")))
    return [e for e in found.values() if e.signature.op_type == op_type and "model:variant" in e.sources]


def run_signature(entry) -> None:
    """Build ``entry``'s timing model, run it once on random float inputs, check the output shape."""
    import onnxruntime as ort

    from meshplan.profile.signatures import build_timing_model

    session = ort.InferenceSession(build_timing_model(entry.spec).SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal(i.shape).astype(np.float32) for i in session.get_inputs()}
    assert session.run(None, feeds)[0].shape == entry.signature.outputs[0][1]


# --- plans with their annotated.onnx, shared by the annotation, hint and show tests -------------

ANNOTATED_LLAMA = dict(layers=4, hidden=128, heads=4, ffn=352, vocab=512, max_seq=32)


class AnnotatedCase:
    """A model copied into its own directory (so that annotated.onnx, which refers to the
    model's files, can be put beside it) and planned."""

    def __init__(self, name: str, root: Path, mesh: tuple[int, int]):
        import onnx

        from meshplan.cost.cluster import load_cluster_file, make_cluster
        from meshplan.inter.pipeline import PlanOptions
        from meshplan.make_plan import make_plan
        from sample_models import SAMPLES
        from sample_models.llama import make_llama, save_llama

        self.name, self.mesh = name, mesh
        self.model_dir = root / "model"
        self.model_dir.mkdir(parents=True)
        if name == "gpt":
            self.model = self.model_dir / "gpt.onnx"
            shutil.copy(SAMPLES["gpt"].path, self.model)
            self.cluster = make_cluster(mesh, "h100-80g")
            self.dims = dict(SAMPLES["gpt"].dims)
        else:   # a Llama whose devices hold 40% of its weights: the memory forces stages and splits
            self.model = save_llama(self.model_dir / "llama.onnx", make_llama(**ANNOTATED_LLAMA))
            total = sum(onnx.numpy_helper.to_array(t).nbytes for t in onnx.load(str(self.model)).graph.initializer)
            toml = root / "cluster.toml"
            toml.write_text(f"hosts = {mesh[0]}\ndevices_per_host = {mesh[1]}\n[device]\npreset = 'h100-80g'\n"
                            f"memory_gb = {0.4 * total / 1024**3!r}\n")
            self.cluster = load_cluster_file(toml)
            self.dims = {"batch": 4, "seq": 16}
        self.options = PlanOptions(microbatches=2)
        self.plan_dir = root / "plan"
        self.plan = make_plan(self.model, self.cluster, self.dims, self.plan_dir, self.options)

    @property
    def id(self) -> str:
        return f"{self.name}-{self.mesh[0]}x{self.mesh[1]}"

    def inputs(self, batch: int | None = None) -> dict[str, np.ndarray]:
        vocab = 512
        rng = np.random.default_rng(7)
        shape = (batch or self.dims["batch"], self.dims["seq"])
        return {"input_ids": rng.integers(0, vocab, size=shape, dtype=np.int64)}


ANNOTATED_CASES = [("gpt", (1, 4)), ("gpt", (2, 2)), ("llama", (1, 4)), ("llama", (2, 2))]


@pytest.fixture(scope="session")
def annotated_cases(tmp_path_factory) -> dict[str, AnnotatedCase]:
    """The GPT sample and a memory-forced Llama, each on 1x4 and 2x2, planned once."""
    found = {}
    for name, mesh in ANNOTATED_CASES:
        case = AnnotatedCase(name, tmp_path_factory.mktemp(f"{name}{mesh[0]}x{mesh[1]}"), mesh)
        found[case.id] = case
    return found
