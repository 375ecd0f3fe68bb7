"""A call's header and the checks the driver makes before it (``CallHeaders``, a part of ``Job``).

Every call starts with a small broadcast header, an int64 vector whose length the plan
fixes: the operation (``CLOSE``, ``RUN``, …), then for ``RUN`` the call's input shapes, the
state to create and the outputs asked for, each with the box of it rank 0 wants. The driver
builds it (``_run_header``) after checking the call against the plan (``_check_call``: names,
dtypes, sizes within the plan's ranges, the state it creates), and every rank reads it back
(``_parse_run``). A call the driver can check is refused there, with one line, before any
rank hears of it: the job stays usable. A call that repeats the call before (a decode step,
from its second on) sends the header of the one before unchecked (``_Repeat``).

A call of fewer sequences than the held state's batch (``run(..., row=r)``, where
``row_calls`` allows it) runs on rows ``r`` to ``r`` + its batch - 1 of the held state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.errors import RunError
from meshplan.runtime.buffers import HOST
from meshplan.runtime.call_sizes import CallSizes, shape_at
from meshplan.sharding import placement_axes

CLOSE, RUN, RESET, GET_STATE, SET_STATE, STATS, SAVE_STATE, LOAD_STATE, COPY_ROWS = range(9)
END = np.iinfo(np.int64).max      # a slice's stop that means "to the end"
SIZED_KEPT = 512   # calls' checked sizes kept (by shapes): a decode loop's few, a prompt's pieces


def first_line(exc: BaseException) -> str:
    """An exception as one line."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


@dataclass(frozen=True)
class _Repeat:
    """A call that repeats the call before (a decode step, from its second on): the same
    input names, shapes and dtypes, the same ``outputs`` asked for, the state of the
    shapes it leaves (``values``: the call's sizes, ``Job._tracked`` while nothing reset
    or set the state). Such a call has the header of the one before and needs none of its
    checks: ``Job.run`` sends the header and runs."""

    header: np.ndarray
    values: dict                  # the call's sizes (``Job._check_call``), whose state shapes it leaves
    inputs: tuple                 # (name, shape, dtype) in plan order
    outputs: object               # the ``outputs`` argument (the same object each step)
    seen: object                  # a copy of it as it was (a caller may change its dict)

    def feeds(self, inputs: dict, outputs) -> list | None:
        """The call's feeds in plan order, or None where this call is not a repeat."""
        if outputs is not self.outputs or (outputs is not None and outputs != self.seen) \
                or len(inputs) != len(self.inputs):
            return None
        feeds = []
        for name, shape, dtype in self.inputs:
            array = inputs.get(name)
            if array.__class__ is not np.ndarray or array.shape != shape or array.dtype != dtype \
                    or not array.flags.c_contiguous:
                return None
            feeds.append(array)
        return feeds


