"""The native decoder shared by llama, qwen2 and qwen3, with Hugging Face parameter names.

Parameter names equal transformers' (`model.embed_tokens.weight`,
`model.layers.0.self_attn.q_proj.weight`, ..., `lm_head.weight`) so that checkpoints,
FSDP state dicts and weight-sync messages use one naming everywhere with no renaming table.
The model knows nothing about parallelism; `parallelize.py` wraps it.

Entry points (each is a separate public method so FSDP can hook each one once):
  forward / hidden_states           (b, s) dense, optional left padding
  forward_packed / hidden_states_packed   (1, total) padding-free packing via cu_seqlens
  token_logprobs                    log p(target) chunked over tokens, for the learner
  forward_cached                    KV-cache prefill/decode for the generation engine
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.models.attention import (
    Attention,
    AttentionSpec,
    cudnn_rows_supported,
    varlen_grouped,
    varlen_supported,
)
from pipeline.models.config import ModelConfig
from pipeline.models.kv_cache import KVCache
from pipeline.models.layers import RMSNorm, RotaryEmbedding, SwiGLU
from pipeline.models.logprobs import chunked_token_logprobs
from pipeline.models.masks import (
    cached_mask,
    packed_causal_mask,
    padded_causal_mask,
    positions_from_mask,
)
from pipeline.models.tied_embedding import TiedGrad, tied_embedding


class DecoderBlock(nn.Module):
    """Pre-norm block; `activation_checkpointing` recomputes it in backward (set by
    parallelize) without a wrapper module, so parameter names stay HF's."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.activation_checkpointing = False
        # set with DecoderTrunk.fused_norm: see forward
        self.fused_norm = False

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        spec: AttentionSpec,
        delta: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The block's output; with `fused_norm`, (h, m) whose sum it is: every residual add
        is then done inside the next norm (models/norm_kernel.py), the block's input is
        x + delta and its output is left unadded for the next block's (or the final) norm."""
        args = (x, cos, sin, spec, delta)
        if self.activation_checkpointing and spec.cache is None and torch.is_grad_enabled():
            return checkpoint(self._block, *args, use_reentrant=False)
        return self._block(*args)

    def _block(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        spec: AttentionSpec,
        delta: torch.Tensor | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused_norm:
            s, y = self.input_layernorm.add_norm(x, delta)  # s = x + delta: the block's input
            h, y = self.post_attention_layernorm.add_norm(s, self.self_attn(y, cos, sin, spec))
            return h, self.mlp(y)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, spec)  # (batch, seq, hidden)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderTrunk(nn.Module):
    """Embeddings, blocks and final norm; HF's `model.` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderBlock(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        # set by the trainer (`trainer.fused_norm`, with every block's): residual adds inside
        # the norms' one-pass op (models/norm_kernel.py)
        self.fused_norm = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        spec: AttentionSpec,
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`embeds`: input_ids' embeddings, looked up by the caller (then input_ids is
        unused): CausalLM's `tied_grad_rows`."""
        x = self.embed_tokens(input_ids) if embeds is None else embeds  # (batch, seq, hidden)
        cos, sin = self.rotary_emb(positions, x.dtype)  # (batch, seq, head_dim)
        if self.fused_norm:
            # the last block's output is x + delta; the first adds zeros, which require
            # grad as later deltas do, so that every layer runs one compiled graph (a None
            # delta, or one that differs in requires_grad, is a variant of its own)
            delta = torch.zeros_like(x).requires_grad_(x.requires_grad)
            for layer in self.layers:
                x, delta = layer(x, cos, sin, spec, delta)
            return self.norm.add_norm(x, delta)[1]
        for layer in self.layers:
            x = layer(x, cos, sin, spec)
        return self.norm(x)  # (batch, seq, hidden)


