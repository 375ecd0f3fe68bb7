"""Benchmark the inter-operator stage DP on synthetic but realistic cost tables.

Usage (from the repository root)::

    python benchmarks/stage_dp.py [--json PATH] [--check] [--large [--timeout S]] [--idle]

Rows: 32 layers x 32 devices (4 hosts x 8) and 24 layers x 16 devices (2 hosts x 8), 16
microbatches, 4 logical-mesh choices per submesh.  ``--check`` also solves each row with
``reference_stages`` (the DP without the fast path's prunings: every candidate t_max of
the raw table from the least feasible one upwards, logical choices and memory test inside
the DP, stop only when ``G(inf) + (B - 1) t_max >= T_best``; a few seconds) and fails if
the objectives differ.  ``--check-full`` uses the fully unpruned reference instead (only
the stop rule ``(B - 1) t_max >= T_best``; minutes at 32 x 32).  ``--idle`` lets the stages
leave devices idle (the sum of their submeshes at most the cluster's, as meshplan plans).

The synthetic model: layer ``l`` has a compute time ``w_l`` (one microbatch, one device),
parameter bytes ``p_l`` and activation bytes ``a_l``.  On a submesh of ``n`` devices with
logical choice ``c`` a stage of layers ``i..j`` splits its devices into a tensor-parallel
degree ``tp = n ** f_c`` (``f_c`` in 0, 1/3, 2/3, 1) and a data-parallel degree
``n / tp``; its time is ``sum(w) / n ** 0.9 * (1 + noise)`` plus a gradient all-reduce
(data parallel, grows with parameters) and per-layer activation all-reduces (tensor
parallel), with a slower link once the submesh spans hosts.  Memory per device is the
sharded parameters with optimizer state (``4 * sum(p) / tp``) and, per microbatch in
flight, ``sum(a) / n``.  The limit is set so that long stages on small submeshes do not
fit.  Logical choices that a submesh cannot realise (``(1, 1)`` has one, ``(1, 2)`` two)
are ``inf``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from meshplan.inter.stage_dp import StageSolution, plan_objective, solve_stages  # noqa: E402
from meshplan.testing.stage_dp import reference_stages  # noqa: E402

GB = 1e9


def synthetic_table(layers: int, hosts: int, per_host: int, logical: int = 4, seed: int = 0, every_host_count=False):
    """Return (stage_cost, stage_mem, act_mem, mem_limit, submesh_sizes, num_devices).

    The submeshes are (1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8) (those that fit), or
    with ``every_host_count`` meshplan's own list: (1, 1) … (1, per_host), then (2, per_host)
    … (hosts, per_host)."""
    rng = np.random.default_rng(seed)
    if every_host_count:
        shapes = [(1, w) for w in (1, 2, 4) if w < per_host] + [(h, per_host) for h in range(1, hosts + 1)]
    else:
        shapes = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8)]
        shapes = [(h, g) for h, g in shapes if h <= hosts and g <= per_host]
    sizes = np.array([h * g for h, g in shapes], dtype=np.int64)
    S, L, K = len(shapes), layers, logical

    w = rng.lognormal(np.log(0.008), 0.5, L)  # seconds per microbatch on one device
    p = rng.uniform(0.2, 1.0, L) * GB  # parameter bytes
    a = rng.uniform(0.25, 1.5, L) * GB  # activation bytes per microbatch
    cw, cp, ca = (np.concatenate([[0.0], np.cumsum(x)]) for x in (w, p, a))
    fractions = np.linspace(0.0, 1.0, K)

    cost = np.full((L, L, S, K), np.inf)
    smem = np.zeros((L, L, S, K))
    amem = np.zeros((L, L, S, K))
    i, j = np.triu_indices(L)
    work, params, acts, nlayers = cw[j + 1] - cw[i], cp[j + 1] - cp[i], ca[j + 1] - ca[i], j - i + 1
    for m, (h, g) in enumerate(shapes):
        n = h * g
        bw = 100e9 if h == 1 else 12.5e9  # bytes/s: NVLink-ish inside a host, network across
        realisable = 1 if n == 1 else (2 if n == 2 else K)
        for c in range(realisable):
            tp = n ** fractions[c] if n > 1 else 1.0
            dp = n / tp
            noise = rng.uniform(0.0, 0.15, i.shape)
            compute = work / n**0.9 * (1.0 + noise)
            grad_allreduce = 2.0 * (dp - 1) / dp * (params / tp) / bw / 16  # amortised over microbatches
            act_allreduce = nlayers * 2.0 * (tp - 1) / tp * (0.25 * acts / nlayers / dp) / bw
            cost[i, j, m, c] = compute + grad_allreduce + act_allreduce
            smem[i, j, m, c] = 4.0 * params / tp
            amem[i, j, m, c] = acts / n
    mem_limit = 12 * GB
    return cost, smem, amem, mem_limit, sizes, hosts * per_host


ROWS = [
    dict(layers=32, hosts=4, per_host=8, microbatches=16, seed=0),
    dict(layers=24, hosts=2, per_host=8, microbatches=16, seed=1),
]

# --large: every host count as a submesh, 64 microbatches ("check" rows are compared with
# the reference when --check is given; the others are too large for it)
LARGE_ROWS = [
    dict(layers=64, hosts=8, per_host=8, microbatches=64, seed=0, every_host_count=True, check=True),
    dict(layers=128, hosts=32, per_host=8, microbatches=64, seed=0, every_host_count=True, check=False),
    dict(layers=128, hosts=128, per_host=8, microbatches=64, seed=0, every_host_count=True, check=False),
]


def run_row(row, check: bool, full: bool = False, idle: bool = False):
    cost, smem, amem, limit, sizes, D = synthetic_table(row["layers"], row["hosts"], row["per_host"], seed=row["seed"],
                                                        every_host_count=row.get("every_host_count", False))
    check = check and row.get("check", True)
    B = row["microbatches"]
    t0 = time.perf_counter()
    sol: StageSolution = solve_stages(cost, smem, amem, limit, sizes, D, B, idle_devices=idle)
    seconds = time.perf_counter() - t0
    # sanity: the plan is valid and its objective is the one reported
    used = sum(int(sizes[st.submesh]) for st in sol.stages)
    assert used <= D if idle else used == D
    assert abs(plan_objective([st.seconds for st in sol.stages], B) - sol.total_seconds) <= 1e-12 * sol.total_seconds
    result = dict(
        layers=row["layers"],
        devices=D,
        submeshes=len(sizes),
        choices=cost.shape[3],
        microbatches=B,
        seconds=round(seconds, 4),
        solves=sol.tmax_candidates,
        stages=len(sol.stages),
        used=used,
        objective=sol.total_seconds,
    )
    # How much the memory limit costs: the same instance without it.
    if not row.get("every_host_count"):
        result["objective_without_memory_limit"] = solve_stages(cost, smem, amem, np.inf, sizes, D, B,
                                                                 idle_devices=idle).total_seconds
    result["plan"] = [[st.start, st.stop, int(sizes[st.submesh]), st.logical] for st in sol.stages]
    if check:
        t0 = time.perf_counter()
        ref = reference_stages(cost, smem, amem, limit, sizes, D, B, full=full, idle_devices=idle)
        result["reference_seconds"] = round(time.perf_counter() - t0, 2)
        result["reference_solves"] = ref.tmax_candidates
        result["reference_objective"] = ref.total_seconds
        result["check"] = bool(abs(ref.total_seconds - sol.total_seconds) <= 1e-9 * ref.total_seconds)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--check", action="store_true", help="compare with the slow reference DP (seconds)")
    parser.add_argument("--check-full", action="store_true", help="compare with the fully unpruned DP (minutes)")
    parser.add_argument("--large", action="store_true",
                        help="the rows 64 x 64, 128 x 256 and 128 x 1,024 devices (hosts x 8), 64 microbatches")
    parser.add_argument("--idle", action="store_true", help="allow idle devices (at most the cluster's devices)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="with --large: stop after a row that took longer than this many seconds")
    args = parser.parse_args(argv)
    args.check = args.check or args.check_full

    results = []
    for row in LARGE_ROWS if args.large else ROWS:
        results.append(run_row(row, args.check, args.check_full, args.idle))
        print(f"{row['layers']} layers x {row['hosts'] * row['per_host']} devices: {results[-1]['seconds']:.2f} s",
              file=sys.stderr, flush=True)
        if args.timeout is not None and results[-1]["seconds"] > args.timeout:
            print(f"stopping: the row took more than {args.timeout:g} s", file=sys.stderr)
            break
    cols = ["layers", "devices", "submeshes", "choices", "microbatches", "seconds", "solves", "stages", "used", "objective"]
    if args.check:
        cols += ["reference_seconds", "reference_objective", "check"]
    fmt = {"objective": "{:.6f}", "reference_objective": "{:.6f}", "seconds": "{:.3f}"}
    table = [cols] + [[fmt.get(c, "{}").format(r[c]) if c in r else "-" for c in cols] for r in results]
    widths = [max(len(line[n]) for line in table) for n in range(len(cols))]
    for line in table:
        print("  ".join(cell.rjust(wd) for cell, wd in zip(line, widths)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    if args.check and not all(r.get("check", True) for r in results):
        print("CHECK FAILED: pruned and reference objectives differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
