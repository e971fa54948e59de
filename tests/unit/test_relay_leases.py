"""What a heartbeat's answer asks of a relay (pure)."""

from __future__ import annotations

from oncely.relay.leases import LeasePlan, plan_tick


def test_shards_not_renewed_are_lost_and_the_rest_shared() -> None:
    plan = plan_tick({0, 1, 2}, handing_off=set(), kept={0, 1}, shards=4, alive=1)
    assert plan == LeasePlan(lost=(2,), take=2)


def test_over_the_share_the_highest_shards_are_handed_off() -> None:
    plan = plan_tick({0, 1, 2, 3}, handing_off=set(), kept={0, 1, 2, 3}, shards=4, alive=2)
    assert plan == LeasePlan(hand_off=(3, 2))


def test_shards_already_handing_off_do_not_count_toward_the_share() -> None:
    plan = plan_tick({0, 1, 2, 3}, handing_off={3}, kept={0, 1, 2, 3}, shards=4, alive=2)
    assert plan == LeasePlan(hand_off=(2,))
    alone = plan_tick(set(), handing_off=set(), kept=set(), shards=4, alive=0)
    assert alone == LeasePlan(take=4)
