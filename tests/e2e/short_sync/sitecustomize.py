"""On PYTHONPATH of a test's run: every process of it takes short weight-sync deadlines for
the weight group's rendezvous, the metadata round, a bucket and an engine's apply (module
constants in `pipeline.weights.config`, which no run config sets), patched in as that
module loads."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

TARGET = "pipeline.weights.config"
GROUP_TIMEOUT_S = 2.0
META_TIMEOUT_S = 1.0
BUCKET_TIMEOUT_S = 1.0
APPLY_TIMEOUT_S = 1.0


class _ShortDeadlines(importlib.abc.MetaPathFinder):
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
            module.GROUP_TIMEOUT_S = GROUP_TIMEOUT_S
            module.META_TIMEOUT_S = META_TIMEOUT_S
            module.BUCKET_TIMEOUT_S = BUCKET_TIMEOUT_S
            module.APPLY_TIMEOUT_S = APPLY_TIMEOUT_S

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _ShortDeadlines())
