"""Every script in benchmarks/ at its smallest configuration, run as its user runs it (a
process of its own, from the repository root), so that none breaks unnoticed: it exits 0
and writes its numbers (its ``--json``). The sizes check the scripts' paths end to end,
they measure nothing (seconds a script on two cores; two ranks at most in the default run).

Where onnxruntime-genai is installed, the scripts that compare with it must have run it;
where it is not, they must say so and run their own rows."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BIN, REPO, run_cli

BENCHMARKS = REPO / "benchmarks"
SAMPLE = REPO / "sample_models" / "genai" / "llama_fp32"     # the 1 MB builder Llama
GENAI = importlib.util.find_spec("onnxruntime_genai") is not None
HARNESS = importlib.util.find_spec("lm_eval") is not None   # lm-evaluation-harness (lm_eval_check.py)
TIMEOUT = 300

pytestmark = pytest.mark.serial   # the scripts time what they run: apart from the parallel tests


def numbers(value) -> list[float]:
    """Every number in a JSON body."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers(v)]
    return []


def positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


# --- what each script's numbers must hold --------------------------------------------------------

def check_train(body, out, genai):
    rows = body["rows"]
    assert {"meshplan 1x1", "meshplan 1x2 data"} <= set(rows)
    for row in rows.values():
        if "plan" in row:
            assert positive(row["plan"]["estimate_seconds"])
        assert row["rounds"] and all(positive(*r["step_seconds"]) for r in row["rounds"])
    assert "torch rows skipped" in out or any(name.startswith("torch") for name in rows)


def check_stage_dp(body, out, genai):
    assert len(body) == 2 and all(positive(r["seconds"], r["objective"], r["stages"]) for r in body)


def check_reshard(body, out, genai):
    assert body["rows"] and all(positive(r["randomized_greedy"], r["lower_bound"]) for r in body["rows"])
    assert "PASSED" in out


def check_ilp_time(body, out, genai):
    assert [r["solver"] for r in body["rows"]] == ["cbc"] and positive(body["rows"][0]["seconds"])


def check_plan_quality(body, out, genai):
    rows = body["rows"] + body["small_batch_rows"]
    assert body["small_batch_rows"] and all(positive(r["latency_seconds"]["meshplan"]) for r in rows)
    assert all(r["never_worse"] for r in rows)


def check_alpa_gpt(body, out, genai):
    rows = body["rows"]
    assert [r["model"] for r in rows] == ["350M", "1.3B"]
    for row in rows:
        assert positive(row["step_seconds"], row["pflops"], row["plan_seconds"], row["memory_bytes_per_gpu"])
        assert len(row["submeshes"]) == row["stages"] and row["devices_used"] <= row["gpus"]
    assert rows[1]["gpus"] == 4 and "PFLOPS" in out


def check_plan_time(body, out, genai):
    assert [r["model"] for r in body["rows"]] == ["gpt-2"] and positive(body["rows"][0]["plan_seconds"])


def check_number_formats(body, out, genai):
    assert [r["mesh"] for r in body] == ["1x2"] and positive(body[0]["seconds"], body[0]["latency_seconds"])


def check_profile_accuracy(body, out, genai):
    (row,) = body["rows"]
    assert row["cost_model"] == "profiled"
    assert positive(row["estimate_latency_seconds"], row["measured_latency_seconds"])


def check_resident(body, out, genai):
    assert [r["call"] for r in body["rows"]] == ["decode", "full batch"]
    assert all(positive(r["call_seconds"], r["one_launch_seconds"], r["onnxruntime_one_device_seconds"])
               for r in body["rows"])


def check_large_model(body, out, genai):
    (row,) = body["rows"]
    assert "error" not in row and positive(row["plan_seconds"], row["peak_rss_bytes"], row["written_bytes"])
    assert len(row["ranks"]) == 2 and positive(row["verify_stages_peak_rss_bytes"])


def check_emulated_cluster(body, out, genai):
    assert len(body["rows"]) == 40 and all(positive(r["measured_ms"], r["simulated_ms"]) for r in body["rows"])


def check_emulated_pipeline(body, out, genai):
    (row,) = body["rows"]
    assert row["microbatches"] == 2 and positive(row["estimate_seconds"], row["measured_seconds"])
    assert len(row["busy_fractions"]) == 2 and all(0 < b <= 1 for b in row["busy_fractions"])
    assert "SMOKE | measured step within 25% of the estimate" in out


