"""Unit tests for meshplan.emit.report: fill-drain schedule, human units, SVG timeline."""

from __future__ import annotations

import itertools
import random
import re
import xml.etree.ElementTree as ET

import pytest

from meshplan.plan_format import Plan, Stage
from meshplan.emit.report import fill_drain_schedule, human_bytes, human_seconds, render_timeline, text_report

SVG = "{http://www.w3.org/2000/svg}"


# --- fill_drain_schedule -----------------------------------------------------------------

def test_schedule_by_hand():
    rows = fill_drain_schedule([1.0, 2.0, 1.0], 3)
    # stage 0: back to back
    assert rows[0] == [(0, 1), (1, 2), (2, 3)]
    # stage 1 waits for stage 0's first microbatch, then is the bottleneck
    assert rows[1] == [(1, 3), (3, 5), (5, 7)]
    # stage 2 follows stage 1
    assert rows[2] == [(3, 4), (5, 6), (7, 8)]


def test_schedule_by_hand_slow_first_stage():
    rows = fill_drain_schedule([3.0, 1.0], 2)
    assert rows[0] == [(0, 3), (3, 6)]
    # stage 1 idles between microbatches
    assert rows[1] == [(3, 4), (6, 7)]


def test_schedule_edge_cases():
    assert fill_drain_schedule([], 4) == []
    assert fill_drain_schedule([2.5], 1) == [[(0.0, 2.5)]]
    assert fill_drain_schedule([0.5, 0.25], 1) == [[(0.0, 0.5)], [(0.5, 0.75)]]
    assert fill_drain_schedule([1.0, 1.0], 0) == [[], []]


def _reference_schedule(times, microbatches):
    """C[s][b] = max(C[s-1][b], C[s][b-1]) + t[s], written independently."""
    ends = {}
    for s, t in enumerate(times):
        for b in range(microbatches):
            ready = max(ends.get((s - 1, b), 0.0), ends.get((s, b - 1), 0.0))
            ends[s, b] = ready + t
    return ends


def _longest_path(times, microbatches):
    """Completion of the last box = longest monotone path through the (stage, microbatch) grid."""
    num_stages = len(times)
    best = 0.0
    # a path makes num_stages-1 "down" and microbatches-1 "right" moves; enumerate positions of downs
    steps = num_stages + microbatches - 2
    for downs in itertools.combinations(range(steps), num_stages - 1):
        s, total = 0, times[0]
        for step in range(steps):
            if step in downs:
                s += 1
            total += times[s]
        best = max(best, total)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_schedule_random(seed):
    rng = random.Random(seed)
    times = [rng.choice([rng.uniform(0.01, 3.0), 1.0, 0.5]) for _ in range(rng.randint(1, 6))]
    microbatches = rng.randint(1, 7)
    rows = fill_drain_schedule(times, microbatches)
    reference = _reference_schedule(times, microbatches)
    assert len(rows) == len(times)
    for s, row in enumerate(rows):
        assert len(row) == microbatches
        for b, (start, end) in enumerate(row):
            assert end == pytest.approx(start + times[s])
            assert end == pytest.approx(reference[s, b])
            # precedence: after this stage's previous box and the previous stage's same box
            if b:
                assert start >= row[b - 1][1] - 1e-12
            if s:
                assert start >= rows[s - 1][b][1] - 1e-12
            # and not later than needed: starts when one of them ends (or at 0)
            candidates = [0.0] + ([row[b - 1][1]] if b else []) + ([rows[s - 1][b][1]] if s else [])
            assert any(start == pytest.approx(c) for c in candidates)
    last_end = rows[-1][-1][1]
    # Closed form for constant per-stage times: sum(t) + (B - 1) * max(t).
    assert last_end == pytest.approx(sum(times) + (microbatches - 1) * max(times))
    # and it equals the longest path through the grid (the argument behind the closed form)
    assert last_end == pytest.approx(_longest_path(times, microbatches))


# --- human units -------------------------------------------------------------------------

