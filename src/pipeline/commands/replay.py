"""`pipeline replay`: feed a recorded queue into one service, in this process.

Nothing else runs: no controller, no sockets. The service is built from the run's
resolved config and sees the recorded messages in recorded order; its outputs are
recorded under `<out>/queues/`, so they can be compared with the original run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from pipeline.config import config_from_json
from pipeline.errors import RecordingError, SchemaMismatch
from pipeline.log import configure_logging
from pipeline.runtime import layout
from pipeline.runtime.service import ServiceContext
from pipeline.wire import codec
from pipeline.wire.recording import QueueReader, QueueRecorder, queue_path


def load_service_class(config: Any, role: str) -> Any:
    """The Service class of `role` in this run: its module's `SERVICE`."""
    return importlib.import_module(config.service_module(role)).SERVICE


async def replay(
    run_dir: Path, role: str, out_dir: Path, *, allow_truncated: bool = False
) -> dict[str, Any]:
    config = config_from_json((run_dir / "config.json").read_text())
    if not config.model.path:
        # the run made its model in its own directory: load that one, not a new one
        from pipeline.tasks.prepare import model_dir

        config = dataclasses.replace(
            config,
            model=dataclasses.replace(config.model, path=str(model_dir(config, run_dir).resolve())),
        )
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    in_queue = layout.input_queue(config, role)
    out_queue = layout.output_queue(config, role)
    assert in_queue is not None
    reader = QueueReader(queue_path(run_dir, in_queue))
    messages = []
    for record in reader:
        try:
            messages.append(record.decode())
        except SchemaMismatch as exc:
            raise RecordingError(
                f"{reader.path}: record {record.index} (offset {record.offset}) does not "
                f"decode: {exc}"
            ) from exc
    if reader.truncated and not allow_truncated:
        raise RecordingError(
            f"{reader.path} is truncated at offset {reader.truncated_at} of {reader.size} "
            f"bytes, after {len(messages)} records; replay those with --allow-truncated"
        )
    ctx = ServiceContext(config=config, role=role, replica=0, run_id=run_id, run_dir=out_dir)
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    service = load_service_class(config, role)(ctx)
    recorder = (
        QueueRecorder(queue_path(out_dir, out_queue), queue=out_queue, run_id=run_id)
        if out_queue
        else None
    )
    produced = 0
    try:
        await service.setup()
        for seq, (body, tensors) in enumerate(await service.replay(messages, run_dir)):
            if recorder is not None:
                recorder.write(
                    codec.encode(
                        body, run_id=run_id, sender=f"replay-{role}", seq=seq, tensors=tensors
                    )
                )
            produced += 1
    finally:
        await service.teardown()
        service.metrics.close()
        if recorder is not None:
            recorder.close()
    result = {"service": role, "inputs": len(messages), "outputs": produced, "out": str(out_dir)}
    if reader.truncated:
        result["truncated_at"] = reader.truncated_at
    return result


def replay_command(args: argparse.Namespace) -> int:
    from pipeline.transport.channel import run_async

    configure_logging()
    run_dir = Path(args.run)
    out = Path(args.out) if args.out else run_dir / "replay" / args.service
    try:
        result = run_async(replay(run_dir, args.service, out, allow_truncated=args.allow_truncated))
    except RecordingError as exc:
        print(f"pipeline replay: error: {exc}", file=sys.stderr)
        return 1
    if "truncated_at" in result:
        print(
            f"pipeline replay: warning: the recording is truncated at offset "
            f"{result['truncated_at']}; {result['inputs']} records replayed",
            file=sys.stderr,
        )
    print(json.dumps(result, indent=2))
    return 0
