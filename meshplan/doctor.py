"""What this machine (or every node of an MPI job) has for meshplan, and what is missing.

``local_facts`` looks at one process: the versions of meshplan and what it runs on, the
onnxruntime execution providers that really start a session, the MPI library mpi4py
loaded (vendor, version, CUDA-awareness) and the ``mpiexec`` found on PATH, the ILP
solvers python-mip can load, and the GPUs the driver shows. ``diagnose`` turns the facts
of one or many ranks (under mpiexec every rank gathers its own; rank 0 receives them all)
into ``problems`` — what the default path needs and lacks; ``meshplan doctor`` exits 1
with one line each — and ``warnings`` (what only an option needs: HiGHS, CUDA).

Nothing here raises for a missing piece: finding out is the point.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from meshplan.errors import MeshplanError
from meshplan.process_memory import heap_huge_pages
from meshplan.rank_layout import own_cores

# Launchers set these in every rank's environment: how a rank knows it was launched.
LAUNCHER_SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")
# Distributions that can provide the ``onnxruntime`` module, the GPU build first.
ORT_PACKAGES = ("onnxruntime-gpu", "onnxruntime")


@dataclass
class Facts:
    """One process's view of its machine."""

    rank: int = 0
    host: str = ""
    versions: dict = field(default_factory=dict)          # package → version ("" when missing)
    python: str = ""
    providers: dict = field(default_factory=dict)         # "CPU"/"CUDA" → None (usable) or why not
    mpi: dict = field(default_factory=dict)               # library, vendor, standard, cuda_aware, error
    mpiexec: dict = field(default_factory=dict)           # path, version (first line), error
    solvers: dict = field(default_factory=dict)           # "cbc"/"highs" → None (loads) or why not
    gpus: list = field(default_factory=list)              # names, in device order
    local_rank: int = 0
    gpu: int | None = None                                # the GPU this rank would use (runtime's rule)
    cores: list = field(default_factory=list)             # the cores it may run on (its affinity)
    cpu_count: int = 0                                    # its machine's cores
    threads: str = ""                                     # the onnxruntime threads a job would give it, and why
    pages: str = ""                                       # how its malloc'd memory is paged (huge pages or not)
    mps: bool = False                                     # a CUDA MPS control daemon runs for it (``mps_running``)


@dataclass
class Diagnosis:
    facts: list[Facts]                                    # one per rank (one without mpiexec)
    problems: list[str]
    warnings: list[str]
    launched: bool                                        # under an MPI launcher
    plan: dict | None = None                              # --plan: what it needs and whether the ranks fit

    def to_json(self) -> dict:
        return {"launched": self.launched, "ranks": [asdict(f) for f in self.facts], "plan": self.plan,
                "problems": self.problems, "warnings": self.warnings, "ok": not self.problems}


def launched_size() -> int | None:
    """The job size an MPI launcher announced in this process's environment, if any."""
    for name in LAUNCHER_SIZE_ENV:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _versions() -> dict:
    versions = {name: _version(name) for name in ("meshplan", "onnx", "numpy", "scipy", "mip", "highspy",
                                                  "mpi4py", "mpich", "click")}
    ort = next((name for name in ORT_PACKAGES if _version(name)), "onnxruntime")
    versions[ort] = _version(ort)
    return versions


def _providers() -> dict:
    from meshplan.providers import cuda_problem

    found: dict = {}
    try:
        import onnxruntime  # noqa: F401
    except Exception as exc:  # a broken install can fail in many ways
        why = f"onnxruntime does not import: {' '.join(str(exc).split())[:200]}"
        return {"CPU": why, "CUDA": why}
    found["CPU"] = _cpu_problem()
    found["CUDA"] = cuda_problem()
    return found


