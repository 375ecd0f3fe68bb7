"""Plans a person would not improve by hand.

- More devices never worse: the estimate on 1x4 ≤ on 1x2 ≤ on 1x1, and on 2x4 ≤ on 1x4
  (and 2x2 ≤ 1x2), for the analytic cost model and a profiled one, over the samples and
  export-shaped models (a UNet-like model with Resize, an encoder, an encoder-decoder, a
  decoder step at batch 1 and 2).
- No stage below 10% of the slowest stage's time where memory does not need it.
- A plan that leaves devices idle says which and why, and runs with the full rank count.
"""

from __future__ import annotations

import zlib

import numpy as np
import onnx
import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import MIN_STAGE_FRACTION, PlanOptions
from meshplan.make_plan import make_plan
from meshplan.profile.document import OpEntry, Profile
from meshplan.profile.measured import ProfiledCostModel
from sample_models import SAMPLES
from sample_models.structures import make_encoder, make_encoder_decoder, make_unet_like

MESHES = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4)]
# (2x4 against 2x2 is not among them: 2 hosts' first 2 devices are not one of the parts of a
# 2x4 mesh the planner solves (``pipeline.regions``), and with the made-up timings below the
# MLP's 2x4 plan is estimated 0.4% above its 2x2 plan, since an all-reduce of two devices costs
# one exchange)
FEWER = [((1, 2), (1, 1)), ((1, 4), (1, 2)), ((2, 2), (1, 2)), ((2, 4), (1, 4))]
STRUCTURES = {"unet_like": make_unet_like, "encoder": make_encoder, "encoder_decoder": make_encoder_decoder}


class _Timings(dict):
    """A profile's operator table with a "measured" time for every signature: 20 µs times
    a factor in [0.3, 3] drawn from the signature's key (as a real profile's times differ
    from the analytic model's, op by op)."""

    def get(self, key, default=None):
        factor = 0.3 + 2.7 * (zlib.crc32(key.encode()) % 1000) / 1000
        return OpEntry(key, {}, 2e-5 * factor, 1, "measured")


def _profile(mesh) -> Profile:
    return Profile(model={}, mesh=list(mesh), device="h100-80g", hardware="made-up times", provider="cpu",
                   onnxruntime="", threads=1, ranks=1, operators=_Timings(), communication=[],
                   communication_source="cluster", cuda_aware_mpi={})


def _model(name: str, batch: int, tmp_path_factory) -> tuple:
    if name in SAMPLES:
        sample = SAMPLES[name]
        dims = dict(sample.dims)
        if name == "gpt":   # a decoder's step
            dims = {**dims, "batch": batch, "seq": 1}
        return sample.path, dims
    path = tmp_path_factory.mktemp(name) / f"{name}{batch}.onnx"
    onnx.save_model(STRUCTURES[name](batch=batch), str(path))
    return path, {}


def _estimates(path, dims, tmp_path, profiled: bool) -> dict:
    plans = {}
    for mesh in MESHES:
        cluster = make_cluster(mesh, "h100-80g")
        cost_model = ProfiledCostModel(cluster, _profile(mesh)) if profiled else None
        plans[mesh] = make_plan(path, cluster, dims, tmp_path / f"{mesh[0]}x{mesh[1]}", PlanOptions(),
                                cost_model=cost_model, programs=False)
    return plans


def _check(plans) -> None:
    for more, fewer in FEWER:
        assert plans[more].estimate["latency_seconds"] <= plans[fewer].estimate["latency_seconds"] * (1 + 1e-9), \
            (more, fewer, plans[more].estimate["stage_seconds"], plans[fewer].estimate["stage_seconds"])
    for mesh, plan in plans.items():
        seconds = plan.estimate["stage_seconds"]
        assert min(seconds) >= MIN_STAGE_FRACTION * max(seconds), (mesh, seconds)   # no memory pressure here
        busy = sorted(r for s in plan.stages for r in s.devices)
        assert sorted(busy + plan.idle_ranks) == list(range(mesh[0] * mesh[1]))
        if plan.idle_ranks:
            assert plan.idle["reason"]


CASES = [("unet_like", 2, False), ("gpt", 1, True)]
SLOW_CASES = [("unet_like", 1), ("encoder", 1), ("encoder", 2), ("encoder_decoder", 1), ("encoder_decoder", 2),
              ("gpt", 1), ("gpt", 2), ("unet_like", 2), ("mlp", 0), ("resnet", 0), ("moe", 0)]


@pytest.mark.parametrize("name,batch,profiled", CASES,
                         ids=[f"{n}-b{b}-{'profiled' if p else 'analytic'}" for n, b, p in CASES])
def test_more_devices_never_worse(name, batch, profiled, tmp_path, tmp_path_factory):
    path, dims = _model(name, batch, tmp_path_factory)
    _check(_estimates(path, dims, tmp_path, profiled))


@pytest.mark.slow
@pytest.mark.parametrize("profiled", [False, True], ids=["analytic", "profiled"])
@pytest.mark.parametrize("name,batch", SLOW_CASES, ids=[f"{n}-b{b}" for n, b in SLOW_CASES])
def test_more_devices_never_worse_everywhere(name, batch, profiled, tmp_path, tmp_path_factory):
    path, dims = _model(name, batch, tmp_path_factory)
    _check(_estimates(path, dims, tmp_path, profiled))


@pytest.mark.mpi
def test_a_plan_with_idle_devices_runs_and_verifies(tmp_path):
    """The encoder on 1x4 of h100-80g: one device is estimated fastest, the other three are
    idle, the report says why, and the plan runs in-process and under mpiexec with four
    ranks (the idle ones take part in no stage) and passes ``meshplan verify``."""
    from tests.conftest import check_against_onnxruntime, run_cli, save_npz

    path = tmp_path / "encoder.onnx"
    model = make_encoder(batch=2)
    onnx.save_model(model, str(path))
    plan_dir = tmp_path / "plan"
    plan = make_plan(path, make_cluster((1, 4), "h100-80g"), {}, plan_dir, PlanOptions())
    assert plan.idle_ranks and plan.num_ranks == 4 and "estimated at" in plan.idle["reason"]
    report = (plan_dir / "report.txt").read_text()
    assert f"idle: devices {plan.idle_ranks[0]}-{plan.idle_ranks[-1]}" in report
    feeds = {"input_features": np.random.default_rng(0).standard_normal((2, 16, 32)).astype(np.float32)}
    check_against_onnxruntime(plan, plan_dir, feeds, tmp_path)
    result = run_cli("verify", plan_dir, "--inputs", save_npz(tmp_path / "v.npz", feeds))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["gpt", "moe"])
def test_a_mesh_of_more_hosts_is_never_worse_than_its_first_hosts(name, tmp_path):
    """The first hosts of a mesh are one of the parts the planner solves on their own, even
    where they are cut into the same layers as the whole mesh (whose DP, idle devices
    allowed, searched their plans too): the DP's estimate is not the built plan's, and these
    samples' 2-host plans build faster than the 4-host DP's choice."""
    sample = SAMPLES[name]
    estimates = {}
    for mesh in [(2, 2), (4, 2)]:
        plan = make_plan(sample.path, make_cluster(mesh, "h100-80g"), dict(sample.dims), tmp_path / f"{mesh}",
                         PlanOptions(microbatches=2), programs=False)
        estimates[mesh] = plan.estimate["latency_seconds"]
    assert estimates[(4, 2)] <= estimates[(2, 2)] * (1 + 1e-9), estimates
