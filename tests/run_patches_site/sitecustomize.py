"""On PYTHONPATH of a test's run (`tests.run_patches.patched_env`): every process of it
patches a module of the project as it loads, for what no run config sets. The patches are
named in PIPELINE_TEST_PATCHES (comma-separated):

- `compiled_cpu`: a CPU trainer whose kernels are "auto" compiles as a GPU's would (blocks,
  packed micro-batches) with aot_eager (dynamo's frames and guards, no kernels generated),
  so that the compile warm-up and the recompile counters run on CPU;
- `short_sync`: short weight-sync deadlines (the group's rendezvous, the metadata round, a
  bucket, an engine's apply: module constants of `pipeline.weights.config`).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

COMPILED_CPU = {
    "padding_free": True,
    "compile": True,
    "compile_backend": "aot_eager",
    "compile_scope": "blocks",
}
SHORT_SYNC = {
    "GROUP_TIMEOUT_S": 2.0,
    "META_TIMEOUT_S": 1.0,
    "BUCKET_TIMEOUT_S": 1.0,
    "APPLY_TIMEOUT_S": 1.0,
}


def _compiled_cpu(module: Any) -> None:
    plain = module.kernel_switches

    def kernel_switches(kernels: Any, device_type: str, **kwargs: Any) -> Any:
        if kernels == "auto" and device_type != "cuda":
            return dict(COMPILED_CPU)
        return plain(kernels, device_type, **kwargs)

    module.kernel_switches = kernel_switches


def _short_sync(module: Any) -> None:
    for name, value in SHORT_SYNC.items():
        setattr(module, name, value)


PATCHES: dict[str, tuple[str, Callable[[Any], None]]] = {
    "compiled_cpu": ("pipeline.training.config", _compiled_cpu),
    "short_sync": ("pipeline.weights.config", _short_sync),
}


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, patch: Callable[[Any], None]) -> None:
        self.target, self.patch = target, patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.target:
            return None
        sys.meta_path.remove(self)  # the real finder from here on
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


for _name in filter(None, os.environ.get("PIPELINE_TEST_PATCHES", "").split(",")):
    sys.meta_path.insert(0, _PatchOnLoad(*PATCHES[_name]))
