"""One micro-batch through a model: per-response-token log-probs, entropy or values.

Calls the model's own FSDP-registered methods (token_logprobs, forward_packed, forward) so
sharded parameters are gathered inside a hooked call, then gathers the positions that
predict response tokens into the (m, r) layout of the batch's per-token fields.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from pipeline.models import CausalLM, ValueModel
from pipeline.training.batch import ExperienceBatch
from pipeline.training.config import TrainerConfig
from pipeline.training.distributed import all_reduce_ints
from pipeline.training.micro_batching import MicroBatch, plan_forward

_VIEW_WARNING = r"FSDP2-wrapped module .* returned a view tensor"


def micro_logprobs(
    model: CausalLM,
    mb: MicroBatch,
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    keep_logits: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """(logp (m, r), entropy (m, r) or None, anchor) for a micro-batch.

    `anchor` is a scalar 0 * sum(outputs): for an empty (dummy) micro-batch it is the only
    thing to backpropagate, which keeps FSDP's collectives in step with the other ranks.
    """
    with warnings.catch_warnings():
        # token_logprobs returns a view; FSDP2 warns about in-place ops on it, which the
        # gather below never does
        warnings.filterwarnings("ignore", message=_VIEW_WARNING)
        out = model.token_logprobs(
            mb.input_ids,
            mb.target_ids,
            position_ids=mb.position_ids,
            attention_mask=mb.attention_mask,
            cu_seqlens=mb.cu_seqlens,
            max_seqlen=mb.max_seqlen or None,
            uniform=mb.uniform,
            chunk_tokens=chunk_tokens,
            temperature=temperature,
            return_entropy=with_entropy,
            keep_logits=keep_logits,
            score_index=mb.score_index,
        )
    if with_entropy:
        logp_all, ent_all = out
    else:
        logp_all, ent_all = out, None
    anchor = logp_all.sum() * 0.0
    if ent_all is not None:
        anchor = anchor + ent_all.sum() * 0.0
    logp = mb.gather_scored(logp_all)  # (m, r)
    entropy = None if ent_all is None else mb.gather_scored(ent_all)  # (m, r)
    return logp, entropy, anchor


def micro_values(model: ValueModel, mb: MicroBatch) -> tuple[Tensor, Tensor]:
    """(values (m, r) before each response token, anchor) for a micro-batch."""
    if mb.cu_seqlens is not None:
        per_position = model.forward_packed(
            mb.input_ids,
            mb.position_ids,
            mb.cu_seqlens,
            max_seqlen=mb.max_seqlen or None,
            uniform=mb.uniform,
        )
    else:
        per_position = model(mb.input_ids, mb.position_ids, mb.attention_mask)
    anchor = per_position.sum() * 0.0
    return mb.gather(per_position).float(), anchor


def no_grad_plan(batch: ExperienceBatch, config: TrainerConfig) -> list[MicroBatch]:
    """The micro-batches of a no-grad forward over the batch (log-probs, values): the
    inference token budget, the same count on every rank."""
    return plan_forward(
        batch,
        config.infer_tokens,
        padding_free=config.padding_free,
        reduce=all_reduce_ints,
        bucket=config.pack_bucket_tokens,
    )


def response_logprobs(
    model: CausalLM,
    batch: ExperienceBatch,
    config: TrainerConfig,
    device: torch.device,
    before_each: Callable[[], None] | None = None,
) -> Tensor:
    """No-grad log-probs of every response token, (n, R) float32 on the host, 0 where
    masked: the proximal (current policy) and reference forwards. `before_each` runs
    before each micro-batch (a CUDA-graph step mark)."""
    out = torch.zeros(batch.num_samples, batch.max_response_len)  # (n, R)
    for mb in no_grad_plan(batch, config):
        if before_each is not None:
            before_each()
        logp, _, _ = micro_logprobs(
            model,
            mb.to(device),
            chunk_tokens=config.logprob_chunk_tokens,
            temperature=config.temperature,
        )
        if mb.is_empty:
            continue
        mask = mb.fields(batch.response_mask)
        mb.put(out, torch.where(mask, logp.float().cpu(), 0.0))
    return out
