"""Requests and results shared by every engine backend.

The behaviour log-prob of a sampled token is log softmax(logits / temperature) at that token:
the temperature-scaled FULL distribution, before top-k / top-p truncation. That is exactly what
the learner recomputes from its own logits, so the importance ratio compares like with like;
the truncation is a property of the sampler, not of the policy. Greedy rows (temperature 0)
report log softmax(logits), i.e. temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pipeline.engines.errors import InvalidRequestError

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    temperature 0 means greedy. top_k 0 and top_p 1 disable truncation. stop_token_ids end a
    sample (the stop token is part of the output, with its log-prob, because the policy chose
    it). n independent samples of the prompt become n outputs with sample_index 0..n-1. seed
    makes a request's samples reproducible whatever it is batched with; None draws a seed from
    the engine's generator.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not self.temperature >= 0.0:
            raise InvalidRequestError(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise InvalidRequestError(f"n must be >= 1, got {self.n}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete; request_id must be unique among the requests in flight.

    session names a multi-turn episode (params.n must be 1): an engine that keeps sessions
    holds the finished sample's KV cache under it, and the session's next request, whose
    prompt continues that sequence, prefills only the tokens past the cached prefix. The
    caller ends a session with `Engine.release`.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    session: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise InvalidRequestError(f"request {self.request_id!r} has an empty prompt")
        if self.session is not None and self.params.n != 1:
            raise InvalidRequestError(
                f"request {self.request_id!r}: a session continues one sequence, so n must "
                f"be 1 (got {self.params.n})"
            )


@dataclass(frozen=True)
class GenerationOutput:
    """One finished sample; logprobs and token_versions align with output_ids.

    token_versions holds the policy version whose weights produced each token; a sample that
    straddles a weight update carries both versions. cached_tokens: prompt tokens not
    prefilled for this sample: served from its session's kept KV cache, or copied from
    another sample's prefill of the same prompt; kv_evicted: the session's cache had been
    evicted for want of slots, so the whole prompt was prefilled again.
    """

    request_id: str
    sample_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    finish_reason: FinishReason
    cached_tokens: int = 0
    kv_evicted: bool = False
