"""A fixed-capacity key/value cache updated in place (``program.in_place_pairs``,
``StageSession.run(..., writable=...)``): GroupQueryAttention's present output bound to
its past input's buffer gives the logits of the copying run, step after step, and writes
nothing the caller did not hand over."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import generation_plan_dims, make_plan
from meshplan.providers import CPU
from meshplan.runtime.buffers import DeviceBuffers
from meshplan.runtime.program import ProgramRunner, in_place_pairs
from sample_models import SAMPLE_DIR

CAPACITY, HEAD_SIZE, VOCAB = 32, 16, 320


def builder_plan(tmp_path, mesh=(1, 2)):
    model = SAMPLE_DIR / "genai" / "llama_fp32" / "model.onnx"
    dims, _ = generation_plan_dims(model, 1, CAPACITY, 8)
    return make_plan(model, make_cluster(mesh, "cpu"), dims, tmp_path / "plan",
                     PlanOptions(policy="megatron", max_stages=1))


def rank0_runner(plan, tmp_path) -> tuple[ProgramRunner, onnx.ModelProto]:
    path = tmp_path / "plan" / next(p.file for p in plan.programs if p.rank == 0)
    return ProgramRunner(path, [CPU], threads=1), onnx.load(str(path), load_external_data=False)


def zero_cache(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    found = {}
    for value in model.graph.input:
        if "past" in value.name:
            shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
            found[value.name] = np.zeros(shape, np.float32)
    return found


def one_rank(step, tensor):
    """Rank 0 alone: an all-reduce adds nothing from elsewhere, a gather keeps its piece
    (the test compares two runs of the same rank, not the model)."""
    return tensor


def decode(runner: ProgramRunner, cache: dict, steps: int, writable: bool, buffers=None):
    """Logits of a prefill of 4 tokens and ``steps`` decode steps, the cache carried from
    each call's present outputs to the next call's past inputs."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (1, 4)).astype(np.int64)
    length, found = 0, []
    for _ in range(steps + 1):
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, length + ids.shape[1]), np.int64), **cache}
        if buffers is not None:
            feeds = {n: buffers.from_host(v) if n not in cache else v for n, v in feeds.items()}
        out = runner.run(feeds, one_rank, **({"buffers": buffers} if buffers is not None else {}),
                         writable=frozenset(cache) if writable else frozenset())
        logits = out["logits"] if buffers is None else buffers.to_host(out["logits"])
        found.append(np.array(logits))
        presents = {n.replace("past_key_values", "present"): n for n in cache}
        returned = {presents[o]: out[o] for o in out if o in presents}
        if writable:   # the present output is the past buffer itself
            assert all(returned[n] is cache[n] for n in cache), "present is not the past buffer"
        cache = returned
        length += ids.shape[1]
        ids = logits[:, -1:].argmax(-1).astype(np.int64)
    return found, cache


def test_builder_program_pairs_every_present_with_its_past(tmp_path):
    plan = builder_plan(tmp_path)
    runner, model = rank0_runner(plan, tmp_path)
    pairs = {}
    for segment in runner.segments:
        pairs.update(segment.in_place or {})
    past = [v.name for v in model.graph.input if "past" in v.name]
    assert len(past) == 4                   # two layers, key and value
    assert sorted(pairs.values()) == sorted(past)
    assert all(present.replace("present", "past_key_values") == source for present, source in pairs.items())


def test_in_place_run_gives_the_copying_runs_logits(tmp_path):
    plan = builder_plan(tmp_path)
    runner, model = rank0_runner(plan, tmp_path)
    given = zero_cache(model)
    copied, _ = decode(runner, {n: v.copy() for n, v in given.items()}, 6, writable=False)
    caller = {n: v.copy() for n, v in given.items()}
    updated, cache = decode(runner, caller, 6, writable=True)
    assert len(copied) == len(updated) == 7
    for a, b in zip(copied, updated):
        np.testing.assert_array_equal(a, b)
    assert all(cache[n] is caller[n] for n in caller)
    assert any(np.abs(v).sum() > 0 for v in caller.values())     # written where it lies