def check_segment_pools(body, out, genai):
    assert [r["runner"] for r in body["rows"]] == ["one pool", "not spinning", "spinning"]
    assert all(positive(r["median_ms"]) for r in body["rows"])


def check_small_batch_split(body, out, genai):
    (row,) = body["rows"]
    assert row["mesh"] == "1x2" and positive(row["measured_ms"], row["alone_ms"]) and row["threads"]


def check_pipeline_memory(body: dict, out: str, genai: bool) -> None:
    schedules = body["schedules"]
    for kind in ("1f1b", "gpipe"):
        ranks = schedules[kind]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1, 2]
        assert all(r["peak_rss_mib"] > 0 and r["estimate_mib"] > 0 for r in ranks)
        assert sorted(schedules[kind]["stage_devices"]) == [1, 2] and schedules[kind]["estimate_seconds"] > 0
    assert schedules["1f1b"]["losses"] == pytest.approx(schedules["gpipe"]["losses"], rel=1e-5)
    assert schedules["1f1b+recompute"]["losses"] == pytest.approx(schedules["1f1b"]["losses"], rel=1e-5)
    assert "1F1B over GPipe" in out and "1F1B recomputing over 1F1B" in out


def check_mixed_precision(body: dict, out: str, genai: bool) -> None:
    rows = body["rows"]
    assert sorted(rows) == ["float16", "float16+masters", "float32"]
    for row in ("float32", "float16+masters"):
        assert rows[row]["finite"] and len(rows[row]["losses"]) == body["steps"]
        assert rows[row]["step_seconds"] > 0 and rows[row]["peak_rss_mib"] and rows[row]["estimate_mib"]
    # float32 masters train as the float32 model does, within float16's rounding of the forward
    assert rows["float16+masters"]["max_relative_to_float32"] < 1e-2
    assert rows["float16+masters"]["plan_bytes_per_parameter"] == pytest.approx(
        rows["float32"]["plan_bytes_per_parameter"], rel=0.05)
    assert "float16+masters" in out and "max |Δ|/fp32" in out


def check_step_overhead(body, out, genai):
    assert positive(body["onnxruntime_us"], body["job_us"], body["loop_us"])
    assert positive(body["genai_us"]) if genai else "onnxruntime-genai" in out and "not installed" in out


def check_request_sequence(body, out, genai):
    assert len(body["job"]) == len(body["alone"]) == 2 and all(positive(*r) for r in body["job"])
    assert positive(*body["alone"])


def check_decode_phases(body, out, genai):
    # (meshplan's step is a difference of two generations' times: of any sign at these sizes)
    assert math.isfinite(body["meshplan"]["step"]) and positive(body["onnxruntime alone"]["step"])
    assert body["first request"] and all(positive(v) for v in body["first request"].values())


def check_decode_blocks(body, out, genai):
    assert list(body["runners"]) == (["genai"] if genai else []) + ["onnxruntime", "1x2"]
    assert all(positive(r["median_step_s"]) for r in body["runners"].values())
    assert genai or "onnxruntime-genai is not installed" in out


def check_generate(body, out, genai):
    runners = [r["runner"] for r in body["rows"]]
    assert runners == ["meshplan generate 1x1", "meshplan generate 1x2"] + (
        ["onnxruntime-genai, 2 threads"] if genai else [])
    assert all(positive(r["ttft_s"], r["decode_tokens_per_s"]) and r["same_ids_as_first"] for r in body["rows"])
    assert genai or "onnxruntime-genai is not installed" in out


def check_serve(body, out, genai):
    servers = ["continuous", "continuous-logprobs"] + (["genai-one"] if genai else [])
    assert [r["server"] for r in body] == servers + ["generate"]
    served = body[:len(servers)]
    assert all(r["failed"] == 0 and positive(r["output_tokens"], r["tokens_per_s"], r["ttft_p50_s"]) for r in served)
    assert positive(served[0]["tpot_metrics_p50_s"], served[1]["tpot_metrics_p50_s"], body[-1]["decode_step_s"])
    assert "the server's time per output token p50 (/metrics) / that step" in out and "logprobs = 2 / without" in out
    assert genai or "genai-one      skipped: onnxruntime-genai is not installed" in out


