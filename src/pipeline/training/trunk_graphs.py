"""The learner's packed trunk forward and backward replayed from CUDA graphs of our own.

`compile_mode = "reduce-overhead"` already replays the compiled trunk from CUDA graphs, but
each call still walks dynamo's guards, AOT autograd's runtime wrappers and the graph trees'
input and liveness checks over the ~290 parameter inputs of a 0.5B model. `TrunkGraphs`
captures the trunk (compiled without CUDA graphs) once per packed shape with
`torch.cuda.make_graphed_callables`, forward and backward, and replays them through one
autograd function: a call checks the parameters' addresses, copies the three index inputs
and launches one graph. The trunk's forward call returns about twice as fast, but the
step took about as long (docs/performance.md): the trees' replay starts early in their
call, so little of their overhead held the device back.

Shapes: the packer buckets them (`trainer.pack_bucket_tokens`): tokens, the number of
cu_seqlens entries and max_seqlen, with the varlen grouping flag, key one graph pair. All
pairs share one memory pool, which is safe because the learner replays them strictly as
forward then backward of one micro-batch, and every output a later replay could overwrite
(the hidden states, the parameters' gradients) is consumed first: `TrainEngine.begin_forward`
moves pending gradients to float32 before each forward. The parameters must keep the
addresses they had at capture (the compute copies of `ComputeWeights`, one fixed buffer);
a call that finds them elsewhere, or without gradients, or anywhere but CUDA, runs the
trunk as it is (`None` back to the caller).

Known: the parameters' gradient accumulators are created during the capture, on the side
stream make_graphed_callables captures on, and live on with the captured autograd graph;
autograd warns once that their stream differs and syncs the two streams in each backward.
An accumulator of the default stream alive at a capture cannot be synced with inside it
(cudaErrorStreamCaptureImplicit): the trainer lets each micro-batch's graph die before the
next forward (`TrainEngine.run_epochs`) so that none is. Should a capture fail all
the same, the training graphs go off for the run and the trunk trains itself.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from pipeline.log import get_logger
from pipeline.models.attention import AttentionSpec
from pipeline.training.precision import data_ptrs_equal

_log = get_logger("training.trunk_graphs")


class _PackedTrunk(nn.Module):
    """The trunk with the packed attention spec's host values fixed (the graphed callable
    takes tensors only)."""

    def __init__(self, trunk: nn.Module, max_seqlen: int, grouped: bool) -> None:
        super().__init__()
        self.trunk = trunk
        self.max_seqlen = max_seqlen
        self.grouped = grouped

    def forward(self, input_ids: Tensor, positions: Tensor, cu_seqlens: Tensor) -> Tensor:
        spec = AttentionSpec(
            cu_seqlens=cu_seqlens, max_seqlen=self.max_seqlen, grouped=self.grouped
        )
        return self.trunk(input_ids, positions, spec)


class _ForwardGraph:
    """One no-grad forward of the packed trunk captured for one shape: static inputs copied
    in, one replay, the output copied out (the next replay overwrites it)."""

    def __init__(self, module: nn.Module, sample: tuple[Tensor, ...], pool: Any) -> None:
        self.inputs = tuple(x.clone() for x in sample)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiled code and allocator settle outside the capture
                module(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = module(*self.inputs)

    def __call__(self, *inputs: Tensor) -> Tensor:
        for static, x in zip(self.inputs, inputs, strict=True):
            static.copy_(x)
        self.graph.replay()
        return self.output.clone()


class TrunkGraphs:
    """Graphed packed trunk, per shape: the training forward + backward pair (`train`),
    and the forward alone under no_grad (`no_grad`)."""

    def __init__(
        self, trunk: nn.Module, *, max_graphs: int = 16, train: bool = True, no_grad: bool = True
    ) -> None:
        self.trunk = trunk
        self.max_graphs = max_graphs
        self.train = train
        self.no_grad = no_grad
        self.params = list(trunk.parameters())
        self._graphs: dict[tuple[Any, ...], tuple[nn.Module, list[int]]] = {}
        self._forwards: dict[tuple[Any, ...], tuple[_ForwardGraph, list[int]]] = {}
        self._pool: Any = None
        # no-grad replays may come between a training forward and its backward (another
        # thread's reference forward): their memory never overlaps the training graphs'
        self._forward_pool: Any = None
        self._full_warned = False
        self.replays = 0  # graphed calls
        self.fallbacks = 0  # calls the trunk ran itself (graphs full, weights moved)
        self.capture_failures = 0

    def __call__(self, input_ids: Tensor, positions: Tensor, spec: AttentionSpec) -> Tensor | None:
        """The trunk's hidden states (1, T, hidden) from the graphs, or None where they do
        not apply (the caller then runs the trunk itself)."""
        cu = spec.cu_seqlens
        if cu is None or not input_ids.is_cuda or torch.cuda.is_current_stream_capturing():
            return None
        grad = torch.is_grad_enabled()
        if grad and not (self.train and self.trunk.training):
            return None
        if not grad and not self.no_grad:
            return None
        key = (
            tuple(input_ids.shape),
            cu.numel(),
            spec.max_seqlen,
            spec.grouped,
            self.params[0].dtype,
        )
        graphs: dict[tuple[Any, ...], Any] = self._graphs if grad else self._forwards
        entry = graphs.get(key)
        if entry is None:
            if len(graphs) >= self.max_graphs:
                if not self._full_warned:
                    self._full_warned = True
                    _log.warning("trunk_graphs_full", graphs=len(graphs), shape=key[:4])
                self.fallbacks += 1
                return None
            capture = self._capture if grad else self._capture_forward
            entry = capture(key, input_ids, positions, cu, spec)
            if entry is None:
                return None
        graphed, addresses = entry
        if not data_ptrs_equal(self.params, addresses):  # not the capture's compute copies
            self.fallbacks += 1
            return None
        self.replays += 1
        if not grad:
            return graphed(input_ids, positions, cu)
        module = cast(nn.Module, graphed)  # from _capture
        return module.forward(input_ids, positions, cu)  # the graphed forward, no hooks

    def _capture_forward(
        self,
        key: tuple[Any, ...],
        input_ids: Tensor,
        positions: Tensor,
        cu: Tensor,
        spec: AttentionSpec,
    ) -> tuple[_ForwardGraph, list[int]]:
        if self._forward_pool is None:
            self._forward_pool = torch.cuda.graph_pool_handle()
        module = _PackedTrunk(self.trunk, spec.max_seqlen, spec.grouped)
        graph = _ForwardGraph(module, (input_ids, positions, cu), self._forward_pool)
        entry = (graph, [p.data_ptr() for p in self.params])
        self._forwards[key] = entry
        _log.info("trunk_forward_graph_captured", shape=key[:4], graphs=len(self._forwards))
        return entry

    def _capture(
        self,
        key: tuple[Any, ...],
        input_ids: Tensor,
        positions: Tensor,
        cu: Tensor,
        spec: AttentionSpec,
    ) -> tuple[nn.Module, list[int]] | None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        module = _PackedTrunk(self.trunk, spec.max_seqlen, spec.grouped)
        sample = (input_ids.clone(), positions.clone(), cu.clone())  # the static inputs
        stream = torch.cuda.current_stream()
        try:
            graphed = torch.cuda.make_graphed_callables(
                module, sample, num_warmup_iters=2, pool=self._pool
            )
        except RuntimeError as e:  # torch.AcceleratorError: the capture is ended, not sticky
            self._give_up(key, stream, e)
            return None
        entry = (cast(nn.Module, graphed), [p.data_ptr() for p in self.params])
        self._graphs[key] = entry
        _log.info("trunk_graph_captured", shape=key[:4], graphs=len(self._graphs))
        return entry

    def _give_up(self, key: tuple[Any, ...], stream: Any, error: Exception) -> None:
        """A failed training capture: the trunk trains itself from now on (the run goes on,
        slower), said once in the log. torch.cuda.graph leaves the capture stream current
        when its exit raises."""
        torch.cuda.set_stream(stream)
        torch.cuda.synchronize()
        self.train = False
        self.capture_failures += 1
        self.fallbacks += 1
        _log.warning(
            "trunk_graphs_off",
            shape=key[:4],
            error=str(error).splitlines()[0],
            why="a training capture failed; the trunk runs itself",
        )
        return None
