"""Weight sync: the learner publishes new weights to rollout engines in resharded buckets.

See `publisher.py` (learner), `receiver.py` (engine) and docs/architecture.md.
"""

from pipeline.weights.config import MIB, GroupOptions, PublishConfig, SyncTimeouts
from pipeline.weights.hub import WeightHub
from pipeline.weights.plan import BucketPlan, Chunk, TensorSpec
from pipeline.weights.publisher import SyncReport, WeightPublisher
from pipeline.weights.receiver import ApplyFn, WeightReceiver
from pipeline.weights.validate import ParamSpec, params_of, validate_meta

__all__ = [
    "MIB",
    "ApplyFn",
    "BucketPlan",
    "Chunk",
    "GroupOptions",
    "ParamSpec",
    "PublishConfig",
    "SyncReport",
    "SyncTimeouts",
    "TensorSpec",
    "WeightHub",
    "WeightPublisher",
    "WeightReceiver",
    "params_of",
    "validate_meta",
]
