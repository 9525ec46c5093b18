"""Where each finished step's metrics go, as it finishes: `metrics/steps.jsonl`, live
TensorBoard events (`tensorboard/`) and, when enabled, Weights & Biases (wandb's own
WANDB_PROJECT and WANDB_MODE apply; unset, the run is "asyncrl"'s and offline).

One writer, in the controller. A controller that restarts writes again the steps its
journal has and the files lack; TensorBoard is told to drop what an earlier incarnation
wrote from that step on (`purge_step`), so no step shows twice.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal

from pipeline.config.schema import MetricsConfig
from pipeline.log import get_logger
from pipeline.runtime.service import MetricsWriter

# wandb's project and mode when its WANDB_PROJECT / WANDB_MODE are unset: offline writes
# the run under runs/<name>/wandb/ for `wandb sync` later, with no network
WANDB_PROJECT = "asyncrl"
WANDB_MODE: Literal["offline"] = "offline"


class StepLog:
    def __init__(
        self,
        run_dir: Path,
        config: MetricsConfig,
        *,
        written: int,
        run_id: str,
        run_config: dict[str, Any],
    ) -> None:
        """`written`: steps already in steps.jsonl (a restart goes on from there)."""
        self.lines = MetricsWriter(run_dir / "metrics" / "steps.jsonl")
        self.tensorboard = None
        if config.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # a host without the package (an offline GPU host)
                get_logger("step_log").warning(
                    "no_tensorboard_events",
                    error=str(exc),
                    hint="install tensorboard, or set metrics.tensorboard = false",
                )
            else:
                self.tensorboard = SummaryWriter(
                    log_dir=str(run_dir / "tensorboard"), purge_step=written or None
                )
        self.wandb = None
        if config.wandb:
            import wandb

            self.wandb = wandb.init(
                # set, wandb's own variables apply (it reads them where an argument is None)
                project=None if os.environ.get("WANDB_PROJECT") else WANDB_PROJECT,
                name=run_dir.name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                mode=None if os.environ.get("WANDB_MODE") else WANDB_MODE,
                config=run_config,
            )

    def write(self, line: dict[str, Any]) -> None:
        self.lines.write(line)
        step = int(line["step"])
        scalars = {
            k: float(v)
            for k, v in line.items()
            if isinstance(v, int | float)
            and not isinstance(v, bool)
            and k not in ("step", "time")
            and math.isfinite(float(v))
        }
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()  # readable while the run goes on
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        self.lines.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