def check_lm_eval(body, out, genai):
    assert body["meshplan_choice"]["requests"] == 8 and body["meshplan_choice"]["largest_difference"] < 1e-4
    assert body["meshplan_until"]["requests"] == 2 and body["meshplan_until"]["texts_differ"] == 0
    assert "every answer equals onnxruntime's" in out


# script: (arguments, the check of its --json body and output, marks); {work} (a folder) and
# {plan} (a 1x1 generation plan of the builder sample) are filled in; --json PATH is added
CASES = {
    "stage_dp": ([], check_stage_dp, ()),
    "reshard": (["--quick", "--trials", "2", "--dfs-nodes", "100"], check_reshard, ()),
    "ilp_time": (["--layers", "2", "--mesh", "1x2", "--solvers", "cbc"], check_ilp_time, ()),
    "plan_quality": (["--layers", "1", "--meshes", "1x2", "--small-layers", "1", "--small-meshes", "1x1", "1x2"],
                     check_plan_quality, ()),
    # the gpt2 rows need torch (skipped with a line without it); the 70B row's 80 layers take long
    "plan_time": (["--rows", "gpt", "gpt2", "--gpt-layers", "2", "--meshes", "1x2"], check_plan_time, ()),
    # two of Alpa's GPT shapes cut to two layers, a short sequence and a small batch
    "alpa_gpt": (["--models", "350M", "1.3B", "--layers", "2", "--batch", "16", "--seq", "64", "--microbatches", "4"],
                 check_alpa_gpt, ()),
    "number_formats": (["--smoke", "--meshes", "1x2", "--layers", "2"], check_number_formats, ()),
    "profile_accuracy": (["--models", "mlp", "--meshes", "1x2", "--repeat", "2", "--no-analytic"],
                         check_profile_accuracy, (pytest.mark.mpi,)),
    "resident": (["--mesh", "1x2", "--calls", "2", "--launches", "1", "--past", "32"], check_resident,
                 (pytest.mark.mpi,)),
    "large_model": (["--smoke", "--mesh", "1x2", "--batch", "1", "--seq", "16", "--run", "--work", "{work}"],
                    check_large_model, (pytest.mark.mpi,)),
    # slow: four ranks (two emulated hosts of two; the default run starts two at most) and root
    "emulated_cluster": (["--smoke"], check_emulated_cluster, (pytest.mark.mpi, pytest.mark.slow)),
    # slow: two emulated hosts (root), a profile, a plan and a pipelined training run across them
    "emulated_pipeline": (["--smoke"], check_emulated_pipeline, (pytest.mark.mpi, pytest.mark.slow)),
    "segment_pools": (["--blocks", "1", "--steps", "2", "--pause", "0"], check_segment_pools, ()),
    "small_batch_split": (["--meshes", "1x2", "--rounds", "1", "--repeat", "2", "--cores"], check_small_batch_split,
                          (pytest.mark.mpi,)),
    # three pipelined training plans of a tiny GPT in two stages of 3 devices (one of them two
    # replicas), each trained a step by three ranks
    "pipeline_memory": (["--mpi", "--stages", "2", "--devices", "3", "--microbatches", "4", "--batch", "8", "--layers",
                         "2", "--hidden", "64", "--vocab", "256", "--seq", "16", "--steps", "1", "--workdir", "{work}"],
                        check_pipeline_memory, (pytest.mark.mpi,)),
    "step_overhead": (["--steps", "3", "--rounds", "1", "--capacity", "32"], check_step_overhead, ()),
    # a tiny GPT in float32, in float16 and in float16 with float32 masters, each trained 4 steps
    "mixed_precision": (["--smoke"], check_mixed_precision, (pytest.mark.mpi,)),
    "request_sequence": (["{plan}", "--requests", "2", "--new-tokens", "2", "--prompt-length", "4"],
                         check_request_sequence, ()),
    "decode_phases": (["{plan}", "--new-tokens", "2", "--prompt-length", "4", "--rounds", "1", "--replays", "5",
                       "--floor", "--first-requests", "1"], check_decode_phases, ()),
    # (1x1's runner is 1x2's on one rank)
    "decode_blocks": (["--folder", str(SAMPLE), "--workdir", "{work}", "--runners", "genai,onnxruntime,1x2",
                       "--blocks", "1", "--steps", "2", "--pause", "0", "--capacity", "64"], check_decode_blocks,
                      (pytest.mark.mpi,)),
    "generate": (["--folders", f"fp32={SAMPLE}", "--workdir", "{work}", "--max-length", "32", "--prompt-length", "4",
                  "--new-tokens", "2", "--repeat", "1"], check_generate, (pytest.mark.mpi,)),
    # slow: three training plans of a tiny GPT (one of them the ILP over a 1x2 mesh) and their runs
    "train": (["--smoke"], check_train, (pytest.mark.mpi, pytest.mark.slow)),
    # (meshplan-one is continuous's server on a plan of batch 1)
    "serve": (["--folder", str(SAMPLE), "--workdir", "{work}", "--only", "continuous", "--only", "genai-one",
               "--only", "continuous-logprobs", "--logprobs", "2", "--generate-rounds", "1", "--max-length", "32", "--batch", "2", "--clients", "2", "--requests", "4", "--prompt-lengths", "4:8",
               "--new-tokens", "2:4"], check_serve, (pytest.mark.mpi,)),
    # where lm-evaluation-harness is not installed (it is no dependency): one line, exit 2
    "lm_eval_check": (["--workdir", "{work}", "--documents", "2", "--mesh", "1x1", "--bin", str(BIN)],
                      check_lm_eval, (pytest.mark.mpi,)),
}


