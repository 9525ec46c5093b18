"""Sample groups between numpy and the wire: each stage adds fields and passes the rest on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.wire import codec
from pipeline.wire.messages import Sample, SampleGroup, TensorRef

TENSOR_FIELDS = (
    "response_ids",
    "behaviour_logprobs",
    "token_versions",
    "ref_logprobs",
    "values",
    "advantages",
    "returns",
    "rewards",
    "loss_mask",
)


@dataclass
class SampleArrays:
    """One sample as numpy arrays (what services compute on)."""

    uid: str
    response_ids: np.ndarray  # (resp_len,) int32
    behaviour_logprobs: np.ndarray  # (resp_len,) float32
    token_versions: np.ndarray  # (resp_len,) int32
    finish_reason: str = "length"
    response_text: str = ""
    score: float = 0.0
    extra: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class GroupArrays:
    uid: str
    prompt_ids: np.ndarray  # (prompt_len,) int32
    samples: list[SampleArrays]
    data_source: str = ""
    ground_truth: str = ""
    released_version: int = 0
    reward_errors: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    max_new_tokens: int = 0


def staleness(group: GroupArrays, version: int) -> int:
    """How many versions behind the learner the oldest token of the group is."""
    oldest = min(
        (int(s.token_versions.min()) for s in group.samples if len(s.token_versions)),
        default=version,
    )
    return version - oldest


def finished_age(group: GroupArrays, version: int) -> int:
    """How many versions behind the learner the group's newest token is: how long ago its
    generation ended. The learner's staleness bound applies to this, not to the oldest
    token: a long sample whose engine took every update while it ran ends fresh, and its
    older tokens carry their versions and behaviour log-probs for the importance
    correction; a group that ended long ago (an engine cut off from the weights, a backlog
    behind a restarted learner) was made by a policy the run has moved past."""
    newest = max(
        (int(s.token_versions.max()) for s in group.samples if len(s.token_versions)),
        default=version,
    )
    return version - newest


def on_policy(groups: list[GroupArrays], version: int) -> bool:
    """Whether the weights of `version` sampled every token of the groups (no token is
    newer than the learner's weights, so staleness 0 is that)."""
    return all(staleness(g, version) == 0 for g in groups)


def read_group(message: codec.Message) -> GroupArrays:
    body: SampleGroup = message.body
    samples = []
    for s in body.samples:
        extra = {
            name: message.tensor(getattr(s, name))
            for name in TENSOR_FIELDS[3:]
            if getattr(s, name) is not None
        }
        samples.append(
            SampleArrays(
                uid=s.uid,
                response_ids=message.tensor(s.response_ids),
                behaviour_logprobs=message.tensor(s.behaviour_logprobs),
                token_versions=message.tensor(s.token_versions),
                finish_reason=s.finish_reason,
                response_text=s.response_text,
                score=s.score,
                extra=extra,
            )
        )
    return GroupArrays(
        uid=body.uid,
        prompt_ids=message.tensor(body.prompt_ids),
        samples=samples,
        data_source=body.data_source,
        ground_truth=body.ground_truth,
        released_version=body.released_version,
        reward_errors=body.reward_errors,
        stats=dict(body.stats),
        max_new_tokens=body.max_new_tokens,
    )


def write_group(group: GroupArrays, cls: type[SampleGroup]) -> tuple[SampleGroup, codec.TensorPack]:
    pack = codec.TensorPack()

    def ref(array: np.ndarray, dtype: Any) -> TensorRef:
        return pack.add(np.asarray(array, dtype=dtype))

    samples = []
    for s in group.samples:
        optional = {
            name: ref(s.extra[name], np.float32) for name in TENSOR_FIELDS[3:] if name in s.extra
        }
        samples.append(
            Sample(
                uid=s.uid,
                response_ids=ref(s.response_ids, np.int32),
                behaviour_logprobs=ref(s.behaviour_logprobs, np.float32),
                token_versions=ref(s.token_versions, np.int32),
                finish_reason=s.finish_reason,
                response_text=s.response_text,
                score=s.score,
                **optional,
            )
        )
    body = cls(
        uid=group.uid,
        prompt_ids=ref(group.prompt_ids, np.int32),
        samples=samples,
        data_source=group.data_source,
        ground_truth=group.ground_truth,
        released_version=group.released_version,
        reward_errors=group.reward_errors,
        stats=dict(group.stats),
        max_new_tokens=group.max_new_tokens,
    )
    return body, pack
