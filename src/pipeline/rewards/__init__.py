"""Rule-based rewards: verifiers, a name registry, and an isolated batched scorer."""
