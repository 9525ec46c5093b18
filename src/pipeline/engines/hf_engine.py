"""Reference backend on `transformers` `generate`: static batches, same interface.

It exists to check the built-in engine against an independent implementation and as the
baseline of the rollout benchmark (`static_cache=True, compile=True` is transformers' fastest
path). A step takes up to max_batch waiting samples that share sampling parameters, runs one
`generate` call to completion and returns them all, so every token of a step carries the
same policy version; weight updates land between `generate` calls.

Behaviour log-probs come from `output_logits` (raw logits, before any logits processor):
log_softmax(logits / temperature), the same convention as the built-in engine. Sampling
uses torch's global generator inside `torch.random.fork_rng`, seeded per batch from the
samples' keys, so a batch is reproducible but a sample depends on its batch companions.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.engines.base import Engine
from pipeline.engines.errors import BackendUnavailableError, InvalidRequestError
from pipeline.engines.rng import mix32_int, sample_key
from pipeline.engines.types import (
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
)
from pipeline.engines.weights import ModelWeights, ModuleWeightsEngine
from pipeline.log import get_logger

_log = get_logger("engines.hf")
_PAD_ID = 0


@dataclass(frozen=True)
class HFEngineConfig:
    """max_batch: samples per generate call. static_cache: transformers' StaticCache.
    compile: let transformers torch.compile the decode forward (it does so only with a
    static cache; on CPU only through an explicit compile_config). attn_implementation:
    None lets transformers choose (SDPA where the architecture supports it, else eager:
    Gemma 2's soft-capped attention), as the learner's transformers path does."""

    max_batch: int = 32
    static_cache: bool = False
    compile: bool = False
    attn_implementation: str | None = None
    seed: int = 0


@dataclass
class _HFSample:
    request_id: str
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    key: int


def _batch_signature(params: SamplingParams) -> tuple[Any, ...]:
    """Samples can share one generate call only if every generation setting agrees."""
    return (
        params.temperature,
        params.top_p,
        params.top_k,
        params.max_new_tokens,
        params.stop_token_ids,
    )


class HFEngine(ModuleWeightsEngine, Engine):
    """transformers AutoModelForCausalLM over a local HF directory."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        config: HFEngineConfig | None = None,
    ) -> None:
        try:
            import transformers
        except ImportError as err:
            raise BackendUnavailableError(
                "the 'hf' engine needs transformers; install the test extra "
                "(pip install -e '.[test]')"
            ) from err
        self.config = config or HFEngineConfig()
        self.device = torch.device(device)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_path),
            dtype=dtype if dtype is not None else "auto",
            attn_implementation=self.config.attn_implementation,
        ).to(self.device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to)
        self.model.eval()
        # generation defaults of the checkpoint (eos ids, top_k=50, ...) must not leak in:
        # every setting comes from SamplingParams
        self.model.generation_config = transformers.GenerationConfig(pad_token_id=_PAD_ID)
        self._generation_config_cls = transformers.GenerationConfig
        self.vocab_size = int(self.model.config.vocab_size)
        self.weights = ModelWeights(self.model)
        self._seed_gen = torch.Generator().manual_seed(self.config.seed)
        self._waiting: deque[_HFSample] = deque()
        self._unfinished: dict[str, int] = {}
        self._paused = False

    # -- Engine interface ------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.weights.version

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    def add_request(self, request: GenerationRequest) -> None:
        prompt = list(request.prompt_ids)
        if request.request_id in self._unfinished:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise InvalidRequestError(
                f"request {request.request_id!r}: prompt ids must lie in [0, {self.vocab_size})"
            )
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen).item())
        for index in range(request.params.n):
            key = sample_key(seed, index)
            self._waiting.append(_HFSample(request.request_id, index, prompt, request.params, key))
        self._unfinished[request.request_id] = request.params.n

    @torch.no_grad()
    def step(self) -> list[GenerationOutput]:
        if self.weights.has_pending() and (version := self.weights.apply()) is not None:
            _log.info("weights applied", version=version)
        if self._paused or not self._waiting:
            return []
        batch = self._take_batch()
        outputs = self._generate(batch)
        for out in outputs:
            left = self._unfinished[out.request_id] - 1
            if left:
                self._unfinished[out.request_id] = left
            else:
                del self._unfinished[out.request_id]
        return outputs

    # -- internals -------------------------------------------------------------------------

    def _take_batch(self) -> list[_HFSample]:
        signature = _batch_signature(self._waiting[0].params)
        batch: list[_HFSample] = []
        rest: deque[_HFSample] = deque()
        while self._waiting and len(batch) < self.config.max_batch:
            sample = self._waiting.popleft()
            (batch if _batch_signature(sample.params) == signature else rest).append(sample)
        rest.extend(self._waiting)
        self._waiting = rest
        return batch

    def _generate(self, batch: list[_HFSample]) -> list[GenerationOutput]:
        params = batch[0].params
        width = max(len(s.prompt_ids) for s in batch)
        ids = torch.tensor(
            [[_PAD_ID] * (width - len(s.prompt_ids)) + s.prompt_ids for s in batch],
            device=self.device,
        )  # (b, width), left padded
        mask = torch.tensor(
            [[0] * (width - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in batch],
            device=self.device,
        )  # (b, width)
        gen_config = self._generation_config(params)
        seed = 0
        for s in batch:
            seed = mix32_int(seed ^ (s.key & 0xFFFFFFFF))
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            result = self.model.generate(
                input_ids=ids, attention_mask=mask, generation_config=gen_config
            )
        new_tokens = result.sequences[:, width:]  # (b, steps)
        logits = torch.stack(result.logits, dim=1).float()  # (b, steps, vocab)
        if not params.greedy:
            logits = logits / params.temperature
        logprobs = logits.log_softmax(-1).gather(2, new_tokens[..., None]).squeeze(-1)
        return self._outputs(batch, new_tokens, logprobs)

    def _generation_config(self, params: SamplingParams) -> Any:
        stops = list(params.stop_token_ids)
        common: dict[str, Any] = dict(
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0,
            eos_token_id=stops or None,
            pad_token_id=_PAD_ID,
            return_dict_in_generate=True,
            output_logits=True,
            disable_compile=not self.config.compile,
        )
        if self.config.static_cache:
            common["cache_implementation"] = "static"
        if params.greedy:
            return self._generation_config_cls(do_sample=False, **common)
        return self._generation_config_cls(
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 disables transformers' top-k (its default is 50)
            **common,
        )

    def _outputs(
        self, batch: list[_HFSample], new_tokens: torch.Tensor, logprobs: torch.Tensor
    ) -> list[GenerationOutput]:
        tokens_rows = new_tokens.tolist()
        logprob_rows = logprobs.tolist()
        outputs = []
        for s, tokens, lps in zip(batch, tokens_rows, logprob_rows, strict=True):
            stops = s.params.stop_token_ids
            end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
            reason: FinishReason = (
                "stop" if end <= len(tokens) and tokens[end - 1] in stops else "length"
            )
            outputs.append(
                GenerationOutput(
                    request_id=s.request_id,
                    sample_index=s.sample_index,
                    prompt_ids=s.prompt_ids,
                    output_ids=tokens[:end],
                    logprobs=lps[:end],
                    token_versions=[self.version] * end,
                    finish_reason=reason,
                )
            )
        return outputs
