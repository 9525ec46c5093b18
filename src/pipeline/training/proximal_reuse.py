"""`trainer.reuse_behaviour_logprobs`: which on-policy steps take the engine's log-probs as
the proximal ones, and when a measured mismatch stops that for the run."""

from __future__ import annotations

from pipeline.log import get_logger
from pipeline.training.config import TrainerConfig


class ReuseCheck:
    """When a batch's behaviour log-probs serve as the proximal ones
    (`trainer.reuse_behaviour_logprobs`): on-policy batches only, every
    `reuse_check_every`-th of them (the first too) measured instead, and never again once a
    measured mismatch KL exceeds `reuse_max_mismatch_kl`."""

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.allowed = config.reuse_behaviour_logprobs
        self.on_policy_steps = 0
        self.log = get_logger("training.reuse")

    def reuses(self, on_policy: bool) -> bool:
        if not (on_policy and self.allowed):
            return False
        check = self.on_policy_steps % self.config.reuse_check_every == 0
        self.on_policy_steps += 1
        return not check

    def settle(self, metrics: dict[str, float], *, reused: bool, checked: bool) -> None:
        """A finished step's metrics: the mismatch a reused step did not measure left out,
        a check's mismatch against the bound."""
        metrics["actor/proximal_reused"] = float(reused)
        if reused:
            for key in (
                "mismatch/kl",
                "mismatch/mean_abs_diff",
                "mismatch/truncated_frac",
                "mismatch/same_version_kl",
                "mismatch/same_version_frac",
            ):
                metrics.pop(key, None)
            metrics.pop("mismatch/max_abs_diff", None)
        elif checked and self.allowed:
            kl = metrics.get("mismatch/kl", 0.0)
            if not kl <= self.config.reuse_max_mismatch_kl:
                self.allowed = False
                self.log.warning(
                    "proximal_reuse_stopped",
                    mismatch_kl=kl,
                    bound=self.config.reuse_max_mismatch_kl,
                    message="the engine's log-probs differ from the learner's: every step "
                    "now runs the proximal forward",
                )
