"""Services that tests run in place of the project's own (`services.ROLE.module`): the
plumbing without models, or a learner a test can park at a point of its step."""
