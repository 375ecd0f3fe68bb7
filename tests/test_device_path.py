"""The device path: tensors kept as OrtValues, moved by one-operator onnxruntime models
and handed to mpi4py through ``__cuda_array_interface__``.

Without a GPU the same code runs with OrtValues in host memory (CPU provider): these
tests check its data movement against numpy, its MPI exchanges under mpiexec, the choice
of path, and whole plans run with ``--transfer device`` against onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.errors import RunError
from meshplan.make_plan import make_plan
from meshplan.inter.pipeline import PlanOptions
from meshplan.providers import CPU, CUDA
from meshplan.runtime import transport
from meshplan.runtime.buffers import HOST, DeviceBuffers, DeviceTensor, MpiView
from sample_models import make_gpt, make_inputs
from tests.conftest import check_against_onnxruntime, run_mpi, run_mpi_script, save_npz

DEVICE = DeviceBuffers("cpu", 0, [CPU])
DTYPES = [np.float32, np.float64, np.int64, np.int32]


@st.composite
def _tensor(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(rank))
    dtype = draw(st.sampled_from(DTYPES))
    return np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape) * 7 - 3


@settings(max_examples=60, deadline=None)
@given(x=_tensor(), data=st.data())
def test_take_matches_numpy(x, data):
    box = []
    for n in x.shape:
        a = data.draw(st.integers(0, n - 1))
        box.append(slice(a, data.draw(st.integers(a + 1, n))))
    got = DEVICE.take(DEVICE.from_host(x), tuple(box))
    assert isinstance(got, DeviceTensor) and got.shape == HOST.take(x, tuple(box)).shape
    np.testing.assert_array_equal(DEVICE.to_host(got), HOST.take(x, tuple(box)))


@settings(max_examples=60, deadline=None)
@given(x=_tensor(), data=st.data())
def test_pack_and_unpack_match_numpy(x, data):
    axis = data.draw(st.integers(0, x.ndim - 1))
    k = data.draw(st.sampled_from([d for d in range(1, x.shape[axis] + 1) if x.shape[axis] % d == 0]))
    packed = DEVICE.pack(DEVICE.from_host(x), axis, k)
    np.testing.assert_array_equal(DEVICE.to_host(packed), HOST.pack(x, axis, k))
    assert packed.shape == (k,) + tuple(n // k if d == axis else n for d, n in enumerate(x.shape))
    into = data.draw(st.integers(0, x.ndim - 1))
    np.testing.assert_array_equal(DEVICE.to_host(DEVICE.unpack(packed, into)), HOST.unpack(HOST.pack(x, axis, k), into))


@settings(max_examples=60, deadline=None)
@given(x=_tensor(), data=st.data())
def test_assemble_from_a_grid_of_pieces(x, data):
    """Cut ``x`` on a random grid, hand the pieces over in a random order: the tensor comes back."""
    cuts = []
    for n in x.shape:
        inner = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
        cuts.append([0, *inner, n])
    boxes = [()]
    for points in cuts:
        boxes = [b + (slice(a, c),) for b in boxes for a, c in zip(points, points[1:])]
    order = data.draw(st.permutations(boxes))
    assembler = DEVICE.assembler(x.shape, x.dtype)
    for box in order:
        assembler.put(box, DEVICE.from_host(x[box]))
    np.testing.assert_array_equal(DEVICE.to_host(assembler.finish()), x)


def test_kernels_are_built_per_operation_not_per_shape():
    buffers = DeviceBuffers("cpu", 0, [CPU])
    rng = np.random.default_rng(0)
    for n in range(2, 9):
        x = rng.standard_normal((n, 2 * n)).astype(np.float32)
        got = buffers.take(buffers.from_host(x), (slice(1, n), slice(0, n)))
        np.testing.assert_array_equal(buffers.to_host(got), x[1:n, 0:n])
        packed = buffers.pack(buffers.from_host(x), 1, 2)
        np.testing.assert_array_equal(buffers.to_host(buffers.unpack(packed, 1)), x)
    assert buffers.kernels == 3   # take, pack, unpack for rank-2 float32


def test_mpi_view_describes_the_ortvalue():
    x = DEVICE.from_host(np.arange(12, dtype=np.float32).reshape(3, 4))
    view = DEVICE.mpi(x)
    cai = view.__cuda_array_interface__
    assert isinstance(view, MpiView) and view.value is x.value
    assert cai["data"] == (x.value.data_ptr(), False) and cai["shape"] == (3, 4)
    assert cai["typestr"] == "<f4" and cai["version"] == 3 and cai["strides"] is None


class _FakeMPI:
    pass


@pytest.mark.parametrize("transfer, provider, aware, kind, words", [
    ("auto", CPU, None, "host", "host memory (CPU provider)"),
    ("host", CPU, None, "host", "host memory (CPU provider)"),
    ("device", CPU, None, "device", "OrtValue buffers in host memory"),
    ("auto", CUDA, True, "device", "device memory: CUDA buffers straight to CUDA-aware MPI"),
    ("device", CUDA, True, "device", "device memory"),
    ("auto", CUDA, False, "host", "staged through the host"),
    ("auto", CUDA, None, "host", "staged through the host"),
    ("host", CUDA, True, "host", "staged through the host (--transfer host)"),
])
def test_choice_of_transfer_path(monkeypatch, transfer, provider, aware, kind, words):
    monkeypatch.setattr(transport, "cuda_aware", lambda MPI: {"value": aware, "method": "test"})
    buffers, text = transport.choose_buffers(transfer, provider, 1, _FakeMPI)
    assert buffers.name == kind and words in text
    if kind == "device" and provider == CUDA:
        assert (buffers.device_type, buffers.device_id) == ("cuda", 1)


@pytest.mark.parametrize("aware, words", [(False, "is not CUDA-aware"), (None, "may not be CUDA-aware")])
def test_device_transfer_needs_cuda_aware_mpi(monkeypatch, aware, words):
    monkeypatch.setattr(transport, "cuda_aware", lambda MPI: {"value": aware, "method": "test"})
    with pytest.raises(RunError, match=words):
        transport.choose_buffers("device", CUDA, 0, _FakeMPI)
    # a job of one rank sends nothing through MPI: device buffers need no CUDA-aware MPI there
    buffers, text = transport.choose_buffers("device", CUDA, 0, _FakeMPI, alone=True)
    assert (buffers.name, buffers.device_type) == ("device", "cuda") and "nothing crosses" in text
    with pytest.raises(RunError, match="unknown transfer path"):
        transport.choose_buffers("gpu", CPU, 0, _FakeMPI)


@pytest.mark.mpi
def test_device_path_exchanges_under_mpiexec():
    """Every cross-mesh case (prepare steps included) and every collective."""
    assert len(run_mpi_script("device_path_case.py")) == 14 + 24


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt") / "gpt.onnx"
    onnx.save(make_gpt(layers=2, hidden=64, heads=4, vocab=128, max_seq=32), str(path))
    return path


@pytest.mark.mpi
@pytest.mark.parametrize("options", [
    PlanOptions(max_stages=1, policy="megatron"),                    # collectives inside one 2x2 stage
    PlanOptions(max_stages=2, microbatches=2, policy="megatron"),    # two sharded stages, resharding between
], ids=["one-stage", "two-stages"])
def test_plans_run_through_the_device_path(gpt, tmp_path, options):
    dims = {"batch": 4, "seq": 16}
    plan_dir = tmp_path / "plan"
    plan = make_plan(gpt, _cluster(tmp_path), dims, plan_dir, options)
    if options.max_stages == 1:
        assert plan.stages[0].collectives
    else:
        assert plan.reshardings and all(s.collectives for s in plan.stages)
    out = check_against_onnxruntime(plan, plan_dir, make_inputs(onnx.load(str(gpt)), dims, seed=3), tmp_path,
                                    "--transfer", "device")
    assert "transfer path: OrtValue buffers in host memory" in out


@pytest.mark.mpi
def test_unknown_transfer_path_is_one_line(gpt, tmp_path):
    dims = {"batch": 4, "seq": 16}
    plan = make_plan(gpt, _cluster(tmp_path), dims, tmp_path / "plan", PlanOptions(max_stages=1))
    inputs = save_npz(tmp_path / "in.npz", make_inputs(onnx.load(str(gpt)), dims, seed=0))
    done = run_mpi(plan.num_ranks, "run", tmp_path / "plan", "--inputs", inputs, "--transfer", "gpu")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("meshplan: error:")]
    assert errors == ["meshplan: error: unknown transfer path 'gpu' (choose from auto, host, device)"], done.stderr


def _cluster(tmp_path):
    from meshplan.cost.cluster import load_cluster_file

    path = tmp_path / "cluster.toml"
    path.write_text("hosts = 2\ndevices_per_host = 2\n[device]\npreset = 'h100-80g'\n")
    return load_cluster_file(path)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_device_buffers_keep_their_runs_bound(gpt, tmp_path, microbatches):
    """A job whose tensors travel as device buffers and stay where the provider computes
    (``on_device``: the path of a CUDA-aware MPI, on host OrtValues here) runs its program as the
    host-staged path does, its bindings kept between calls, with one microbatch; with several,
    each run's outputs are new buffers (a send of the one before may still read them). Either
    way the outputs are onnxruntime's, call after call."""
    from meshplan.cost.cluster import make_cluster
    from meshplan.runtime.inprocess import reference_outputs
    from meshplan.runtime.job import Job
    from tests.conftest import assert_close

    dims = {"batch": 4, "seq": 16}
    plan_dir = tmp_path / "plan"
    plan = make_plan(gpt, make_cluster((1, 1), "cpu"), dims, plan_dir, PlanOptions(microbatches=microbatches))
    with Job(plan_dir, "cpu", transfer="device", on_device=True) as job:
        assert job.buffers.name == "device"
        assert (job.session.kept_on is job.buffers) == (microbatches == 1)
        assert ("kept bound" in job.transfer_path) == (microbatches == 1)
        for seed in (3, 4, 3):   # the same shapes again: the runs repeat what they bound
            inputs = make_inputs(onnx.load(str(gpt)), dims, seed=seed)
            assert_close(job.run(inputs), reference_outputs(plan, inputs))
        if microbatches == 1:
            assert job.session.segments[0].session._resident.repeat is not None
