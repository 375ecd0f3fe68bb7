"""A training data set: DATA.npz with one array per input of the step (the model's inputs and
the loss's target), samples on the leading axis. Step k takes the next ``batch`` samples in
order, wrapping around; with ``shuffle``, each pass over the data is a permutation drawn
from a seeded generator (its state is part of a checkpoint)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshplan.errors import TrainError
from meshplan.plan_format import Plan


def step_inputs(plan: Plan) -> list:
    """The inputs a batch must give: the plan's inputs that are neither state nor hyperparameters."""
    state = {entry["input"] for entry in plan.state}
    hyper = set(plan.training.get("hyperparameters", ()))
    return [spec for spec in plan.inputs if spec.name not in state and spec.name not in hyper]


class Batches:
    def __init__(self, path: str | Path, plan: Plan, shuffle: bool = False, seed: int = 0):
        path = Path(path)
        if not path.is_file():
            raise TrainError(f"data file not found: {path}")
        try:
            data = np.load(path, allow_pickle=False)
            arrays = {name: data[name] for name in data.files}
        except Exception as exc:
            raise TrainError(f"{path} is not a readable .npz file ({str(exc).splitlines()[0]})") from None
        # a step's batch: the plan's (one call's) times the microbatches a step accumulates
        self.batch = int(plan.batch["size"]) * int(plan.training.get("microbatches", 1))
        self.arrays, count = {}, None
        for spec in step_inputs(plan):
            if spec.name not in arrays:
                raise TrainError(f"{path} has no array {spec.name!r} (it needs: "
                                 f"{', '.join(s.name for s in step_inputs(plan))})")
            array = arrays[spec.name]
            if array.dtype != np.dtype(spec.dtype):
                raise TrainError(f"{path}: {spec.name!r} is {array.dtype}, the step takes {spec.dtype}")
            if list(array.shape[1:]) != list(spec.shape[1:]):
                raise TrainError(f"{path}: {spec.name!r} has samples of shape {list(array.shape[1:])}, the step "
                                 f"takes {list(spec.shape[1:])} (batch of {self.batch} on the leading axis)")
            if count is not None and array.shape[0] != count:
                raise TrainError(f"{path}: the arrays hold different numbers of samples ({count} and "
                                 f"{array.shape[0]} in {spec.name!r})")
            count = array.shape[0]
            self.arrays[spec.name] = array
        if count is None or count < self.batch:
            raise TrainError(f"{path} holds {count or 0} sample(s), fewer than a batch of {self.batch}")
        self.count, self.shuffle = count, shuffle
        self.rng = np.random.default_rng(seed)
        self.position, self.order = 0, self._order()

    def _order(self) -> np.ndarray:
        return self.rng.permutation(self.count) if self.shuffle else np.arange(self.count)

    def next(self) -> dict[str, np.ndarray]:
        picks = []
        while len(picks) < self.batch:
            if self.position == self.count:
                self.position, self.order = 0, self._order()
            take = min(self.batch - len(picks), self.count - self.position)
            picks.extend(self.order[self.position:self.position + take])
            self.position += take
        index = np.asarray(picks)
        return {name: np.ascontiguousarray(array[index]) for name, array in self.arrays.items()}

    def get_state(self) -> dict:
        return {"position": int(self.position), "order": self.order.tolist() if self.shuffle else None,
                "rng": self.rng.bit_generator.state}

    def set_state(self, state: dict) -> None:
        self.position = int(state["position"])
        self.rng.bit_generator.state = state["rng"]
        self.order = np.asarray(state["order"]) if state.get("order") is not None else self._order()
