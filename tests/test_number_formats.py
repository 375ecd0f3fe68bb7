"""Llama-style decoders in the number formats large models ship in — float16, int8 weights
(per-axis DequantizeLinear) and int4 weights (onnxruntime's MatMulNBits quantizer) — on
1x4 devices that each hold 40% of the parameter bytes: the plan fits, no rank's program
holds more than 60% of them, and the outputs match onnxruntime in-process and under
mpiexec within the output dtype's tolerance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from meshplan.cost.cluster import load_cluster_file, make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from sample_models.llama import make_llama, save_llama, write_llama_int4
from tests.conftest import check_against_onnxruntime

SIZE = dict(layers=4, hidden=128, heads=4, ffn=352, vocab=512, max_seq=32)
DIMS = {"batch": 4, "seq": 16}


def _write(fmt: str, directory: Path) -> Path:
    path = directory / f"llama_{fmt}.onnx"
    if fmt == "int4":
        return write_llama_int4(path, **SIZE)
    if fmt == "int8":
        return save_llama(path, make_llama(**SIZE, weights="int8"))
    return save_llama(path, make_llama(**SIZE, dtype=fmt))


def parameter_bytes(model_path: Path) -> int:
    """Bytes of the model's initializers (its parameters, as stored)."""
    model = onnx.load(str(model_path), load_external_data=True)
    return sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def program_bytes(plan_dir: Path, program) -> int:
    model = onnx.load(str(plan_dir / program.file), load_external_data=True)
    return sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def cluster_holding(fraction: float, total: int, tmp_path: Path, mesh=(1, 4)):
    path = tmp_path / "cluster.toml"
    path.write_text(f"hosts = {mesh[0]}\ndevices_per_host = {mesh[1]}\n[device]\npreset = 'h100-80g'\n"
                    f"memory_gb = {fraction * total / 1024**3!r}\n")
    return load_cluster_file(path)


@pytest.mark.mpi
@pytest.mark.parametrize("fmt", ["float16", "int8", "int4"])
def test_llama_formats_on_devices_holding_40_percent(fmt, tmp_path):
    path = _write(fmt, tmp_path)
    total = parameter_bytes(path)
    plan_dir = tmp_path / "plan"
    plan = make_plan(path, cluster_holding(0.4, total, tmp_path), DIMS, plan_dir, PlanOptions(microbatches=2))
    held = {p.rank: program_bytes(plan_dir, p) for p in plan.programs}
    assert max(held.values()) <= 0.6 * total, (held, total)
    inputs = make_inputs_for(path)
    check_against_onnxruntime(plan, plan_dir, inputs, tmp_path)


def make_inputs_for(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"input_ids": rng.integers(0, SIZE["vocab"], size=(DIMS["batch"], DIMS["seq"]), dtype=np.int64)}


# Large enough that matrix products, not per-operator launch costs, set the stage times.
EIGHT_LAYERS = dict(layers=8, hidden=512, heads=8, ffn=1408, vocab=2048, max_seq=128)


def _llama_plan(dtype: str, tmp_path: Path):
    path = save_llama(tmp_path / f"llama8_{dtype}.onnx", make_llama(**EIGHT_LAYERS, dtype=dtype))
    plan_dir = tmp_path / f"plan_{dtype}"
    plan = make_plan(path, make_cluster((1, 4), "h100-80g"), {"batch": 16, "seq": 128}, plan_dir,
                     PlanOptions(microbatches=4))
    return plan, plan_dir


def test_float16_decoder_pipelines_without_casting_weights(tmp_path):
    """8 float16 layers on 1x4 with 4 microbatches: no program casts a weight, no stage sits
    near idle, and the float16 plan is estimated at least as fast as the float32 one."""
    plan, plan_dir = _llama_plan("float16", tmp_path)
    for program in plan.programs:
        model = onnx.load(str(plan_dir / program.file), load_external_data=False)
        weights = {t.name for t in model.graph.initializer}
        cast_weights = [n.name for n in model.graph.node if n.op_type == "Cast" and n.input[0] in weights]
        assert not cast_weights, (program.file, cast_weights)
    seconds = plan.estimate["stage_seconds"]
    assert min(seconds) >= 0.25 * max(seconds), seconds
    fp32, _ = _llama_plan("float32", tmp_path)
    assert plan.estimate["throughput_per_second"] >= fp32.estimate["throughput_per_second"]
