"""Models shaped like fresh torch exports (``sample_models.structures``): with a static
batch they plan with microbatches (Resize and a batch-position GatherND keep the batch
apart) and compute what onnxruntime computes, in-process and under mpiexec."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from sample_models.structures import make_encoder_decoder, make_unet_like
from tests.conftest import check_against_onnxruntime


def _save(model: onnx.ModelProto, path):
    onnx.save_model(model, str(path))
    return path


def _feeds(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            feeds[value.name] = rng.integers(0, 200, shape).astype(np.int64)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@pytest.mark.mpi
@pytest.mark.parametrize("make", [make_unet_like, make_encoder_decoder], ids=["unet_like", "encoder_decoder"])
def test_static_batch_export_plans_with_two_microbatches(make, tmp_path):
    model = make(batch=4)
    path = _save(model, tmp_path / "model.onnx")
    plan_dir = tmp_path / "plan"
    plan = make_plan(path, make_cluster((1, 2), "cpu"), {}, plan_dir, PlanOptions(microbatches=2, all_devices=True))
    assert plan.microbatches == 2 and plan.batch["microbatch_size"] == 2
    check_against_onnxruntime(plan, plan_dir, _feeds(model, 1), tmp_path)


def test_static_batch_resize_and_gather_nd_split_the_batch(tmp_path):
    """Data parallel on 1x2 at one microbatch: the Resize and the GatherND split the batch
    (the plan's strategies say so) and the results match in-process."""
    from meshplan.runtime.inprocess import reference_outputs, run_in_process
    from tests.conftest import assert_close

    for make, node in ((make_unet_like, "up/resize"), (make_encoder_decoder, "decoder/last")):
        model = make(batch=4)
        path = _save(model, tmp_path / f"{node.split('/')[0]}.onnx")
        plan_dir = tmp_path / f"plan-{node.split('/')[0]}"
        plan = make_plan(path, make_cluster((1, 2), "cpu"), {}, plan_dir,
                         PlanOptions(policy="data", all_devices=True))
        strategies = {name: s for stage in plan.stages for name, s in stage.strategies.items()}
        assert strategies[node][0] == "S", strategies.get(node)   # the first (batch) dim split
        feeds = _feeds(model, 2)
        assert_close(run_in_process(plan, plan_dir, feeds), reference_outputs(plan, feeds))
