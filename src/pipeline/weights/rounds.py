"""Learner rank 0's two question rounds with the engines: the metadata round before any
byte moves, and the done round after the last bucket. Each returns "" when every engine
answered well, else a failure text (phase, peer, detail) for every learner rank to raise.

Replies are matched to this attempt: a meta answer echoes the WeightMeta's header seq, and
a WeightDone of an older attempt cannot arrive after this attempt's meta answer (one
ordered connection per engine), so stale replies of a failed sync are never miscounted.
An engine that registers again meanwhile has restarted; it is not dropped (its new
incarnation is a fresh member for the next group) but this sync fails.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from pipeline.weights.control import Received
from pipeline.weights.hub import WeightHub
from pipeline.wire.messages import Hello, WeightDone, WeightMeta
from pipeline.wire.weights import MetaAccepted, MetaRejected, SyncFailure, SyncGo


def failure_text(phase: str, peer: str, detail: str) -> str:
    return msgspec.json.encode(SyncFailure(phase, peer, detail)).decode()


def parse_failure(text: str) -> SyncFailure:
    return msgspec.json.decode(text, type=SyncFailure)


def meta_round(
    hub: WeightHub,
    members: list[str],
    meta: WeightMeta | Mapping[str, WeightMeta],
    timeout_s: float,
) -> str:
    """Send the metadata (one for all, or each member's own: resharded), collect
    accept/refuse, then tell everyone go or abort."""
    metas = meta if isinstance(meta, Mapping) else dict.fromkeys(members, meta)
    attempt = {n: hub.send(n, metas[n]) for n in members}
    version = next(iter(metas.values())).version if metas else -1
    rejected: dict[str, str] = {}
    restarted: list[str] = []

    def on_reply(name: str, rcv: Received) -> bool:
        ctl = rcv.control
        if isinstance(ctl, MetaAccepted) and ctl.attempt == attempt[name]:
            return True
        if isinstance(ctl, MetaRejected) and ctl.attempt == attempt[name]:
            rejected[name] = ctl.error
            return True
        if isinstance(rcv.message.body, Hello):
            restarted.append(name)
            return True
        return False

    answered = hub.collect([n for n in members if attempt[n]], timeout_s, on_reply)
    # not reached: the send itself failed (the engine's connection is gone)
    unreached = [n for n in members if not attempt[n]]
    silent = [n for n in members if n not in answered and attempt[n]]
    proceed = not (silent or unreached or rejected or restarted)
    for name in members:
        if name not in restarted:
            go = SyncGo(version=version, attempt=attempt[name], proceed=proceed)
            hub.send(name, go)
    if proceed:
        return ""
    for name in silent:
        hub.drop(name, f"no answer to WeightMeta v{version} within {timeout_s:.1f}s")
    for name in unreached:
        hub.drop(name, f"WeightMeta v{version} could not be sent: not connected")
    for name, error in rejected.items():
        hub.drop(name, error, rejoin=False)  # it would refuse every update: keep it out
    details = [f"{n}: {e}" for n, e in rejected.items()]
    details += [f"{n}: not connected (the send failed at once)" for n in unreached]
    details += [f"{n}: no answer within {timeout_s:.1f}s" for n in silent]
    details += [f"{n}: restarted" for n in restarted]
    peers = [*rejected, *unreached, *silent, *restarted]
    return failure_text("meta", ", ".join(peers), "; ".join(details))


def done_round(
    hub: WeightHub,
    members: list[str],
    version: int,
    timeout_s: float,
    learner_failure: tuple[str, str] | None,
    failed_anywhere: bool,
) -> str:
    """Collect every engine's WeightDone; name the silent ones first (a dead engine
    explains everyone else's failed collective), else the engines that reported failure
    with their own phase (buckets, apply, ...), else the learner's own failure."""
    failed: dict[str, str] = {}
    restarted: list[str] = []

    def on_reply(name: str, rcv: Received) -> bool:
        body = rcv.message.body
        if isinstance(body, WeightDone) and body.version == version:
            if not body.ok:
                failed[name] = body.error
            return True
        if isinstance(body, Hello):
            restarted.append(name)
            return True
        return False

    answered = hub.collect(members, timeout_s, on_reply)
    silent = [n for n in members if n not in answered]
    if not (failed_anywhere or failed or silent or restarted):
        return ""
    for name in silent:
        hub.drop(name, f"no WeightDone for v{version} within {timeout_s:.1f}s")
    gone = silent + restarted
    if gone:
        phase = "buckets" if failed_anywhere else "done"
        peer = ", ".join(gone)
    elif failed:
        phase = next(iter(failed.values())).split(":", 1)[0]
        peer = ", ".join(failed)
    else:
        phase = "buckets"
        peer = learner_failure[0] if learner_failure else "learner"
    details = [f"{n}: no WeightDone within {timeout_s:.1f}s (dead or stuck)" for n in silent]
    details += [f"{n}: restarted during the update" for n in restarted]
    details += [f"learner: {learner_failure[1]}"] if learner_failure else []
    details += [f"{n}: {e}" for n, e in failed.items()]
    return failure_text(phase, peer, "; ".join(details))
