"""The weight hub's group members: a tensor-parallel replica joins only once all of its
ranks have registered. One rank alone in the group received a version its leader never
chose to apply, never answered, and the learner's sync hung (a CPU run with
`--services.rollout.tp 2 --services.learner.fsdp_size 2`, striped senders, whose second
rank registered first)."""

from __future__ import annotations

from pipeline.weights.hub import Member, WeightHub


def _member(name: str, replica: int, tp_rank: int = 0, tp_size: int = 1) -> Member:
    return Member(name, name.encode(), replica, 1, "h", tp_rank=tp_rank, tp_size=tp_size)


def test_a_tp_replica_is_a_member_once_every_rank_has_registered():
    hub = WeightHub()
    try:
        hub.members["rollout-0"] = _member("rollout-0", 0)
        hub.members["rollout-1.tp1"] = _member("rollout-1.tp1", 1, 1, 2)
        assert hub.names() == ["rollout-0"]
        hub.members["rollout-1.tp0"] = _member("rollout-1.tp0", 1, 0, 2)
        assert hub.names() == ["rollout-0", "rollout-1.tp0", "rollout-1.tp1"]
        del hub.members["rollout-1.tp0"]  # a rank left: its replica leaves the group
        assert hub.names() == ["rollout-0"]
    finally:
        hub.close()