def test_kept_binding_follows_new_buffers_and_copying_runs(tmp_path):
    """A session keeps its binding between in-place runs: a second generation on new
    buffers writes those (the first generation's stay as they were), a copying run in
    between writes neither, and ``release`` lets the old buffers go."""
    plan = builder_plan(tmp_path)
    runner, model = rank0_runner(plan, tmp_path)
    expected, _ = decode(runner, zero_cache(model), 3, writable=False)
    first = zero_cache(model)
    got, _ = decode(runner, first, 3, writable=True)
    kept = {n: v.copy() for n, v in first.items()}
    untouched = zero_cache(model)
    between, _ = decode(runner, untouched, 3, writable=False)
    assert all(not np.any(v) for v in untouched.values())
    runner.release()
    assert all(not s.session._bound for s in runner.segments if s.session is not None)
    second = zero_cache(model)
    again, _ = decode(runner, second, 3, writable=True)
    for a, b, c, d in zip(expected, got, between, again):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(a, d)
    for name in first:
        np.testing.assert_array_equal(first[name], kept[name])     # the old buffers were not written again
        np.testing.assert_array_equal(second[name], kept[name])    # the new ones hold the same cache


def test_a_cache_not_handed_over_is_never_written(tmp_path):
    plan = builder_plan(tmp_path)
    runner, model = rank0_runner(plan, tmp_path)
    given = zero_cache(model)
    decode(runner, given, 2, writable=False)
    assert all(not np.any(v) for v in given.values())


def test_device_path_updates_the_bound_tensor(tmp_path):
    plan = builder_plan(tmp_path)
    runner, model = rank0_runner(plan, tmp_path)
    buffers = DeviceBuffers("cpu", 0, [CPU])
    host, _ = decode(runner, zero_cache(model), 4, writable=True)
    cache = {n: buffers.from_host(v) for n, v in zero_cache(model).items()}
    device, kept = decode(runner, cache, 4, writable=True, buffers=buffers)
    for a, b in zip(host, device):
        np.testing.assert_array_equal(a, b)
    assert all(kept[n] is cache[n] for n in cache)


def _gqa_graph(dynamic: bool = False, extra_reader: bool = False, present_dim=CAPACITY):
    past_dim = "past" if dynamic else CAPACITY
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 1, 64]),
              helper.make_tensor_value_info("past_k", TensorProto.FLOAT, [1, 1, past_dim, HEAD_SIZE]),
              helper.make_tensor_value_info("past_v", TensorProto.FLOAT, [1, 1, past_dim, HEAD_SIZE])]
    nodes = [helper.make_node("GroupQueryAttention", ["q", "", "", "past_k", "past_v", "seqlens", "total"],
                              ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=4, kv_num_heads=1)]
    if extra_reader:
        nodes.append(helper.make_node("Identity", ["past_k"], ["copy"]))
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 1, 64]),
               helper.make_tensor_value_info("copy", TensorProto.FLOAT, [1, 1, past_dim, HEAD_SIZE])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, present_dim, HEAD_SIZE])
                for n in ("present_k", "present_v")]
    return nodes, {v.name: v for v in inputs}, {v.name: v for v in outputs}


@pytest.mark.parametrize("dynamic, extra_reader, present_dim, expected", [
    (False, False, CAPACITY, {"present_k": "past_k", "present_v": "past_v"}),
    (False, False, "total", {"present_k": "past_k", "present_v": "past_v"}),   # the builder's own model
    (True, False, "total", {}),                   # a growing cache: present is longer than past
    (False, False, CAPACITY + 1, {}),             # fixed sizes, but present one longer: it grows
    (False, True, CAPACITY, {"present_v": "past_v"}),   # another node reads the past key after the update
])
def test_pairs_only_for_a_fixed_capacity_read_once(dynamic, extra_reader, present_dim, expected):
    nodes, inputs, outputs = _gqa_graph(dynamic, extra_reader, present_dim)
    assert in_place_pairs(nodes, inputs, outputs) == expected


def test_growing_cache_export_has_no_pairs(tmp_path):
    """An optimum export grows its cache by Concat: nothing may be written in place."""
    model = SAMPLE_DIR / "llama_optimum.onnx"
    header = onnx.load(str(model), load_external_data=False)
    weights = {t.name for t in header.graph.initializer}
    assert in_place_pairs(list(header.graph.node), {v.name: v for v in header.graph.input if v.name not in weights},
                          {v.name: v for v in header.graph.output}) == {}


