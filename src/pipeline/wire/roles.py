"""The roles of a run and their queues: names only, importable without torch (the CLI)."""

ROLES = ("controller", "rollout", "reward", "critic", "learner", "reference")
# in the order of the chain; "referenced" (the reference service's output) is last so that
# the other queues keep their tcp ports
QUEUES = ("prompts", "rollouts", "scored", "experience", "referenced")
# roles that train with FSDP: fsdp_size > 1 is one torchrun of fsdp_size ranks
TRAINER_ROLES = ("learner", "critic")