def _cpu_problem() -> str | None:
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from meshplan.model.opsets import DEFAULT_OPSET
    from meshplan.providers import session_options

    probe = helper.make_model(
        helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]),
        opset_imports=[helper.make_opsetid("", DEFAULT_OPSET)], ir_version=8,
    )
    try:
        ort.InferenceSession(probe.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises several unrelated exception types
        return f"no session starts on the CPU provider: {' '.join(str(exc).split())[:200]}"
    return None


def _mpi(launched: bool):
    """(facts about the MPI library, the MPI module or None)."""
    from meshplan.mpi_support import cuda_aware, load_mpi

    try:
        MPI = load_mpi()
    except MeshplanError as exc:
        return {"error": str(exc)}, None
    vendor, numbers = MPI.get_vendor()
    library = " ".join(MPI.Get_library_version().split("\n")[0].split())
    aware = cuda_aware(MPI)
    facts = {"library": library[:160], "vendor": f"{vendor} {'.'.join(map(str, numbers))}",
             "standard": "{}.{}".format(*MPI.Get_version()), "cuda_aware": aware["value"],
             "cuda_aware_method": aware["method"], "size": MPI.COMM_WORLD.Get_size()}
    return facts, MPI


def _mpiexec() -> dict:
    """The ``mpiexec`` on PATH (else the one installed beside this Python: the ``mpi``
    extra's, in a virtual environment that is not activated) and its version line."""
    path = shutil.which("mpiexec")
    on_path = path is not None
    beside = Path(sys.executable).parent / "mpiexec"
    if path is None and beside.is_file() and os.access(beside, os.X_OK):
        path = str(beside)
    if path is None:
        return {"error": "no mpiexec on PATH"}
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
        lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        text = next((line for line in lines if any(c.isdigit() for c in line)), lines[0] if lines else "")
    except (OSError, subprocess.TimeoutExpired) as exc:
        text = f"(--version failed: {exc})"
    return {"path": path, "version": " ".join(text.split())[:160], "on_path": on_path}


def local_facts(launched: bool = False):
    """This process's ``Facts`` and the MPI module (None when no MPI library loads)."""
    from meshplan.intra.ilp import SOLVERS, solver_problem
    from meshplan.profile.timing import gpu_names

    mpi, MPI = _mpi(launched)
    facts = Facts(
        rank=MPI.COMM_WORLD.Get_rank() if MPI else 0,
        host=MPI.Get_processor_name() if MPI else platform.node(),
        versions=_versions(),
        python=f"{platform.python_implementation()} {platform.python_version()} ({sys.executable})",
        providers=_providers(),
        mpi=mpi,
        mpiexec=_mpiexec(),
        solvers={name: solver_problem(name) for name in SOLVERS},
        gpus=gpu_names(),
        cores=sorted(own_cores()),
        cpu_count=os.cpu_count() or 0,
        pages=heap_huge_pages(),
        mps=mps_running(),
    )
    return facts, MPI


def mps_running() -> bool:
    """Whether a CUDA MPS control daemon runs for this process: its pipe directory
    (``CUDA_MPS_PIPE_DIRECTORY``, else the daemon's default) holds its control pipe."""
    return (Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps") / "control").exists()


def assign_threads(facts: list[Facts], machines: list[int]) -> None:
    """The onnxruntime threads each rank would get in a job where every rank works
    (``runtime.threads``: its own cores, a share of its machine's physical cores it binds
    itself to where the launcher bound none, spinning on one pool; or a share of its machine's
    with spinning off; physical cores as on this machine)."""
    from meshplan.runtime.threads import one_pool, plan_threads

    for f in facts:
        here = [g for g, m in zip(facts, machines) if m == machines[f.rank]]
        choice, _ = plan_threads([set(g.cores) for g in here], here.index(f), f.cpu_count or None, pin=True)
        f.threads = one_pool(choice, 1).describe()


def assign_gpus(facts: list[Facts], local_ranks: list[int]) -> None:
    """The GPU each rank would run on: its local rank modulo the GPUs its machine shows,
    as the runtime picks it."""
    for f, local in zip(facts, local_ranks):
        f.local_rank = local
        f.gpu = local % len(f.gpus) if f.gpus else None


def diagnose(facts: list[Facts], launched: bool, plan_needs: dict | None = None,
             layout_problem: str | None = None) -> Diagnosis:
    """Problems (what the default path lacks) and warnings, over every rank's facts.

    ``plan_needs``: {"ranks", "hosts", "devices_per_host", "directory"} of ``--plan``;
    ``layout_problem``: ``rank_layout.layout_mismatch``'s verdict for it."""
    problems: list[str] = []
    warnings: list[str] = []

    def add(target: list[str], text: str, ranks: list[int]) -> None:
        where = "" if len(facts) == 1 else f" (rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))})"
        line = text + where
        if line not in target:
            target.append(line)

    def per_rank(check) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        for f in facts:
            text = check(f)
            if text:
                found.setdefault(text, []).append(f.rank)
        return found

    def ort_missing(f: Facts) -> str | None:
        return None if any(f.versions.get(p) for p in ORT_PACKAGES) else "onnxruntime is not installed"

    for check, target in (
        (ort_missing, problems),
        (lambda f: f.providers.get("CPU"), problems),
        (lambda f: f.mpi.get("error"), problems),
        (lambda f: f.solvers.get("cbc"), problems),
        (lambda f: f.solvers.get("highs"), warnings),
        (lambda f: f"GPU(s) seen but not usable by onnxruntime: {f.providers['CUDA']}"
         if f.gpus and f.providers.get("CUDA") else None, warnings),
        (lambda f: f"{f.mpiexec['error']}: meshplan run needs a launcher (install meshplan[mpi], or put the "
                   "site MPI's mpiexec on PATH)" if "error" in f.mpiexec and not launched else None, problems),
        (lambda f: f"mpiexec is not on PATH (found {f.mpiexec['path']}; activate its environment)"
         if f.mpiexec.get("on_path") is False and not launched else None, warnings),
    ):
        for text, ranks in per_rank(check).items():
            add(target, text, ranks)

    # Every rank of one job must run the same software.
    for package in ("meshplan", *ORT_PACKAGES, "onnx", "mpi4py"):
        seen = {f.versions.get(package, "") for f in facts}
        if len(seen) > 1:
            problems.append(f"ranks run different {package} versions: {', '.join(sorted(v or 'none' for v in seen))}")
    libraries = {f.mpi.get("library") for f in facts if "library" in f.mpi}
    if len(libraries) > 1:
        problems.append("ranks loaded different MPI libraries: " + "; ".join(sorted(libraries)))

    announced = launched_size()
    if launched and announced and facts and "size" in facts[0].mpi and facts[0].mpi["size"] != announced:
        problems.append(f"the launcher started {announced} ranks but mpi4py's MPI sees a job of "
                        f"{facts[0].mpi['size']}: mpiexec and mpi4py belong to different MPI libraries "
                        f"({facts[0].mpi.get('library', '?')}; mpiexec {facts[0].mpiexec.get('path', '?')})")

    plan = None
    if plan_needs is not None:
        plan = dict(plan_needs)
        if not launched:
            plan["checked"] = False
            warnings.append(f"the plan needs {plan_needs['ranks']} rank(s) ({plan_needs['hosts']} host(s) x "
                            f"{plan_needs['devices_per_host']}): run `mpiexec -n {plan_needs['ranks']} meshplan "
                            f"doctor --plan ...` to check where they run")
        else:
            plan["checked"] = True
            if len(facts) != plan_needs["ranks"]:
                problems.append(f"the plan needs {plan_needs['ranks']} rank(s) "
                                f"({plan_needs['hosts']} host(s) x {plan_needs['devices_per_host']}); "
                                f"this job has {len(facts)}")
            elif layout_problem:
                problems.append(layout_problem)
            by_machine: dict[str, list[Facts]] = {}
            for f in facts:
                by_machine.setdefault(f.host, []).append(f)
            for host, ranks in by_machine.items():
                gpus = len(ranks[0].gpus)
                if gpus and len(ranks) > gpus:
                    warnings.append(f"{len(ranks)} ranks share {gpus} GPU(s) on {host}" + (
                        "" if all(f.mps for f in ranks) else
                        ": without CUDA MPS their kernels take turns on a GPU; start it (nvidia-cuda-mps-control -d) "
                        "to run them side by side (a 1x2 plan on one H200: 2.5 ms a token with it, 9.2-9.7 without)"))
                if not gpus and len(ranks) > 1 and not plan_needs.get("shared_host") \
                        and plan_needs.get("microbatches", 1) == 1:   # (pipelined stages work at once anyway)
                    warnings.append(f"{len(ranks)} ranks share the cores and memory of {host}, which the plan "
                                    "counts as devices of their own: `meshplan plan --shared-host` plans for ranks "
                                    "that share a machine (it leaves devices idle where splitting does not pay)")
            plan["fits"] = not any(p.startswith(("the plan needs", "the ranks are not laid out")) for p in problems)
    return Diagnosis(facts, problems, warnings, launched, plan)


def plan_needs(plan_dir: str | os.PathLike) -> dict:
    """What a plan directory asks of the job: ranks, hosts, devices per host."""
    from meshplan.plan_format import read_plan

    plan = read_plan(Path(plan_dir))
    hosts, per_host = (int(n) for n in plan.cluster["mesh"])
    return {"directory": str(plan_dir), "ranks": hosts * per_host, "hosts": hosts, "devices_per_host": per_host,
            "shared_host": bool(plan.cluster.get("host_shares")), "microbatches": plan.microbatches}
