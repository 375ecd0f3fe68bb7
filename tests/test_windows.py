"""A chosen stage solved again over windows wider than the stage DP's layers
(``meshplan.intra.windows``).

The windows join whole layers, stop at stage cuts and end where the least crosses. At
batch 1 (a decode step: nothing splits by batch), the stage DP's one-operator layers would
gather every split product's output at each boundary; in windows, a tensor-parallel plan
pairs column- and row-parallel products, so a builder Llama step on 1x2 needs one
all-reduce after each attention and each MLP, and one gather of the logits, and still
computes what onnxruntime does.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.intra.windows import WINDOW_NODES, window_layering
from meshplan.make_plan import make_plan
from meshplan.model.layers import Layering
from meshplan.plan_format import COLLECTIVE_DOMAIN
from meshplan.runtime.inprocess import run_in_process
from tests.conftest import assert_close
from tests.test_genai_models import dims, expected_of, inputs, model_path


def _layering(bounds, traffic) -> Layering:
    return Layering(tuple(bounds), np.asarray(traffic, dtype=np.float64))


def test_windows_join_layers_up_to_the_budget_and_end_at_the_cheapest_cut():
    # 10 layers of 10 nodes; the cut after node 70 carries the least in its reach
    traffic = np.full(101, 100.0)
    traffic[70] = 1.0
    windows = window_layering(_layering(range(0, 101, 10), traffic), cuts=set(), budget=80)
    assert windows.bounds == (0, 70, 100)
    # no cheap cut: the latest of the equally cheap ones in the second half of the reach
    windows = window_layering(_layering(range(0, 101, 10), np.zeros(101)), cuts=set(), budget=45)
    assert windows.bounds == (0, 40, 80, 100)


def test_windows_never_cross_a_stage_cut_and_keep_oversized_layers_whole():
    traffic = np.zeros(101)
    windows = window_layering(_layering((0, 10, 20, 30, 40, 50, 100), traffic), cuts={30}, budget=60)
    assert 30 in windows.bounds
    assert windows.bounds == (0, 30, 50, 100)      # the last layer (50 nodes) alone: never split
    for start, stop in zip(windows.bounds, windows.bounds[1:]):
        assert stop - start <= 60 or (start, stop) == (50, 100)


def _collectives(plan_dir, plan) -> list[list[str]]:
    found = []
    for program in plan.programs:
        model = onnx.load(str(plan_dir / program.file), load_external_data=False)
        found.append([node.op_type for node in model.graph.node if node.domain == COLLECTIVE_DOMAIN])
    return found


@pytest.mark.parametrize("name", ["llama_fp32", "llama_int4"])
def test_tensor_parallel_decode_step_pairs_column_and_row_parallel_products(name, tmp_path):
    layers = 2
    plan = make_plan(model_path(name), make_cluster((1, 2), "cpu"), dims("decode"), tmp_path / "plan",
                     PlanOptions(policy="megatron", max_stages=1))
    assert len(plan.stages) == 1 and len(plan.stages[0].operators) <= WINDOW_NODES
    for ops in _collectives(tmp_path / "plan", plan):
        # one all-reduce after each attention's and each MLP's row-parallel product, and
        # the logits, split by vocabulary, gathered once
        assert sorted(ops) == sorted(["AllReduce"] * 2 * layers + ["AllGather"]), ops
    feeds = inputs(name, "decode", seed=5)
    expected, bounds = expected_of(plan, feeds)
    assert_close(run_in_process(plan, tmp_path / "plan", feeds), expected, bounds=bounds)


def test_windows_never_make_a_stage_slower(tmp_path, monkeypatch):
    """The same plan with the windows' re-solve and with the layers' chain alone (windows
    of one node: the layers themselves): the estimate drops, with fewer collectives."""
    from meshplan.intra import windows

    cluster = make_cluster((1, 2), "cpu")
    options = PlanOptions(policy="megatron", max_stages=1)
    wide = make_plan(model_path("llama_fp32"), cluster, dims("decode"), tmp_path / "wide", options)
    monkeypatch.setattr(windows, "WINDOW_NODES", 1)
    narrow = make_plan(model_path("llama_fp32"), cluster, dims("decode"), tmp_path / "narrow", options)
    assert wide.estimate["latency_seconds"] < narrow.estimate["latency_seconds"]
    assert len(sum(_collectives(tmp_path / "wide", wide), [])) < len(sum(_collectives(tmp_path / "narrow", narrow), []))
