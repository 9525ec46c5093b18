"""`pipeline config keys`: a config a user can read. Every key has its doc (the schema's
comment on it), and there are few enough keys to read them all."""

from __future__ import annotations

from pipeline.commands.config_cmd import schema_rows
from pipeline.config import PipelineConfig

# the keys of issue 55's "config a user can read", at most
MAX_KEYS = 130


def test_every_key_has_a_doc():
    rows = schema_rows(PipelineConfig, PipelineConfig())
    undocumented = [key for key, _, doc in rows if not doc.strip()]
    assert not undocumented, f"keys without a comment in the schema: {undocumented}"


# the kernel switches, the critic's policy keys, peak_flops, the channel's internals and
# the supervisor's backoffs went (215 -> 138); then wandb's project and mode (its own
# environment variables), the critic's checkpoint_every (the learner's), the weight
# group's and metadata's deadlines (constants), striped (derived), the pools' device_name
# and rollout.ignore_eos (a dataset row's own) -> 130; learner.lora's four came with the
# weight sync's bucket and apply deadlines (constants), queues.heartbeat_s (a tenth of
# peer_timeout_s) and controller.reward_failure_steps / skipped_update_steps (one
# failed_steps) going -> 130
def test_the_config_has_at_most_max_keys():
    rows = schema_rows(PipelineConfig, PipelineConfig())
    assert len(rows) <= MAX_KEYS, f"{len(rows)} keys: {[key for key, _, _ in rows]}"


def test_an_inherited_key_keeps_its_doc():
    rows = {key: doc for key, _, doc in schema_rows(PipelineConfig, PipelineConfig())}
    # learner.trainer's lr is declared on the critic's section type, which it extends
    assert rows["learner.trainer.lr"] and rows["learner.trainer.lr"] == rows["critic.trainer.lr"]
