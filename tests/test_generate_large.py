"""A decoder of over 1 GB in the builder's format at batch 1 on 1x4: decode reads every
weight once per token, so the plan must split the weights (no rank above 35% of the weight
bytes, none below 15%) rather than add pipeline stages; its estimated time per token is
below the best pipeline-only plan's (stages of one device each), and it generates
onnxruntime's tokens under mpiexec.

The plans are for the ``cpu`` preset, the devices the tests run on (decode reads the
weights at 20 GB/s). Slow (a 1.1 GB model is written, planned twice and run on four ranks
and by onnxruntime): ``make test-all`` runs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import generation_plan_dims, make_plan
from tests.conftest import run_mpi_script

NEW_TOKENS = 4


@pytest.mark.slow
@pytest.mark.mpi
def test_a_large_decoder_at_batch_one_splits_its_weights(tmp_path):
    from sample_models.genai_large import write_builder_llama
    from tests.test_generate import reference_ids

    model = write_builder_llama(tmp_path / "model", 1.1)
    weights = (tmp_path / "model" / "model.onnx.data").stat().st_size
    assert weights >= 1e9
    dims, _ = generation_plan_dims(model, 1, 256, 16)
    cluster = make_cluster((1, 4), "cpu")   # the devices the tests run on: decode reads 1.1 GB at 20 GB/s
    plan = make_plan(model, cluster, dims, tmp_path / "plan", PlanOptions())
    held = {p.rank: sum((tmp_path / "plan" / f).stat().st_size for f in [p.file] + [d["file"] for d in p.data_files])
            for p in plan.programs}
    shares = {rank: size / weights for rank, size in held.items()}
    assert all(0.15 <= share <= 0.35 for share in shares.values()), shares
    pipeline = make_plan(model, cluster, dims, tmp_path / "pipeline", PlanOptions(submeshes=((1, 1),)))
    assert plan.estimate["latency_seconds"] < pipeline.estimate["latency_seconds"]
    prompts = [[5, 17, 42, 7, 9]]
    entry = {"name": "1.1 GB decoder 1x4", "plan_dir": str(tmp_path / "plan"), "prompts": prompts,
             "new_tokens": NEW_TOKENS, "expected": reference_ids(plan, prompts, NEW_TOKENS)}
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps([entry]))
    lines = run_mpi_script("generate_tokens_case.py", ranks=4, timeout=1200, args=[manifest])
    assert len(lines) == 3   # the ids, the cache updated in place, no cache bytes between ranks
    assert sum("updated in place" in line for line in lines) == 1 and sum("bytes moved" in line for line in lines) == 1
