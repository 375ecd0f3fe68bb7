"""The state a job holds on its ranks (``HeldState``, a part of ``Job``).

State (``plan.state``): a state output is kept by the ranks that make it, in its planned
layout, and is the next call's input on those ranks: it never goes to rank 0 nor between
ranks, unless ``get_state``/``set_state`` ask. An unset state input is created as zeros at
the call's sizes (its free dims that no other input gives at the bottom of their range: an
empty cache), or as a buffer an earlier state left (``_empty_state``). ``reset_state``
forgets it, ``copy_rows`` copies a cache's rows where they lie, ``save_state_files`` and
``load_state_files`` write and read each rank's own pieces (no rank gathers the state).
"""

from __future__ import annotations

import numpy as np

from meshplan.errors import JobFailure, RunError
from meshplan.runtime.buffers import HOST, DeviceTensor
from meshplan.runtime.interpreter import nbytes
from meshplan.runtime.job_calls import COPY_ROWS, GET_STATE, LOAD_STATE, RESET, SAVE_STATE, SET_STATE, first_line
from meshplan.runtime.state_layout import assemble, copy_cache_rows, distinct_holders, piece_of, state_mesh
from meshplan.sharding import LogicalMesh

_STATE_TAG = 1 << 22   # the tags of state pieces sent between ranks


