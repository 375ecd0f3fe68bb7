"""Plans are pinned: the plan.json (less its wall-clock statistics) and every program's
bytes of the sample models and a few light-zoo models on 1x2, 2x2 and 2x4 must not change
unless a change means to change them. Rewrite the pins with
``MESHPLAN_UPDATE_PINS=1 pytest tests/test_pinned_plans.py`` and say why in the commit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.make_plan import make_plan
from meshplan.inter.pipeline import PlanOptions
from sample_models import SAMPLES
from sample_models.zoo import light_models
from tests.conftest import plan_digest

PINS = Path(__file__).with_name("pinned_plans.json")
MESHES = [(1, 2), (2, 2), (2, 4)]
ZOO = ["squeezenet", "shufflenet", "bvlc_alexnet"]


def _cases():
    models = [(name, SAMPLES[name].path, dict(SAMPLES[name].dims), 2) for name in SAMPLES]
    zoo = light_models()
    models += [(name, zoo[name], {}, 1) for name in ZOO]
    return [pytest.param(path, dims, mb, mesh, id=f"{name}-{mesh[0]}x{mesh[1]}")
            for name, path, dims, mb in models for mesh in MESHES]


@pytest.mark.parametrize("path,dims,microbatches,mesh", _cases())
def test_plan_is_pinned(path, dims, microbatches, mesh, tmp_path, request):
    key = request.node.callspec.id
    make_plan(path, make_cluster(mesh, "h100-80g"), dims, tmp_path / "plan", PlanOptions(microbatches=microbatches))
    digest = plan_digest(tmp_path / "plan")
    if os.environ.get("MESHPLAN_UPDATE_PINS"):
        pins = json.loads(PINS.read_text()) if PINS.exists() else {}
        pins[key] = digest
        PINS.write_text(json.dumps(dict(sorted(pins.items())), indent=1) + "\n")
        return
    pins = json.loads(PINS.read_text())
    assert pins.get(key) == digest, f"the plan of {key} changed"
