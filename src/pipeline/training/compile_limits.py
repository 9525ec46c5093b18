"""How many variants dynamo may compile of one function before it gives up."""

from __future__ import annotations

# dynamo's default (8) is what the trunk's block reaches in its warm-up on a GPU (the
# residual's first layer, grad and no-grad, the rows and varlen paths); past the limit a
# fullgraph region raises and the trainer dies, where one more variant should only cost a
# compile, counted in the step's metrics (`compile/recompiles`)
RECOMPILE_LIMIT = 64


def allow_recompiles() -> None:
    """Raise dynamo's per-function recompile limit (never lower it)."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(
        config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT
    )
