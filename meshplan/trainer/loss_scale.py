"""The loss scale of a plan with float32 master weights (``meshplan train --loss-scale``),
static or dynamic as torch's ``GradScaler`` keeps it.

``--loss-scale S`` keeps S. ``--loss-scale dynamic[:S]`` starts at S (2^16, GradScaler's
``init_scale``, where not given) and after each step: where the gradients' global norm is
not finite (a scaled float16 gradient overflowed; the step model then left the weights and
slots as they were: ``training.optimizers.build_update``'s guard) it is multiplied by
``backoff_factor`` (½) and the step is skipped; after ``growth_interval`` (2000) finite
steps in a row, by ``growth_factor`` (2). A skipped step does not
count as an optimizer step (AdamW's ``t``), as torch's skipped ``optimizer.step()`` does not;
the learning-rate schedule counts every step, as a scheduler stepped each iteration does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.errors import TrainError

INIT_SCALE, GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL = 2.0 ** 16, 2.0, 0.5, 2000   # GradScaler's defaults


@dataclass
class LossScale:
    scale: float = 1.0
    dynamic: bool = False
    growth_interval: int = GROWTH_INTERVAL
    growth_factor: float = GROWTH_FACTOR
    backoff_factor: float = BACKOFF_FACTOR
    good_steps: int = 0        # finite steps since the scale last changed (GradScaler's growth tracker)

    @classmethod
    def parse(cls, text: str | float, growth_interval: int = GROWTH_INTERVAL, growth_factor: float = GROWTH_FACTOR,
              backoff_factor: float = BACKOFF_FACTOR) -> "LossScale":
        """``S``, ``dynamic`` or ``dynamic:S``; TrainError where it is none of them, or the
        factors are not a growth above 1 and a backoff between 0 and 1."""
        word = str(text).strip()
        dynamic = word == "dynamic" or word.startswith("dynamic:")
        given = word.partition(":")[2] if dynamic else word
        try:
            scale = float(given) if given else INIT_SCALE
        except ValueError:
            raise TrainError(f"--loss-scale must be a positive number, dynamic or dynamic:S, got {word!r}") from None
        if not math.isfinite(scale) or scale <= 0:
            raise TrainError(f"--loss-scale must be a positive number, got {scale:g}")
        if growth_interval < 1:
            raise TrainError(f"--growth-interval must be at least 1, got {growth_interval}")
        if not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise TrainError(f"--growth-factor must be above 1 and --backoff-factor between 0 and 1, got "
                             f"{growth_factor:g} and {backoff_factor:g}")
        return cls(scale, dynamic, growth_interval, growth_factor, backoff_factor)

    @property
    def given(self) -> bool:
        """Whether anything but a static scale of 1 (no scaling) was asked for."""
        return self.dynamic or self.scale != 1.0

    def after(self, grad_norm: float) -> bool:
        """The scale after a step whose gradients' global norm was ``grad_norm``; returns
        whether the step updated the weights (a guarded step with a norm that is not finite
        did not)."""
        if not math.isfinite(grad_norm):
            if self.dynamic:
                self.scale *= self.backoff_factor
                self.good_steps = 0
            return False
        if self.dynamic:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
        return True

    def state(self) -> dict:
        return {"scale": self.scale, "dynamic": self.dynamic, "growth_interval": self.growth_interval,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "good_steps": self.good_steps}

    def resume(self, state: dict | None) -> None:
        """A dynamic scale continues from a checkpoint's (a static one stays as given)."""
        if state and self.dynamic and state.get("dynamic"):
            self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


__all__ = ["BACKOFF_FACTOR", "GROWTH_FACTOR", "GROWTH_INTERVAL", "INIT_SCALE", "LossScale"]