class HeldState:
    """``Job``'s state operations: the driver's (``reset_state``, ``get_state``, …) and every
    rank's part of them. Reads what ``Job`` sets up: the plan, the transport, the state dict
    and its buffers."""

    def reset_state(self) -> None:
        """Forget every state: the next call starts from empty (driver)."""
        self._require_driver("reset_state")
        self._send_header(self._header(RESET))
        self._drop_state()
        self.state_shapes = {}
        self._tracked = None

    def get_state(self, names=None) -> dict[str, np.ndarray]:
        """The held state, gathered on rank 0, by input name (default: all) (driver)."""
        self._require_driver("get_state")
        chosen = self._state_mask(names)
        self._send_header(self._header(GET_STATE, lambda h: self._fill_mask(h, chosen)))
        try:
            return self._gather_state(chosen)
        except Exception as exc:
            raise JobFailure(f"rank 0 failed: {first_line(exc)}") from exc

    def set_state(self, values: dict[str, np.ndarray]) -> None:
        """Replace state inputs by these arrays (each sent to the ranks that hold it, in its
        layout) (driver)."""
        self._require_driver("set_state")
        by_name = {t.name: t for t in self.plan.inputs}
        for name, value in values.items():
            if name not in self.state_inputs:
                raise RunError(f"{name!r} is not a state input (state: {', '.join(self.state_inputs) or 'none'})")
            array = np.asarray(value)
            if array.ndim != len(by_name[name].shape) or array.dtype != np.dtype(by_name[name].dtype):
                raise RunError(f"state '{name}' needs {len(by_name[name].shape)} dims of {by_name[name].dtype}, "
                               f"got {list(array.shape)} {array.dtype}")
            self._check_divides(name, array.shape)
        chosen = [s["input"] in values for s in self.state_entries]

        def fill(header):
            self._fill_mask(header, chosen)
            k = 2 + sum(len(t.shape) for t in self.inputs)
            for spec in self.state_entries_specs():
                if spec.name in values:
                    header[k + 1:k + 1 + len(spec.shape)] = np.shape(values[spec.name])
                k += 1 + len(spec.shape)

        self._send_header(self._header(SET_STATE, fill))
        try:
            self._scatter_state({n: np.asarray(v, order="C") for n, v in values.items()})
        except Exception as exc:
            raise JobFailure(f"rank 0 failed: {first_line(exc)}") from exc
        for name, value in values.items():
            self.state_shapes[name] = tuple(np.shape(value))
            self._tracked = None

    def copy_rows(self, source: int, target: int, positions: int) -> None:
        """Copy the first ``positions`` positions of every state's row ``source`` into row
        ``target``, on every rank that holds the state (driver): a prompt prefilled once for
        several sequences, or a prefix another row holds (serving). The positions are a
        cache's (axis 2 of a 4-D state, else the second last). Needs what ``row_calls`` needs
        (the state on the host, whole along its batch axis)."""
        self._require_driver("copy_rows")
        if not self.row_calls or self.state_buffers is not HOST or self.header_size < 5:
            raise RunError("this plan's cache rows cannot be copied (it needs host buffers, no microbatches and the "
                           "state whole along the batch)")
        if not all(name in self.state_shapes for name in self.state_inputs):
            raise RunError("copying cache rows needs the state a call of the whole batch made")
        rows = self.state_shapes[next(iter(self.state_inputs))][0]
        if not (0 <= source < rows and 0 <= target < rows and source != target):
            raise RunError(f"copy_rows: rows {source} and {target} of {rows}")

        def fill(header):
            header[2:5] = source, target, positions
        self._send_header(self._header(COPY_ROWS, fill))
        self._copy_rows(source, target, positions)

    def _copy_rows(self, source: int, target: int, positions: int) -> None:
        for array in self.state.values():
            copy_cache_rows(array, source, target, positions)

    def save_state_files(self, directory) -> None:
        """Every working rank writes the state pieces it is the first holder of into
        ``directory/rankN.npz`` (``state_files``): no rank gathers the state (driver)."""
        self._require_driver("save_state_files")
        self._send_header(self._header(SAVE_STATE))
        self._state_files(str(directory), save=True)

    def load_state_files(self, directory) -> None:
        """Every working rank reads its state pieces back from what ``save_state_files`` of a
        job of this same plan wrote (driver)."""
        self._require_driver("load_state_files")
        self._send_header(self._header(LOAD_STATE))
        self._state_files(str(directory), save=False)
        self._tracked = None
        for entry in self.state_entries:
            spec = next(s for s in self.state_entries_specs() if s.name == entry["input"])
            self.state_shapes[entry["input"]] = tuple(spec.shape)

    def _state_files(self, directory: str | None, save: bool) -> None:
        """Save or load on every working rank; the first rank's error stops all of them."""
        from meshplan.runtime.state_files import piece_sources, rank_file, read_pieces, write_pieces

        comm = self.transport.headers
        directory = comm.bcast(directory, root=0) if comm.Get_size() > 1 else directory
        error = None
        try:
            mine = [e for e in self.state_entries if self.rank in self.plan.stages[e["stage"]].devices]
            if save:
                first = [e["input"] for e in mine if self.rank in distinct_holders(self.plan, e)]
                for name in first:
                    if name not in self.state:
                        raise RunError(f"state '{name}' is not set")
                write_pieces(rank_file(directory, self.rank),
                             ((n, np.asarray(self.buffers.to_host(self.state[n]), order="C")) for n in first))
            else:
                by_file: dict[int, set] = {}
                for entry in mine:
                    by_file.setdefault(piece_sources(self.plan, entry)[self.rank], set()).add(entry["input"])
                for source, names in by_file.items():
                    for name, piece in read_pieces(rank_file(directory, source), names):
                        self.state[name] = self.state_buffers.from_host(piece)
                        self._made.pop(name, None)
                        self._kept.pop(name, None)
        except Exception as exc:
            error = f"rank {self.rank}: {first_line(exc)}"
        errors = comm.gather(error, root=0) if comm.Get_size() > 1 else [error]
        if self.rank == 0 and any(errors):
            raise RunError(next(e for e in errors if e))

    def _drop_state(self) -> None:
        """Let the state go. Buffers to take again (``_empty_state``): the device's, and on the
        host a cache updated in place that is still the array the job made (one per state, a
        state the caller sets lets it go). Where every host state is so kept, the sessions keep
        their bindings too: the next request's cache is the same arrays, bound where they were
        (rebinding them cost 55 µs of a 0.1 ms first token on the CPU)."""
        kept = 0
        for name, tensor in self.state.items():
            if isinstance(tensor, DeviceTensor) and tensor.whole:
                self._spare.setdefault((tensor.shape, tensor.dtype.str), {})[name] = tensor
                kept += 1
            elif tensor is self._made.get(name):
                self._kept[name] = tensor
                kept += 1
        holds = self.state_buffers is HOST and kept == len(self.state) and bool(self._kept)
        self.state.clear()
        self._made.clear()
        if self.session is not None and not holds:
            self.session.release()   # the sessions' kept bindings hold the cache buffers too

    def _check_divides(self, name: str, shape) -> None:
        entry = self.state_inputs[name]
        stage = self.plan.stages[entry["stage"]]
        mesh = LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))
        spec = self.state_specs[name]
        if not spec.is_valid_for(tuple(shape), mesh):
            raise RunError(f"state '{name}' of shape {list(shape)} cannot be split as the plan holds it ({spec} "
                           f"over {stage.logical_mesh[0]}x{stage.logical_mesh[1]} devices)")

    def _state_mask(self, names) -> list[bool]:
        if names is None:
            return [True] * len(self.state_entries)
        names = [names] if isinstance(names, str) else list(names)
        for name in names:
            if name not in self.state_inputs:
                raise RunError(f"{name!r} is not a state input (state: {', '.join(self.state_inputs) or 'none'})")
        return [s["input"] in names for s in self.state_entries]

    def _fill_mask(self, header: np.ndarray, chosen: list[bool]) -> None:
        header[self.header_size - len(chosen):] = chosen

    def _empty_state(self, shape, dtype, name: str):
        """A state of zeros, or a buffer of this shape that an earlier state left
        (``_drop_state``), taken again: on the host, the arrays the sessions' bindings hold
        already; on the device, so that its address, which a CUDA graph reads, stays:
        state ``name``'s own where it left one (any other would change the addresses a graph
        of the decode step was captured with: the buffers of two layers swapped at each new
        request, and every other request captured its graph again).
        A cache updated in place keeps what the buffer held (as its positions past a
        sequence's length do: attention never reads them), so a new request copies nothing
        to the device: zeroing a cache of 6 MB from the host took part of an H200's TTFT,
        one of gigabytes would take most of it."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        if self.state_buffers is HOST:   # one buffer kept per state: another shape lets it go
            tensor = self._kept.pop(name, None)
            if tensor is None or tensor.shape != shape or tensor.dtype != dtype:
                tensor = np.zeros(shape, dtype=dtype)
            if self.cache_in_place:
                self._made[name] = tensor
            return tensor
        spare = self._spare.get((shape, dtype.str))
        if spare:
            tensor = spare.pop(name) if name in spare else spare.pop(next(iter(spare)))
            if not self.cache_in_place:
                tensor.value.update_inplace(np.zeros(shape, dtype=dtype))
            return tensor
        return self.state_buffers.from_host(np.zeros(shape, dtype=dtype))

    def _dtype_of(self, name: str) -> str:
        return next(t.dtype for t in self.plan.inputs if t.name == name)

    def _gather_state(self, chosen: list[bool]) -> dict[str, np.ndarray]:
        """The chosen states, whole, on rank 0: one rank per distinct piece sends it."""
        found = {}
        for index, (entry, take) in enumerate(zip(self.state_entries, chosen)):
            if not take:
                continue
            name, spec = entry["input"], self.state_specs[entry["input"]]
            holders = distinct_holders(self.plan, entry)
            pieces = {}
            if self.rank in holders:
                if name not in self.state:
                    raise RunError(f"state '{name}' is not set")
                local = np.asarray(self.buffers.to_host(self.state[name]), order="C")
                if self.rank == 0:
                    pieces[0] = local
                else:
                    self.transport.send(np.array(local.shape, dtype=np.int64), 0, _STATE_TAG + 2 * index)
                    self.transport.send(local, 0, _STATE_TAG + 2 * index + 1)
                    self._send(name, local.nbytes)
            if self.rank == 0:
                for r in holders:
                    if r == 0:
                        continue
                    pieces[r] = self.transport.recv_with_shape(len(spec.dims), self._dtype_of(name), r,
                                                               _STATE_TAG + 2 * index, _STATE_TAG + 2 * index + 1)
                found[name] = assemble(pieces, spec, state_mesh(self.plan, entry))
        return found

    def _scatter_state(self, values: dict | None, header: np.ndarray | None = None) -> None:
        k = 2 + sum(len(t.shape) for t in self.inputs)
        shapes = {}
        for spec in self.state_entries_specs():
            if header is not None:
                shapes[spec.name] = tuple(int(d) for d in header[k + 1:k + 1 + len(spec.shape)])
            k += 1 + len(spec.shape)
        chosen = [s["input"] in values for s in self.state_entries] if values is not None else \
            list(header[self.header_size - len(self.state_entries):].astype(bool))
        for index, (entry, take) in enumerate(zip(self.state_entries, chosen)):
            if not take:
                continue
            name, spec = entry["input"], self.state_specs[entry["input"]]
            stage = self.plan.stages[entry["stage"]]
            mesh = state_mesh(self.plan, entry)
            if self.rank == 0:
                whole = values[name]
                for r in stage.devices:
                    piece = piece_of(whole, spec, mesh, r)
                    if r == 0:   # updated in place: a copy, never the caller's array
                        own = np.array(piece, copy=True) if self.own_state else piece
                        self.state[name] = self.state_buffers.from_host(own)
                        self._made.pop(name, None)
                        self._kept.pop(name, None)
                    else:
                        self.transport.send(piece, r, _STATE_TAG + 2 * index)
                        self._send(name, piece.nbytes)
            elif self.rank in stage.devices:
                local = self.transport.recv(spec.local_shape(shapes[name], mesh), self._dtype_of(name), 0,
                                            _STATE_TAG + 2 * index)
                self.state[name] = self.state_buffers.from_host(local)
                self._made.pop(name, None)
                self._kept.pop(name, None)

    def state_bytes(self) -> int:
        """Bytes of the state this rank holds."""
        return sum(nbytes(self.buffers, v) for v in self.state.values())
