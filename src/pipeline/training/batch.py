"""ExperienceBatch: the samples of one training step, as torch tensors.

Token ids are kept per sample (ragged, 1-D tensors) because the learner packs them without
padding. Every per-token field is aligned with the *response* tokens and right-padded to the
batch's longest response, (n, R), which is the (batch, seq) layout that
`pipeline.algorithms` works on; `response_mask` marks the tokens that enter losses and may
have holes (e.g. tool output). Services build batches from decoded numpy arrays with
`from_lists` and take per-sample arrays back out with `unpad`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from pipeline.training.errors import BatchError

if TYPE_CHECKING:
    from pipeline.wire.samples import GroupArrays

# per-token (n, R) fields that may be absent
OPTIONAL_TOKEN_FIELDS = (
    "ref_logprobs",
    "learner_logprobs",
    "values",
    "advantages",
    "returns",
    "rewards",
)
_TOKEN_FIELDS = ("response_mask", "behaviour_logprobs", "token_versions", *OPTIONAL_TOKEN_FIELDS)


def _as_1d(x: Any, dtype: torch.dtype, what: str, i: int) -> Tensor:
    t = torch.as_tensor(np.asarray(x) if not isinstance(x, Tensor) else x).to(dtype)
    if t.dim() != 1:
        raise BatchError(f"{what}[{i}] must be 1-D, got shape {tuple(t.shape)}")
    return t


def pad_right(seqs: Sequence[Tensor], width: int, fill: float | int = 0) -> Tensor:
    """Stack 1-D tensors into (n, width), right-padded with `fill`."""
    dtype = seqs[0].dtype if seqs else torch.float32
    out = torch.full((len(seqs), width), fill, dtype=dtype)
    for i, s in enumerate(seqs):
        out[i, : s.numel()] = s
    return out


@dataclass
class ExperienceBatch:
    """n samples; per-token fields are (n, R) with R the longest response."""

    prompt_ids: list[Tensor]  # n x (P_i,) int64, P_i >= 1
    response_ids: list[Tensor]  # n x (L_i,) int64
    response_mask: Tensor  # (n, R) bool
    behaviour_logprobs: Tensor  # (n, R) float32, the sampler's log-probs
    token_versions: Tensor  # (n, R) int64, policy version that sampled each token
    scores: Tensor  # (n,) float32 sequence-level reward
    uids: list[str]
    group_ids: Tensor  # (n,) int64; samples of one prompt share a value, on every rank
    ref_logprobs: Tensor | None = None  # (n, R) float32
    learner_logprobs: Tensor | None = None  # (n, R) float32, recomputed by the learner
    values: Tensor | None = None  # (n, R) float32, critic values before each response token
    advantages: Tensor | None = None  # (n, R) float32
    returns: Tensor | None = None  # (n, R) float32
    # (n, R) float32 per-token rewards (the score on the last token, minus the KL penalty)
    rewards: Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        if len(self.response_ids) != n or len(self.uids) != n:
            raise BatchError(
                f"prompt_ids ({n}), response_ids ({len(self.response_ids)}) and uids "
                f"({len(self.uids)}) must have one entry per sample"
            )
        width = max((r.numel() for r in self.response_ids), default=0)
        for name in _TOKEN_FIELDS:
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (n, width):
                raise BatchError(f"{name} must be (n, R) = {(n, width)}, got {tuple(t.shape)}")
        for name in ("scores", "group_ids"):
            if tuple(getattr(self, name).shape) != (n,):
                raise BatchError(f"{name} must be ({n},), got {tuple(getattr(self, name).shape)}")
        empty = [i for i, p in enumerate(self.prompt_ids) if p.numel() == 0]
        if empty:
            raise BatchError(
                f"samples {empty[:5]} have empty prompts; the first response token needs a "
                "prompt token to be predicted from (prepend BOS)"
            )
        lengths = self.response_lengths
        beyond = self.response_mask & (torch.arange(width)[None, :] >= lengths[:, None])
        if beyond.any():
            raise BatchError("response_mask marks tokens past the end of their response")

    # -- construction -----------------------------------------------------------------

    @classmethod
    def from_lists(
        cls,
        prompt_ids: Sequence[Any],
        response_ids: Sequence[Any],
        behaviour_logprobs: Sequence[Any],
        scores: Sequence[float] | Any,
        *,
        uids: Sequence[str] | None = None,
        group_ids: Sequence[int] | Any | None = None,
        token_versions: Sequence[Any] | None = None,
        response_mask: Sequence[Any] | None = None,
        **optional: Sequence[Any] | None,
    ) -> ExperienceBatch:
        """Build from per-sample 1-D arrays (numpy, lists or tensors) of varying length.

        Per-token arrays (behaviour_logprobs, token_versions, response_mask and the optional
        ref_logprobs/learner_logprobs/values/advantages/returns/rewards) have one entry per
        token. group_ids default to a hash of the uid before its last '/' (`<prompt uid>/<i>`),
        equal on every rank.
        """
        unknown = sorted(set(optional) - set(OPTIONAL_TOKEN_FIELDS))
        if unknown:
            raise BatchError(f"unknown per-token field(s) {unknown}; use {OPTIONAL_TOKEN_FIELDS}")
        n = len(prompt_ids)
        prompts = [_as_1d(p, torch.long, "prompt_ids", i) for i, p in enumerate(prompt_ids)]
        responses = [_as_1d(r, torch.long, "response_ids", i) for i, r in enumerate(response_ids)]
        lengths = [r.numel() for r in responses]
        width = max(lengths, default=0)

        def per_token(values: Sequence[Any], name: str, dtype: torch.dtype) -> Tensor:
            if len(values) != n:
                raise BatchError(f"{name} has {len(values)} entries for {n} samples")
            seqs = [_as_1d(v, dtype, name, i) for i, v in enumerate(values)]
            for i, (s, length) in enumerate(zip(seqs, lengths, strict=True)):
                if s.numel() != length:
                    raise BatchError(
                        f"{name}[{i}] has {s.numel()} entries for a response of {length} tokens"
                    )
            return pad_right(seqs, width) if seqs else torch.zeros(0, width, dtype=dtype)

        if uids is None:
            uids = [str(i) for i in range(n)]
        if group_ids is None:
            group_ids = group_ids_from_uids(uids)
        if response_mask is None:
            mask = torch.arange(width)[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]
        else:
            mask = per_token(response_mask, "response_mask", torch.bool)
        versions = (
            per_token(token_versions, "token_versions", torch.long)
            if token_versions is not None
            else torch.zeros(n, width, dtype=torch.long)
        )
        extra = {
            name: per_token(v, name, torch.float32) for name, v in optional.items() if v is not None
        }
        return cls(
            prompt_ids=prompts,
            response_ids=responses,
            response_mask=mask.reshape(n, width),
            behaviour_logprobs=per_token(behaviour_logprobs, "behaviour_logprobs", torch.float32),
            token_versions=versions,
            scores=torch.as_tensor(np.asarray(scores, dtype=np.float32)).reshape(n),
            uids=list(uids),
            group_ids=torch.as_tensor(np.asarray(group_ids, dtype=np.int64)).reshape(n),
            **extra,
        )

    @classmethod
    def from_groups(cls, groups: Sequence[GroupArrays]) -> ExperienceBatch:
        """The samples of groups as one batch, in a fixed (uid) order, with every per-token
        field that all samples carry."""
        samples = sorted(((g, s) for g in groups for s in g.samples), key=lambda pair: pair[1].uid)
        optional: dict[str, list[Any]] = {}
        for name in OPTIONAL_TOKEN_FIELDS:
            if samples and all(name in s.extra for _, s in samples):
                optional[name] = [np.asarray(s.extra[name], np.float32) for _, s in samples]
        mask = None
        if any("loss_mask" in s.extra for _, s in samples):  # multi-turn: no loss on env tokens
            mask = [
                np.asarray(s.extra.get("loss_mask", np.ones(len(s.response_ids))), np.float32) > 0
                for _, s in samples
            ]
        return cls.from_lists(
            [np.asarray(g.prompt_ids, np.int64) for g, _ in samples],
            [np.asarray(s.response_ids, np.int64) for _, s in samples],
            [np.asarray(s.behaviour_logprobs, np.float32) for _, s in samples],
            [float(s.score) for _, s in samples],
            uids=[s.uid for _, s in samples],
            token_versions=[np.asarray(s.token_versions, np.int64) for _, s in samples],
            response_mask=mask,
            **optional,
        )

    # -- views ------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_response_len(self) -> int:
        return self.response_mask.shape[1]

    @property
    def response_lengths(self) -> Tensor:
        return torch.tensor([r.numel() for r in self.response_ids], dtype=torch.long)  # (n,)

    @property
    def seq_lengths(self) -> list[int]:
        """Prompt + response tokens per sample: what a forward pass costs."""
        return [
            p.numel() + r.numel() for p, r in zip(self.prompt_ids, self.response_ids, strict=True)
        ]

    def replace(self, **changes: Any) -> ExperienceBatch:
        return dataclasses.replace(self, **changes)

    def select(self, indices: Sequence[int] | Tensor) -> ExperienceBatch:
        """The samples at `indices`, in that order (width kept, so fields stay comparable)."""
        idx = torch.as_tensor(list(map(int, indices)), dtype=torch.long)
        fields: dict[str, Any] = {
            "prompt_ids": [self.prompt_ids[i] for i in idx.tolist()],
            "response_ids": [self.response_ids[i] for i in idx.tolist()],
            "uids": [self.uids[i] for i in idx.tolist()],
            "scores": self.scores[idx],
            "group_ids": self.group_ids[idx],
        }
        width = max((r.numel() for r in fields["response_ids"]), default=0)
        for name in _TOKEN_FIELDS:
            t = getattr(self, name)
            fields[name] = None if t is None else t[idx, :width]
        return ExperienceBatch(**fields)

    def shard(self, rank: int, world_size: int) -> ExperienceBatch:
        """This rank's samples: every world_size-th from `rank` (strided).

        Strided sharding makes each rank's contiguous mini-batch m the rank's share of the
        global contiguous mini-batch m, so a data-parallel step equals a single-process step
        on the whole batch. Groups end up split across ranks; `group_advantages` gathers
        every rank's scores to compute group baselines over the whole batch.
        """
        if not 0 <= rank < world_size:
            raise BatchError(f"rank {rank} is outside world_size {world_size}")
        return self.select(range(rank, self.num_samples, world_size))

    def unpad(self, name: str) -> list[np.ndarray]:
        """A per-token field as one numpy array per sample (its response length)."""
        t = getattr(self, name)
        if t is None:
            raise BatchError(f"field {name} is not set on this batch")
        lengths = self.response_lengths.tolist()
        return [t[i, :n].detach().cpu().numpy() for i, n in enumerate(lengths)]


def group_ids_from_uids(uids: Sequence[str]) -> list[int]:
    """Group id per sample: a stable 63-bit hash of the uid before its last '/'.

    A hash rather than a running index keeps ids equal across ranks and processes, so
    the shards of one batch agree on which samples answer the same prompt.
    """
    return [
        int.from_bytes(hashlib.blake2b(u.rsplit("/", 1)[0].encode(), digest_size=8).digest()) >> 1
        for u in uids
    ]


def group_stats(groups: list[GroupArrays]) -> dict[str, float]:
    """Each stage's per-group measurements (`GroupArrays.stats`), averaged over groups; a
    recompile count (`*/recompiles`, cumulative in its process) is the largest."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for group in groups:
        for key, value in group.stats.items():
            if key.endswith("/recompiles"):
                sums[key] = max(sums.get(key, 0.0), float(value))
                counts[key] = 1
                continue
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}