def test_decode_inputs_keep_their_address():
    """A decode step of one shape finds every input the caller does not own at the address
    it had the step before (copied in place into a buffer the session keeps), with the new
    values; a new shape gets a new buffer."""
    import onnxruntime as ort

    from meshplan.runtime.sessions import StageSession

    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n"])
    model = helper.make_model(helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    session = StageSession(model.SerializeToString(), [CPU])
    binding, bound = session.session.io_binding(), {}
    binding.bind_output("y", "cpu")
    addresses = []
    for step in range(3):
        session._bind_feed(binding, bound, "x", np.full(4, step, np.float32))
        addresses.append(session_value_address(bound))
        session.session.run_with_iobinding(binding)
        assert np.array_equal(binding.get_outputs()[0].numpy(), np.full(4, -step, np.float32))
    assert len(set(addresses)) == 1
    session._bind_feed(binding, bound, "x", np.ones(6, np.float32))
    assert session_value_address(bound) != addresses[0]
    assert isinstance(bound[("feed", "x")][1], ort.OrtValue)


def session_value_address(bound: dict) -> int:
    return bound[("feed", "x")][1].data_ptr()


def decode_static(runner: ProgramRunner, cache: dict, steps: int, writable: bool):
    """As ``decode``, but each decode step feeds a mask of the capacity (as ``generate``
    decodes a shared buffer): every decode call has the shapes of the call before."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, (1, 4)).astype(np.int64)
    mask = np.zeros((1, CAPACITY), np.int64)
    length, found = 0, []
    for step in range(steps + 1):
        given = np.ones((1, 4), np.int64) if step == 0 else mask
        out = runner.run({"input_ids": ids, "attention_mask": given, **cache}, one_rank,
                         writable=frozenset(cache) if writable else frozenset())
        found.append(np.array(out["logits"]))
        presents = {n.replace("past_key_values", "present"): n for n in cache}
        cache = {presents[o]: out[o] for o in out if o in presents}
        length += ids.shape[1]
        mask[0, :length] = 1
        ids = found[-1][:, -1:].argmax(-1).astype(np.int64)
    return found, cache


def test_a_repeated_decode_step_only_copies_its_inputs_in(tmp_path, monkeypatch):
    """From the third decode call of one shape on the same cache buffers, a segment that
    writes its cache in place runs again on its kept binding (``_run_again``): the logits
    are the copying runs', the cache is written where it lies; new buffers, another shape
    or a copying run in between take the full path and are right too."""
    from meshplan.runtime.sessions import StageSession

    plan = builder_plan(tmp_path)
    runner, model = rank0_runner(plan, tmp_path)
    repeated = []
    original = StageSession._run_again

    def spy(self, feeds, writable):
        found = original(self, feeds, writable)
        repeated.append(found is not None)
        return found

    monkeypatch.setattr(StageSession, "_run_again", spy)
    expected, _ = decode_static(runner, zero_cache(model), 6, writable=False)
    assert not any(repeated)          # copying runs are never recorded
    caller = zero_cache(model)
    got, cache = decode_static(runner, caller, 6, writable=True)
    assert sum(repeated) >= 4         # decode steps 3 to 6 of each in-place segment
    assert all(cache[n] is caller[n] for n in caller)
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)
    repeated.clear()
    copied, _ = decode_static(runner, zero_cache(model), 6, writable=False)    # in between, not in place
    second = zero_cache(model)
    again, cache = decode_static(runner, second, 6, writable=True)              # new buffers
    assert all(cache[n] is second[n] for n in second)
    for a, b, c in zip(expected, copied, again):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    for name in caller:     # the first buffers were left as the first generation wrote them
        np.testing.assert_array_equal(caller[name], second[name])


def test_a_job_reads_a_reused_outputs_dict_again_when_it_changed(tmp_path):
    """``Job.run`` reads the same ``outputs`` dict once (the generation loop passes one each
    step), and again when its caller changed it in between."""
    from meshplan.runtime.job import Job

    model = SAMPLE_DIR / "genai" / "llama_fp32" / "model.onnx"
    dims, _ = generation_plan_dims(model, 1, CAPACITY, 8)
    make_plan(model, make_cluster((1, 1), "cpu"), dims, tmp_path / "plan", PlanOptions())
    job = Job(tmp_path / "plan", "cpu", cache_in_place=True)
    try:
        ids = np.arange(1, 5, dtype=np.int64)[None]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, 4), np.int64)}
        outputs = {"logits": np.s_[:, -1:]}
        whole = job.run(feeds, outputs={"logits": np.s_[:, :]})["logits"]
        for last in (1, 1, 3, 2):
            job.reset_state()
            outputs["logits"] = np.s_[:, -last:]
            got = job.run(feeds, outputs=outputs)["logits"]
            np.testing.assert_array_equal(got, whole[:, -last:])
    finally:
        job.close()


def test_plain_segments_of_a_repeated_step_run_bound(tmp_path, monkeypatch):
    """Asked with ``bound`` (one microbatch, its results read before the next run), the
    segments that write no cache (a 1x2 plan's MLP halves) run on a binding kept from the
    second run of one shape on: the logits stay the copying runs'. Without ``bound`` they
    never do (the in-process checks run microbatches through one session)."""
    from meshplan.runtime.sessions import StageSession

    plan = builder_plan(tmp_path)
    runner, model = rank0_runner(plan, tmp_path)
    plain = [s.session for s in runner.segments if s.session is not None and not s.session.in_place]
    assert plain, "the 1x2 plan's program has segments without a cache"
    again = []
    original = StageSession._run_again

    def spy(self, feeds, writable):
        found = original(self, feeds, writable)
        if self in plain:
            again.append(found is not None)
        return found

    monkeypatch.setattr(StageSession, "_run_again", spy)
    expected, _ = decode_static(runner, zero_cache(model), 6, writable=True)
    assert not any(again)

    bound_run = runner.run
    monkeypatch.setattr(runner, "run", lambda *a, **k: bound_run(*a, **{**k, "bound": True}))
    got, _ = decode_static(runner, zero_cache(model), 6, writable=True)
    assert sum(again) >= 3 * len(plain)      # decode steps 4 to 6 of every plain segment at least
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)


def _sample_job(tmp_path):
    from meshplan.runtime.job import Job

    model = SAMPLE_DIR / "genai" / "llama_fp32" / "model.onnx"
    dims, _ = generation_plan_dims(model, 1, CAPACITY, 8)
    make_plan(model, make_cluster((1, 1), "cpu"), dims, tmp_path / "plan", PlanOptions())
    return Job(tmp_path / "plan", "cpu", cache_in_place=True)


def _static_steps(job, steps: int, outputs, mask_dtype=np.int64, copy=True, strided=False):
    """A prefill of 4 tokens, then ``steps`` decode steps with a mask of the capacity, each
    fed the token chosen last (``strided``: the mask a view of every other element of a
    wider array); returns each call's logits (as ``Job.run`` gave them)."""
    mask = np.zeros((1, CAPACITY), np.int64)
    prompt = {"input_ids": np.arange(1, 5, dtype=np.int64)[None], "attention_mask": np.ones((1, 4), np.int64)}
    found = [job.run(prompt, outputs=outputs)["logits"]]
    mask[0, :4] = 1
    for step in range(steps):
        mask[0, 4 + step] = 1
        token = np.array([[int(np.asarray(found[-1])[0, -1].argmax())]], np.int64)
        given = mask.astype(mask_dtype)
        if strided:
            wide = np.zeros((1, 2 * CAPACITY), mask_dtype)
            wide[:, ::2] = given
            given = wide[:, ::2]
        found.append(job.run({"input_ids": token, "attention_mask": given}, outputs=outputs, copy=copy)["logits"])
    return found


def test_a_job_call_that_repeats_the_one_before_skips_its_checks(tmp_path, monkeypatch):
    """From the third decode call of one shape on, ``Job.run`` sends the header of the call
    before without checking the call again (``_Repeat``): the logits are those of calls
    that are all checked; a reset state, another dtype, an outputs dict changed in between or
    a view fed take the checks again (a mask of int32 is still refused, in one line)."""
    from meshplan.errors import RunError
    from meshplan.runtime.job import Job

    checked = []
    original = Job._check_call

    def spy(self, *args, **kwargs):
        checked.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Job, "_check_call", spy)
    job = _sample_job(tmp_path)
    try:
        expected = [np.array(x) for x in _static_steps(job, 6, ["logits"])]   # a list: every call checked
        assert len(checked) == 7
        job.reset_state()
        checked.clear()
        outputs = {"logits": np.s_[:, -1:]}
        got = _static_steps(job, 6, outputs)
        assert len(checked) <= 3     # the prefill and the first two decode steps
        for a, b in zip(expected, got):
            np.testing.assert_array_equal(a[:, -1:], b)
        job.reset_state()            # the next call creates the state: checked again, and right
        checked.clear()
        again = _static_steps(job, 2, outputs)
        assert len(checked) == 3
        for a, b in zip(expected, again):
            np.testing.assert_array_equal(a[:, -1:], b)
        job.reset_state()
        with pytest.raises(RunError, match="the plan expects int64"):
            _static_steps(job, 4, outputs, mask_dtype=np.int32)
        job.reset_state()            # the outputs dict changed between repeated calls: read again
        narrow = {"logits": np.s_[:, -1:, :10]}
        first = _static_steps(job, 4, narrow)
        narrow["logits"] = np.s_[:, -1:, :20]
        token = np.array([[int(np.asarray(first[-1])[0, -1].argmax())]], np.int64)
        mask = np.zeros((1, CAPACITY), np.int64)
        mask[0, :9] = 1
        wider = job.run({"input_ids": token, "attention_mask": mask}, outputs=narrow)["logits"]
        assert [x.shape[-1] for x in first] == [10] * 5 and wider.shape[-1] == 20
        job.reset_state()
        checked.clear()
        strided = _static_steps(job, 5, outputs, strided=True)
        assert len(checked) == 6     # a view is not a repeat: every call checked (and made contiguous)
        for a, b in zip(expected, strided):
            np.testing.assert_array_equal(a[:, -1:], b)
    finally:
        job.close()


def test_a_jobs_results_are_its_own_unless_asked_for_views(tmp_path):
    """``Job.run`` hands back copies: a result kept is not changed by the next call. With
    ``copy=False`` (the generation loop's stepper) a repeated step's logits are a view of the
    program's buffer, which the next call overwrites."""
    job = _sample_job(tmp_path)
    try:
        outputs = {"logits": np.s_[:, -1:]}
        kept = _static_steps(job, 5, outputs)
        frozen = [np.array(x) for x in kept]
        for a, b in zip(kept, frozen):
            np.testing.assert_array_equal(a, b)
        job.reset_state()
        views = _static_steps(job, 5, outputs, copy=False)
        assert not np.shares_memory(kept[-1], kept[-2])
        assert np.shares_memory(views[-1], views[-2])
        np.testing.assert_array_equal(views[-1], frozen[-1])
    finally:
        job.close()


def test_a_box_that_is_a_copy_is_taken_again_on_every_repeated_run(tmp_path):
    """Prompt pieces of two tokens on a mask of the capacity repeat their shapes and so reuse
    the logits' buffer; a box of the last two positions' first ten logits is not contiguous
    there (a copy), and each call's must be its own run's, not the call before's."""
    job = _sample_job(tmp_path)
    try:
        def pieces(outputs):
            job.reset_state()
            mask = np.zeros((1, CAPACITY), np.int64)
            found = []
            for piece in range(5):
                mask[0, :2 * piece + 2] = 1
                ids = np.array([[3 + piece, 11 + piece]], np.int64)
                found.append(np.array(job.run({"input_ids": ids, "attention_mask": mask}, outputs=outputs)["logits"]))
            return found

        whole = pieces(None)
        boxed = pieces({"logits": np.s_[:, -2:, :10]})
        assert not whole[3][:, -2:, :10].flags.c_contiguous
        for a, b in zip(whole, boxed):
            np.testing.assert_array_equal(a[:, -2:, :10], b)
        assert not np.array_equal(boxed[3], boxed[4])
    finally:
        job.close()


def test_a_new_request_takes_the_host_cache_back_where_it_is_bound(tmp_path, monkeypatch):
    """On the host path, a reset keeps the cache the job made (``Job._drop_state``): the next
    request's cache is the same arrays, not zeroed, and the sessions keep their bindings. A
    request after a longer one (stale positions past its length in the buffer) gets the
    logits a fresh job gives it; a state set by the caller is not taken again."""
    from meshplan.runtime.job import Job
    from meshplan.runtime.program import ProgramRunner

    released = []
    original = ProgramRunner.release
    monkeypatch.setattr(ProgramRunner, "release", lambda self: (released.append(1), original(self))[1])

    def request(job, prompt, steps):
        mask = np.zeros((1, CAPACITY), np.int64)
        mask[0, :len(prompt)] = 1
        found = [np.array(job.run({"input_ids": np.array([prompt], np.int64), "attention_mask": mask[:, :len(prompt)]},
                                  outputs={"logits": np.s_[:, -1:]})["logits"])]
        for step in range(steps):
            mask[0, len(prompt) + step] = 1
            token = np.array([[int(found[-1][0, -1].argmax())]], np.int64)
            found.append(np.array(job.run({"input_ids": token, "attention_mask": mask},
                                          outputs={"logits": np.s_[:, -1:]})["logits"]))
        return found

    long_prompt, short_prompt = [5, 9, 2, 7, 3, 8, 1, 6], [13, 2, 17]
    fresh = _sample_job(tmp_path)
    try:
        expected = request(fresh, short_prompt, 4)
    finally:
        fresh.close()
    job = Job(tmp_path / "plan", "cpu", cache_in_place=True)
    try:
        request(job, long_prompt, 6)
        first = dict(job.state)
        job.reset_state()
        job.reset_state()          # (twice: nothing more to let go)
        got = request(job, short_prompt, 4)
        assert all(job.state[name] is array for name, array in first.items())
        # the longer request's positions past the shorter one's, still in the buffer (7 to 13)
        assert all(np.any(array[..., len(short_prompt) + 4:len(long_prompt) + 6, :]) for array in first.values())
        assert released == []
        for a, b in zip(expected, got):
            np.testing.assert_array_equal(a, b)
        job.set_state({name: np.zeros_like(array) for name, array in first.items()})
        job.reset_state()
        assert released == [1]     # a state the caller set: let go, the bindings with it
        again = request(job, short_prompt, 4)
        assert not any(job.state[name] is array for name, array in first.items())
        for a, b in zip(expected, again):
            np.testing.assert_array_equal(a, b)
    finally:
        job.close()


def test_no_integer_crosses_a_cut_of_a_builder_program_where_asked(tmp_path):
    """The attention mask's reformat (``seqlens_k``, ``total_sequence_length``) is made in the
    first segment and read after each collective: every segment that reads it makes it again
    from ``attention_mask`` (a CUDA graph's capture refuses the copy to the host that crossing
    on the GPU costs), and no segment hands it on (in a 0.4 B Llama's 1x2 program of 13
    segments, the 5 attention segments before the last did: as many as refused their graphs on
    an H200), with the logits of the segments that let it cross (the default: the
    copies cost the CPU a little, and graphs of several segments wait for a GPU run)."""
    from meshplan.plan_format import COLLECTIVE_DOMAIN

    plan = builder_plan(tmp_path)
    crossing, model = rank0_runner(plan, tmp_path)
    path = tmp_path / "plan" / next(p.file for p in plan.programs if p.rank == 0)
    runner = ProgramRunner(path, [CPU], threads=1, remake_integers=True)
    typed = {v.name: v for v in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)}
    integers = {name for name, v in typed.items()
                if v.type.tensor_type.elem_type in (onnx.TensorProto.INT32, onnx.TensorProto.INT64)}
    graph_inputs = {v.name for v in model.graph.input}
    assert len(runner.segments) > 2
    assert [(i, n) for i, s in enumerate(runner.segments) for n in s.inputs
            if n in integers and n not in graph_inputs] == []
    assert any("attention_mask" in s.inputs for s in runner.segments[1:])
    # nor does a segment hand on the integers a later one makes again: an output bound on the
    # GPU that onnxruntime computes on the host (total_sequence_length) is a copy in the run
    assert [(i, n) for i, s in enumerate(runner.segments) for n in s.outputs if n in integers] == []

    assert [n for s in crossing.segments[1:] for n in s.inputs if n in integers and n not in graph_inputs]
    assert sum(1 for n in model.graph.node if n.domain == COLLECTIVE_DOMAIN) == len(runner.segments) - 1

    feeds = {"input_ids": np.array([[5, 9, 13]], np.int64), "attention_mask": np.ones((1, 3), np.int64)}
    feeds.update(zero_cache(model))
    got = runner.run(dict(feeds), one_rank)["logits"]
    want = crossing.run(dict(feeds), one_rank)["logits"]
    np.testing.assert_array_equal(got, want)


@pytest.mark.mpi
def test_segment_graphs_make_the_integers_in_each_segment_under_mpiexec(tmp_path):
    """``MESHPLAN_SEGMENT_GRAPHS=1`` turns ``remake_integers`` on in a job with graphs (the
    experiment for CUDA graphs of several segments), and the job still generates the same ids."""
    from tests.conftest import run_mpi_script

    builder_plan(tmp_path)
    assert len(run_mpi_script("segment_graphs_case.py", ranks=2, args=[tmp_path / "plan"])) == 3