class CallHeaders:
    """``Job``'s calls checked and put into headers, and read back on every rank (see the
    module). Reads what ``Job`` sets up: the plan, its inputs, outputs and state entries, the
    sizes and the caches of checked calls."""

    @property
    def row_calls(self) -> bool:
        """Whether ``run(..., row=r)`` works: every state held on the host, whole along its
        batch axis on every rank, no microbatches, and a plan whose batch may be 1."""
        plan = self.plan
        dim = plan.batch.get("dim")
        one = self.sizes is not None and dim is not None and (
            (dim in self.sizes.ranges and self.sizes.ranges[dim].accepts(1)) or self.sizes.fixed.get(dim) == 1)
        return bool(self.state_entries) and plan.microbatches == 1 and self.buffers is HOST and one \
            and all(not placement_axes(spec.dims[0]) for spec in self.state_specs.values() if spec.dims)

    def _check_rows(self, row: int, plain: dict, given_state: dict) -> int:
        """The number of rows a call from ``row`` covers (its inputs' batch), or RunError."""
        if not self.row_calls:
            raise RunError("this plan takes no call of some rows (it needs host buffers, no microbatches, the state "
                           "whole along the batch and a batch that may be 1)")
        if given_state:
            raise RunError("a call of some rows runs on the held state: give no state with it")
        shapes = [self.state_shapes.get(name) for name in self.state_inputs]
        if any(shape is None for shape in shapes):
            raise RunError("a call of some rows needs the state a call of the whole batch made")
        dim = self.plan.batch["dim"]
        counts = {int(np.shape(plain[spec.name])[0]) for spec in self.inputs
                  if spec.shape and spec.shape[0] == dim and spec.name in plain and np.ndim(plain[spec.name])}
        if len(counts) != 1:
            raise RunError(f"a call of some rows needs inputs whose first dim is the batch ({dim})")
        count = counts.pop()
        if not (0 <= row and row + count <= shapes[0][0]):
            raise RunError(f"rows {row} to {row + count - 1} are outside the held state's batch of {shapes[0][0]}")
        return count

    def _wanted(self, outputs) -> dict[str, tuple]:
        """``outputs`` read (names → slices); a caller passing the same dict each step (the
        generation loop's stepper) has it read once."""
        last, seen, wanted = self._read_wanted
        if outputs is last and outputs is not None and outputs == seen:   # (the same dict, unchanged)
            return wanted
        wanted = self._read_outputs(outputs)
        if isinstance(outputs, dict):
            self._read_wanted = (outputs, dict(outputs), wanted)
        return wanted

    def _read_outputs(self, outputs) -> dict[str, tuple]:
        names = [t.name for t in self.outputs]
        if outputs is None:   # the plan's outputs (not the ids a job of one rank may choose)
            made_here = {self.chosen, *(self.scorer.outputs if self.scorer is not None else ())}
            return {n: () for n in names if n not in made_here}
        chosen = outputs if isinstance(outputs, dict) else {n: () for n in outputs}
        wanted = {}
        for name, index in chosen.items():
            if name in self.state_outputs:
                raise RunError(f"output '{name}' is state: read it with get_state")
            if name not in names:
                raise RunError(f"the model has no output {name!r} (outputs: {', '.join(names)})")
            index = index if isinstance(index, tuple) else (index,)
            if not all(isinstance(s, slice) and s.step in (None, 1) for s in index):
                raise RunError(f"output '{name}': ask for slices with step 1 (np.s_[:, -1:]), got {index!r}")
            wanted[name] = index
        return wanted

    def _check_call(self, plain: dict, given_state: dict, rows: int | None = None):
        """The call's feeds in plan order, every dim's size, and the state to create (its whole
        shape) — or RunError, one line, before any rank hears of the call. A call of some
        ``rows`` sees the state as that many rows of it."""
        names = {t.name for t in self.inputs}
        extra = sorted(set(plain) - names)
        if extra:
            raise RunError(f"the model has no input {extra[0]!r} (inputs: {', '.join(sorted(names | set(self.state_inputs)))})")
        feeds = []
        for spec, dtype in zip(self.inputs, self._input_dtypes):
            if spec.name not in plain:
                raise RunError(f"input '{spec.name}' is missing")
            array = plain[spec.name]
            if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
                array = np.asarray(array, order="C")
            if array.dtype != dtype:
                if array.dtype.kind == "U" and dtype == np.dtype(object):
                    array = array.astype(object)
                else:
                    raise RunError(f"input '{spec.name}' has dtype {array.dtype}, the plan expects {spec.dtype}")
            feeds.append(array)
        # a decode step has the shapes of the step before: their sizes were checked then
        key = None if given_state else (rows, tuple(f.shape for f in feeds),
                                        tuple(self.state_shapes.get(n) for n in self.state_inputs))
        self._last_key = key
        found = self._sized.get(key) if key is not None else None
        if found is not None:
            return feeds, found[0], found[1]
        sizes = CallSizes(self.sizes)
        for spec, array in zip(self.inputs, feeds):
            sizes.add(spec, array.shape)
        sizes.check_ranges()
        by_name = {t.name: t for t in self.plan.inputs}
        for name in self.state_inputs:
            shape = np.shape(given_state[name]) if name in given_state else self.state_shapes.get(name)
            if shape is not None and rows is not None:
                shape = (rows, *shape[1:])
            if shape is not None:
                if name in given_state and np.asarray(given_state[name]).dtype != np.dtype(by_name[name].dtype):
                    raise RunError(f"state '{name}' has dtype {np.asarray(given_state[name]).dtype}, "
                                   f"the plan expects {by_name[name].dtype}")
                sizes.add(by_name[name], shape)
        values = sizes.values()
        create = {}
        for name in self.state_inputs:
            if name in given_state or self.state_shapes.get(name) is not None:
                continue
            shape = shape_at(by_name[name].shape, values)
            if shape is None:
                raise RunError(f"state '{name}' is not set and its shape {by_name[name].shape} does not follow "
                               "from the call's sizes", hint="set it with set_state, or pass it as an input")
            create[name] = shape
        if key is not None:
            if len(self._sized) >= SIZED_KEPT:
                self._sized.clear()
            self._sized[key] = (values, create)
        return feeds, values, create

    def _run_header(self, feeds: list[np.ndarray], create: dict, wanted: dict) -> np.ndarray:
        """A call's header: kept by the call's shapes and wanted outputs (a decode step's is
        the step before's)."""
        key = None
        if self._last_key is not None:   # (the state it creates follows from the same key: ``_sized``)
            key = (self._last_key, tuple((name, tuple((s.start, s.stop) for s in index))
                                         for name, index in wanted.items()))
            found = self._headers.get(key)
            if found is not None:
                return found.copy()
        header = self._header(RUN, lambda h: self._fill_run(h, feeds, create, wanted))
        if key is not None:
            if len(self._headers) >= SIZED_KEPT:
                self._headers.clear()
            self._headers[key] = header.copy()
        return header

    def _fill_run(self, header: np.ndarray, feeds: list[np.ndarray], create: dict, wanted: dict) -> None:
        k = 2
        for spec, array in zip(self.inputs, feeds):
            header[k:k + len(spec.shape)] = array.shape
            k += len(spec.shape)
        for spec in self.state_entries_specs():
            if spec.name in create:
                header[k] = 1
                header[k + 1:k + 1 + len(spec.shape)] = create[spec.name]
            k += 1 + len(spec.shape)
        for spec in self.outputs:
            if spec.name in wanted:
                header[k] = 1
                box = list(wanted[spec.name]) + [slice(None)] * (len(spec.shape) - len(wanted[spec.name]))
                for d, s in enumerate(box[:len(spec.shape)]):
                    header[k + 1 + 2 * d] = 0 if s.start is None else s.start
                    header[k + 2 + 2 * d] = END if s.stop is None else s.stop
            k += 1 + 2 * len(spec.shape)

    def _track_state(self, values: dict) -> None:
        if values is self._tracked:   # the same sizes as the call before (``_sized``)
            return
        self._tracked = values
        for name, shape in self._state_output_shapes:
            self.state_shapes[name] = shape_at(shape, values)

    def _parse_run(self, header: np.ndarray) -> tuple[list, dict, dict]:
        """A RUN header read: each input's shape, the state to create, the outputs wanted
        (name → slices). Kept by the header's bytes: a decode step's is the step before's."""
        key = header.tobytes()
        found = self._parsed.get(key)
        if found is not None:
            return found
        k = 2
        shapes = []
        for spec in self.inputs:
            shapes.append(tuple(int(d) for d in header[k:k + len(spec.shape)]))
            k += len(spec.shape)
        create = {}
        for spec in self.state_entries_specs():
            if header[k]:
                create[spec.name] = tuple(int(d) for d in header[k + 1:k + 1 + len(spec.shape)])
            k += 1 + len(spec.shape)
        wanted = {}
        for spec in self.outputs:
            if header[k]:
                wanted[spec.name] = tuple(slice(int(header[k + 1 + 2 * d]),
                                                None if header[k + 2 + 2 * d] == END else int(header[k + 2 + 2 * d]))
                                          for d in range(len(spec.shape)))
            k += 1 + 2 * len(spec.shape)
        if len(self._parsed) >= SIZED_KEPT:
            self._parsed.clear()
        found = self._parsed[key] = (shapes, create, wanted)
        return found