@pytest.fixture(scope="module")
def generation_plan(tmp_path_factory):
    """A 1x1 generation plan of the builder sample (decode_phases.py and request_sequence.py take one)."""
    plan_dir = tmp_path_factory.mktemp("bench") / "plan"
    done = run_cli("plan", SAMPLE / "model.onnx", "--mesh", "1x1", "--device", "cpu", "--generate",
                   "--max-length", "32", "-o", plan_dir)
    assert done.returncode == 0, done.stderr
    return plan_dir


def test_every_script_has_a_case():
    assert sorted(p.stem for p in BENCHMARKS.glob("*.py")) == sorted(CASES)


def test_gpu_suite_parses():
    done = subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu_suite.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def run_case(script: str, tmp_path: Path, request, genai: bool = GENAI) -> None:
    """Run the script's case; where ``genai`` is False, with onnxruntime-genai hidden from
    it (a ``sitecustomize`` that makes its import fail)."""
    arguments, check, _ = CASES[script]
    out = tmp_path / "out.json"
    places = {"{work}": str(tmp_path / "work")}
    if "{plan}" in arguments:
        places["{plan}"] = str(request.getfixturevalue("generation_plan"))
    command = [sys.executable, str(BENCHMARKS / f"{script}.py"), *(places.get(a, a) for a in arguments),
               "--json", str(out)]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if not genai and GENAI:
        hidden = tmp_path / "hidden"
        hidden.mkdir()
        (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['onnxruntime_genai'] = None\n")
        env["PYTHONPATH"] = os.pathsep.join([str(hidden), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO, env=env)
    said = f"{' '.join(command)}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == 0, said
    assert out.is_file(), said
    body = json.loads(out.read_text())
    assert numbers(body), said
    try:
        check(body, done.stdout + done.stderr, genai)
    except (AssertionError, KeyError, TypeError, ValueError) as exc:
        raise AssertionError(f"{type(exc).__name__}: {exc}\n{said}") from exc


@pytest.mark.parametrize("script", [pytest.param(name, marks=marks) for name, (_, _, marks) in CASES.items()])
def test_smallest_configuration(script, tmp_path, request):
    if script in ("emulated_cluster", "emulated_pipeline"):
        from meshplan.testing.emulated_cluster import unavailable_reason

        reason = unavailable_reason()
        if reason:
            pytest.skip(f"no emulated cluster here: {reason}")
    if script == "lm_eval_check" and not HARNESS:
        done = subprocess.run([sys.executable, str(BENCHMARKS / "lm_eval_check.py"), "--json", str(tmp_path / "o")],
                              capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [
            "lm-evaluation-harness is not installed here: pip install 'lm-eval[api]' (see --help)"], done.stderr
        assert not (tmp_path / "o").exists()
        return
    run_case(script, tmp_path, request)


# The scripts that compare with onnxruntime-genai again, with it hidden: each says so in one
# line and runs its own rows (slow: a minute more, for the path of a machine without it).
@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("script", ["step_overhead", "decode_blocks", "generate", "serve"])
def test_without_onnxruntime_genai(script, tmp_path, request):
    run_case(script, tmp_path, request, genai=False)
