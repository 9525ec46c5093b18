"""What keeps dynamo's variants of a compiled function few, and its limit on them."""

from __future__ import annotations

# dynamo's default (8) is what the trunk's block reaches in its warm-up on a GPU (the
# residual's first layer, grad and no-grad, the rows and varlen paths); past the limit a
# fullgraph region raises and the trainer dies, where one more variant should only cost a
# compile, counted in the step's metrics (`compile/recompiles`)
RECOMPILE_LIMIT = 64


def allow_recompiles() -> None:
    """Raise dynamo's per-function recompile limit (never lower it), and give sizes that
    happen to be equal at the first trace symbols of their own: "duck sizing" would equate
    them (a 64-token prompt and a head_dim of 64, say) and recompile at the next length."""
    import torch._dynamo
    import torch.fx.experimental._config as fx_config

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(
        config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT
    )
    fx_config.use_duck_shape = False