@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (1024**2, "1.0 MiB"),
        (5.3 * 1024**3, "5.3 GiB"),
        (80 * 1024**3, "80.0 GiB"),
        (3 * 1024**4, "3.0 TiB"),
        (2048 * 1024**4, "2048.0 TiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_human_bytes(n, text):
    assert human_bytes(n) == text


@pytest.mark.parametrize(
    "s, text",
    [
        (2.0, "2.000 s"),
        (1.0, "1.000 s"),
        (61.25, "61.250 s"),
        (0.5, "500.000 ms"),
        (1e-3, "1.000 ms"),
        (0.0123456, "12.346 ms"),
        (9.99e-4, "999.0 µs"),
        (2.5e-6, "2.5 µs"),
        (0.0, "0.0 µs"),
    ],
)
def test_human_seconds(s, text):
    assert human_seconds(s) == text


# --- render_timeline ---------------------------------------------------------------------

def _plan(stage_seconds, microbatches, devices=None):
    devices = devices or [[i] for i in range(len(stage_seconds))]
    stages = [
        Stage(
            index=i, operators=[f"op{i}a", f"op{i}b"], layers=[i, i + 1], devices=devices[i],
            submesh=[1, len(devices[i])], logical_mesh=[1, len(devices[i])], inputs=[], outputs=[],
            seconds=seconds, memory_bytes=1.5 * 1024**3,
        )
        for i, seconds in enumerate(stage_seconds)
    ]
    return Plan(
        model={"path": "m.onnx", "sha256": "0" * 64, "dims": {}},
        cluster={"mesh": [1, 4], "device": {"name": "h100-80g"}},
        microbatches=microbatches,
        batch={"dim": "N", "size": 4 * microbatches, "microbatch_size": 4},
        inputs=[], outputs=[], stages=stages, transfers=[], programs=[], reshardings=[],
        estimate={"latency_seconds": 0.01, "throughput_per_second": 400.0},
        solver={}, timings={"seconds": 0.5},
    )


def _parse(svg: str):
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


def _boxes(root):
    return [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]


@pytest.mark.parametrize(
    "stage_seconds, microbatches",
    [([1e-3, 2e-3, 1e-3], 3), ([0.25], 1), ([5e-6, 7e-6], 8), ([0.1, 0.3, 0.2, 0.1, 0.05], 12), ([0.0, 0.0], 2)],
)
def test_timeline_structure(stage_seconds, microbatches):
    svg = render_timeline(_plan(stage_seconds, microbatches))
    root = _parse(svg)
    rects = list(root.iter(f"{SVG}rect"))
    boxes = _boxes(root)
    assert len(boxes) == len(stage_seconds) * microbatches
    # the rest are one background per stage row
    assert len(rects) - len(boxes) == len(stage_seconds)
    titles = [b.find(f"{SVG}title").text for b in boxes]
    expected = {f"stage {s}, microbatch {m}" for s in range(len(stage_seconds)) for m in range(microbatches)}
    assert {t.split(":")[0] for t in titles} == expected
    assert len(titles) == len(set(titles))


def test_timeline_box_positions_follow_schedule():
    stage_seconds, microbatches = [1.0, 2.0, 1.0], 3
    root = _parse(render_timeline(_plan(stage_seconds, microbatches)))
    rows = fill_drain_schedule(stage_seconds, microbatches)
    total = rows[-1][-1][1]
    boxes = _boxes(root)
    backgrounds = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is None]
    left = float(backgrounds[0].get("x"))
    width = float(backgrounds[0].get("width"))
    for box in boxes:
        s, m = map(int, re.match(r"stage (\d+), microbatch (\d+):", box.find(f"{SVG}title").text).groups())
        start, end = rows[s][m]
        assert float(box.get("x")) == pytest.approx(left + start / total * width, abs=0.01)
        assert float(box.get("width")) == pytest.approx((end - start) / total * width, abs=0.01)
        # the box lies in its stage's row
        row_bg = backgrounds[s]
        assert box.get("y") == row_bg.get("y")
    # the last box ends at the right edge of the chart
    ends = [float(b.get("x")) + float(b.get("width")) for b in boxes]
    assert max(ends) == pytest.approx(left + width, abs=0.01)
    # rows are stacked in stage order
    ys = [float(bg.get("y")) for bg in backgrounds]
    assert ys == sorted(ys) and len(set(ys)) == len(ys)


