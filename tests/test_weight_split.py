"""Splitting weights when it pays, and policies that do what they say.

At batch 1 and 2 a ViT-sized model (over 80 MB of weights) and a decoder's step read
their weights more than they compute: on 1x4 of this machine's preset (``cpu``) the
automatic plan splits every large weight four ways where its estimate beats the
pipeline-only plan; ``--policy megatron`` on 1x4 gives every rank 20–30% of the weights
(embeddings aside) on any device preset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from sample_models.gpt import make_gpt
from sample_models.structures import make_vit_like


def _weight_bytes(path: Path, skip: str) -> int:
    model = onnx.load(str(path), load_external_data=False)
    total = 0
    for tensor in model.graph.initializer:
        if skip and tensor.name.startswith(skip):
            continue
        count = int(np.prod(tensor.dims)) if tensor.dims else 1
        total += count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return total


def _per_rank(plan_dir: Path, plan, skip: str) -> list[int]:
    return [_weight_bytes(plan_dir / program.file, skip) for program in sorted(plan.programs, key=lambda p: p.rank)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """(path, dims, prefix of the embedding weights) of a ViT-like model at batch 1 and a
    decoder's step at batch 2."""
    where = tmp_path_factory.mktemp("split")
    vit = where / "vit.onnx"
    onnx.save_model(make_vit_like(batch=1), str(vit), save_as_external_data=True, location="vit.onnx.data")
    gpt = where / "gpt.onnx"
    onnx.save_model(make_gpt(layers=2, hidden=1024, heads=16, vocab=2048, max_seq=64), str(gpt),
                    save_as_external_data=True, location="gpt.onnx.data")
    return {"vit": (vit, {}, "embed"), "decoder-b1": (gpt, {"batch": 1, "seq": 1}, "embed"),
            "decoder": (gpt, {"batch": 2, "seq": 1}, "embed")}


@pytest.mark.parametrize("name", ["vit", pytest.param("decoder-b1", marks=pytest.mark.slow), "decoder"])
def test_small_batches_split_weights_four_ways_where_it_pays(name, models, tmp_path):
    """The plan of one 1x4 stage beats the pipeline-only plan here; the automatic plan is
    at least as good as either, and is that split: each rank holds a quarter of the
    weights."""
    path, dims, embeddings = models[name]
    whole = _weight_bytes(path, embeddings)
    assert _weight_bytes(path, "") >= 80e6
    cluster = make_cluster((1, 4), "cpu")
    pipeline = make_plan(path, cluster, dims, tmp_path / "pipeline", PlanOptions(submeshes=((1, 1),)), programs=False)
    # (with programs, as the automatic plan: weights read, a tied embedding is known as one)
    four = make_plan(path, cluster, dims, tmp_path / "four", PlanOptions(submeshes=((1, 4),), max_stages=1))
    assert four.estimate["latency_seconds"] < pipeline.estimate["latency_seconds"]
    plan = make_plan(path, cluster, dims, tmp_path / "auto", PlanOptions())
    assert plan.estimate["latency_seconds"] <= four.estimate["latency_seconds"] * (1 + 1e-9)
    assert [len(stage.devices) for stage in plan.stages] == [4]
    shares = [held / whole for held in _per_rank(tmp_path / "auto", plan, embeddings)]
    assert all(0.2 <= share <= 0.3 for share in shares), shares


def test_megatron_gives_every_rank_a_quarter_of_the_weights(models, tmp_path):
    path, dims, embeddings = models["vit"]
    whole = _weight_bytes(path, embeddings)
    plan = make_plan(path, make_cluster((1, 4), "h100-80g"), dims, tmp_path / "megatron", PlanOptions(policy="megatron"))
    assert [len(stage.devices) for stage in plan.stages] == [4]
    shares = [held / whole for held in _per_rank(tmp_path / "megatron", plan, embeddings)]
    assert all(0.2 <= share <= 0.3 for share in shares), shares


def test_megatron_across_hosts_pipelines_the_hosts(models, tmp_path):
    """On 2x2, one stage per host, each splitting its matrix products over the host's two
    devices."""
    path, dims, _ = models["decoder"]
    plan = make_plan(path, make_cluster((2, 2), "h100-80g"), dims, tmp_path / "p", PlanOptions(policy="megatron"),
                     programs=False)
    assert [sorted(stage.devices) for stage in plan.stages] == [[0, 1], [2, 3]]
    assert all(any("S" in s.split("->")[0].split(",")[1] for s in stage.strategies.values() if "," in s)
               for stage in plan.stages)


def test_data_policy_replicates_weights_and_splits_the_batch(tmp_path):
    from sample_models import SAMPLES

    sample = SAMPLES["mlp"]
    plan = make_plan(sample.path, make_cluster((1, 4), "h100-80g"), dict(sample.dims), tmp_path / "p",
                     PlanOptions(policy="data"), programs=False)
    assert len(plan.stages) == 1
    for strategy in plan.stages[0].strategies.values():
        first = strategy.split("->")[1]
        assert first.startswith("S"), strategy   # every sharded operator splits its output's batch
