"""The KL coefficient of RLHF's reward: fixed (TRL's PPOTrainer), or adaptive (Ziegler et al.
2019, "Fine-Tuning Language Models from Human Preferences"): the coefficient grows when the policy
drifts past `target` nats from the reference and shrinks when it stays under, by at most 20% of the
error per `horizon` samples, so the drift settles near the target instead of depending on a guess."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class KLController:
    """A fixed coefficient; `update` is a no-op. Its state is part of a checkpoint all the same."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, num_samples: int) -> None:
        """Called once per rollout with the mean per-sequence KL and the number of sequences."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(KLController):
    def __init__(self, kl_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"kl_target and kl_horizon: must be > 0, got {target}, {horizon}")
        super().__init__(kl_coef)
        self.target, self.horizon = float(target), int(horizon)

    def update(self, current_kl: float, num_samples: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * num_samples / self.horizon
