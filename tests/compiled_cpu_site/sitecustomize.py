"""On PYTHONPATH of a test's run (`tests.compiled_cpu.compiled_env`): every process of it
compiles a CPU trainer whose kernels are "auto" as a GPU would (blocks, packed micro-batches)
with aot_eager (dynamo's frames and guards, no kernels generated), so that the compile
warm-up and the recompile counters run on CPU. No run config asks for this: a CPU run
compiles nothing."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

TARGET = "pipeline.training.config"
SWITCHES = {
    "padding_free": True,
    "compile": True,
    "compile_backend": "aot_eager",
    "compile_scope": "blocks",
}


class _CompiledOnCpu(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # the real finder from here on
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            plain = module.kernel_switches

            def kernel_switches(kernels: Any, device_type: str, **kwargs: Any) -> Any:
                if kernels == "auto" and device_type != "cuda":
                    return dict(SWITCHES)
                return plain(kernels, device_type, **kwargs)

            module.kernel_switches = kernel_switches

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _CompiledOnCpu())