def test_timeline_title_times_and_header():
    svg = render_timeline(_plan([1e-3, 2e-3, 1e-3], 3))
    root = _parse(svg)
    titles = {b.find(f"{SVG}title").text for b in _boxes(root)}
    assert "stage 1, microbatch 2: 5.000 ms – 7.000 ms" in titles
    assert "stage 2, microbatch 0: 3.000 ms – 4.000 ms" in titles
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert any("3 stage(s)" in t and "3 microbatch(es)" in t and "8.000 ms" in t for t in texts)
    assert any(t.startswith("stage 0 [0]") for t in texts)


def test_timeline_multi_device_labels_are_escaped_and_parse():
    plan = _plan([0.1, 0.2], 2, devices=[[0, 1], [2, 3]])
    plan.stages[0].devices = ["<0>", "&1"]  # hostile text must not break the XML
    root = _parse(render_timeline(plan))
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert "stage 0 [<0>,&1]" in texts
    assert "stage 1 [2,3]" in texts


def test_text_report_mentions_every_stage():
    report = text_report(_plan([1e-3, 2e-3], 4, devices=[[0, 1], [2]]))
    lines = report.splitlines()
    assert "2 stage(s)" in lines[0] and "1x4" in lines[0] and "4 microbatch(es) of 4" in lines[0]
    assert re.search(r"^\s+0\s+0,1\s", lines[2])
    assert re.search(r"^\s+1\s+2\s", lines[3])
    assert "2.000 ms" in lines[3]
    assert "1.5 GiB" in lines[2]
    assert "400.0 samples/s" in lines[-1]


def test_text_report_names_each_resharding_and_how_it_moves():
    """A rearranged transfer, one ending with an all-gather, and more than the report shows."""
    from meshplan.cost.cluster import make_cluster
    from meshplan.reshard.send_spec import best_resharding
    from meshplan.plan_format import Resharding
    from meshplan.emit.report import RESHARDINGS_SHOWN
    from meshplan.sharding import LogicalMesh

    cluster = make_cluster((6, 8))
    a, b = LogicalMesh((2, 8), tuple(range(16))), LogicalMesh((4, 8), tuple(range(16, 48)))
    rearranged = best_resharding((4096, 4096), "S01R", a, "RS1", b, 4, cluster, trials=4, polish=8)
    assert rearranged.transfer.prepare
    small_a, small_b = LogicalMesh((1, 2), (0, 1)), LogicalMesh((1, 2), (2, 3))
    gathered = best_resharding((64, 8), "RR", small_a, "RR", small_b, 4, make_cluster((1, 4)), local_allgather=True)
    assert gathered.transfer.allgathers
    plan = _plan([1e-3, 2e-3], 1, devices=[[0, 1], [2, 3]])

    def resharding(name, choice, src_spec, dst_spec):
        t = choice.transfer
        return Resharding(name, 0, 1, list(t.shape), "float32", src_spec, dst_spec, t.to_dict(),
                          choice.schedule.to_dict(), choice.seconds)

    plan.reshardings = [resharding("big", rearranged, "S01R", "RS1"), resharding("small", gathered, "RR", "RR")]
    lines = text_report(plan).splitlines()
    big = next(line for line in lines if line.strip().startswith("big:"))
    assert f"rearranged to {rearranged.transfer.send_spec} in stage 0" in big
    assert f"{len(rearranged.transfer.tasks)} task(s)" in big and human_seconds(rearranged.seconds) in big
    small = next(line for line in lines if line.strip().startswith("small:"))
    assert "all-gather in stage 1" in small and "rearranged" not in small
    plan.reshardings = [resharding(f"t{i}", gathered, "RR", "RR") for i in range(RESHARDINGS_SHOWN + 3)]
    report = text_report(plan)
    assert sum(1 for line in report.splitlines() if re.match(r"\s+t\d+: stage 0 RR -> stage 1 RR", line)) == RESHARDINGS_SHOWN
    assert "... and 3 more" in report