class DecoderBase(nn.Module):
    """Trunk plus the input-mode plumbing shared by the LM and the value model."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderTrunk(config)
        # optional: runs the packed trunk instead, or returns None (training/trunk_graphs.py
        # replays CUDA graphs of it); a plain attribute, not a submodule
        self.packed_runner: Callable[..., torch.Tensor | None] | None = None
        # set by the trainer (`trainer.uniform_attention`): packed sequences of one length
        # attend as a (rows, length) batch (cuDNN's kernel on CUDA) instead of varlen
        self.uniform_attention = False
        # set by the trainer (`trainer.tied_grad_rows`, tied models in one process): the
        # embedding is looked up outside the trunk and its gradient rows are added into the
        # output layer's gradient in place (models/tied_embedding.py)
        self.tied_grad_rows = False

    # -- trunk entry points (private: public methods must not nest under FSDP hooks) --

    def _dense(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attention_mask is None:
            spec = AttentionSpec()
            if position_ids is None:
                s = input_ids.shape[1]
                position_ids = torch.arange(s, device=input_ids.device).expand_as(input_ids)
        else:
            spec = AttentionSpec(mask=padded_causal_mask(attention_mask))
            if position_ids is None:
                position_ids = positions_from_mask(attention_mask)
        return self.model(input_ids, position_ids, spec, embeds)

    def _packed(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None = None,
        uniform: bool = False,
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """max_seqlen given: the caller vouches that cu_seqlens covers all of input_ids and
        that no sequence is longer, so nothing is read back from the device. uniform: it
        also vouches that every sequence is exactly max_seqlen long (then, with
        `uniform_attention`, they attend as one (rows, max_seqlen) batch)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"packed input_ids must be (1, total), got {tuple(input_ids.shape)}")
        total = input_ids.shape[1]
        # one sequence takes the varlen path: a compiled trunk would specialise on 1 row
        rows = total // max_seqlen if uniform and max_seqlen and total % max_seqlen == 0 else 0
        if self.uniform_attention and rows > 1:
            # probed in bfloat16; used where the activations are half precision
            head_dim = self.config.head_dim
            cudnn = cudnn_rows_supported(input_ids.device, torch.bfloat16, head_dim)
            spec = AttentionSpec(rows=rows, cudnn=cudnn)
            return self.model(input_ids, position_ids, spec, embeds)
        cu = cu_seqlens.to(input_ids.device)
        if varlen_supported(input_ids.device):
            if max_seqlen is None:  # two host syncs
                if int(cu[-1]) < total:  # tail padding: one more sequence of its own
                    cu = torch.cat([cu, cu.new_tensor([total])])
                max_seqlen = int((cu[1:] - cu[:-1]).max())
            grouped = varlen_grouped(input_ids.device)
            spec = AttentionSpec(cu_seqlens=cu, max_seqlen=max_seqlen, grouped=grouped)
            if self.packed_runner is not None and embeds is None:
                hidden = self.packed_runner(input_ids, position_ids, spec)
                if hidden is not None:
                    return hidden
            return self.model(input_ids, position_ids, spec, embeds)
        spec = AttentionSpec(mask=packed_causal_mask(cu, total))
        return self.model(input_ids, position_ids, spec, embeds)

    def _cached(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        kv_len: int | None,
    ) -> torch.Tensor:
        if kv_len is None:
            kv_len = cache.kv_len_for(positions)
        decode = cache.decode_kernel and positions.shape[1] == 1
        spec = AttentionSpec(
            mask=None if decode else cached_mask(positions, kv_len),
            cache=cache,
            slots=slots,
            columns=None if decode else cache.write_index(positions),  # the kernel writes
            kv_len=kv_len,
            decode_lengths=positions[:, 0] + 1 if decode else None,  # padding (-1) reads none
        )
        return self.model(input_ids, positions, spec)

    def init_weights(self, std: float = 0.02) -> None:
        """HF-style init (normal(0, std), zero bias, unit norms); used for fresh models."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, (RMSNorm, RotaryEmbedding)):
                module.reset_parameters()

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (RoPE) after materialising from the meta device."""
        self.model.rotary_emb.reset_parameters()


class CausalLM(DecoderBase):
    """Decoder with an lm_head (tied to embed_tokens when config.tie_word_embeddings)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Re-point lm_head at embed_tokens; needed again after `to_empty` / `_apply`."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (b, s, vocab). attention_mask (b, s) of 1/0 allows left padding; without
        position_ids, positions count real tokens only (0 at each row's first real token)."""
        return self.lm_head(self._dense(input_ids, position_ids, attention_mask))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states (b, s, hidden); feed them to chunked_token_logprobs."""
        return self._dense(input_ids, position_ids, attention_mask)

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None = None,
        uniform: bool = False,
    ) -> torch.Tensor:
        """Logits (1, total, vocab) for sequences packed into one row (no padding compute)."""
        hidden = self._packed(input_ids, position_ids, cu_seqlens, max_seqlen, uniform)
        return self.lm_head(hidden)

    def hidden_states_packed(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None = None,
        uniform: bool = False,
    ) -> torch.Tensor:
        # (1, total, hidden)
        return self._packed(input_ids, position_ids, cu_seqlens, max_seqlen, uniform)

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        target_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        uniform: bool = False,
        chunk_tokens: int = 1024,
        temperature: float = 1.0,
        return_entropy: bool = False,
        keep_logits: bool = False,
        score_index: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """log p(target_ids) (b, s) float32 (and entropy) in one FSDP-hooked call.

        Calling hidden_states + chunked_token_logprobs separately under FSDP would read
        lm_head.weight outside a hooked forward, where it may be a shard; this method keeps
        both inside one. Packed when cu_seqlens is given (then position_ids is required).
        With `score_index` (n,), flat positions of input_ids, only those positions go
        through the output layer and the result is (n,): a learner scores response tokens
        only, and the prompt's share of the lm_head GEMMs and softmax passes is skipped.
        """
        tied = embeds = None
        if self.tied_grad_rows and self.config.tie_word_embeddings:
            tied = TiedGrad()
            embeds = tied_embedding(input_ids, self.lm_head.weight, tied)
        if cu_seqlens is not None:
            if position_ids is None:
                raise ValueError("packed token_logprobs needs position_ids")
            hidden = self._packed(
                input_ids, position_ids, cu_seqlens, max_seqlen, uniform, embeds=embeds
            )
        else:
            hidden = self._dense(input_ids, position_ids, attention_mask, embeds=embeds)
        if score_index is not None:
            # index_select: its backward is one index_add (score_index holds distinct
            # positions); advanced indexing's sorts the indices first (~9 kernels on a GPU)
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, score_index)
            target_ids = target_ids.reshape(-1)[score_index]  # (n,)
        return chunked_token_logprobs(
            hidden,
            self.lm_head.weight,
            target_ids,
            chunk_tokens=chunk_tokens,
            temperature=temperature,
            return_entropy=return_entropy,
            keep_logits=keep_logits,
            tied=tied,
        )

    @torch.no_grad()
    def forward_cached(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        *,
        kv_len: int | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prefill (t > 1) or decode (t = 1) against a slot KV cache; see kv_cache.py.

        input_ids/positions (b, t); positions are absolute positions within each slot, -1 for
        padding (right-padded prompts). slots (b,). kv_len: cache columns to read (default
        max(positions) + 1, a host sync). Returns logits (b, t, vocab), or (b, vocab) at
        token index logits_at (b,) per row, which spares the lm_head for a prefill's prompt.
        """
        hidden = self._cached(input_ids, positions, slots, cache, kv_len)  # (b, t, hidden)
        if logits_at is not None:
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            hidden = hidden[rows, logits_at]  # (b, hidden)
        return self.lm_head(hidden)
