"""RouterChoice: one order for every process, a spill past a busy router, a failover
past a dead one."""

import pytest

from kvroute.cluster.router_choice import RouterChoice


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_every_process_asks_the_first_router_while_it_keeps_up():
    stats: dict[str, int] = {}
    choices = [RouterChoice(4, stats) for _ in range(3)]  # three ingress processes
    for c in choices:
        for _ in range(10):
            order = c.order()
            assert order == [0, 1, 2, 3]
            c.asking(order[0])
            c.answered(order[0], True)
    assert stats == {"spills": 0, "failovers": 0}


def test_a_router_with_too_many_calls_unanswered_is_passed_over_until_it_answers():
    stats: dict[str, int] = {}
    c = RouterChoice(3, stats, spill_at=2)
    asked = []
    for _ in range(6):  # six calls in flight at once
        i = c.order()[0]
        c.asking(i)
        asked.append(i)
    assert asked == [0, 0, 1, 1, 2, 2] and stats["spills"] == 4
    assert c.order() == [0, 1, 2]  # everyone busy: still in order
    c.answered(0, True)
    assert c.order()[0] == 0 and c.in_flight == [1, 2, 2]


def test_a_router_that_failed_is_skipped_for_down_s_then_asked_first_again():
    clock, stats = Clock(), {}
    c = RouterChoice(3, stats, down_s=5.0, clock=clock)
    c.asking(0)
    c.answered(0, False, last=False)
    assert stats["failovers"] == 1 and c.order() == [1, 2]
    clock.now += 5.0
    assert c.order() == [0, 1, 2]
    for i in range(3):  # every router down: asked in order all the same, the last failure no failover
        c.asking(i)
        c.answered(i, False, last=i == 2)
    assert c.order() == [0, 1, 2] and stats["failovers"] == 3


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_routers"):
        RouterChoice(0)
    with pytest.raises(ValueError, match="spill_at"):
        RouterChoice(2, spill_at=0)


def test_a_router_reporting_its_cpu_near_one_core_is_passed_over_until_the_report_expires():
    """Many ingresses can fill a router's queue with few calls each: its own CPU says so."""
    from kvroute.cluster.router_choice import LOAD_TTL_S

    clock, stats = Clock(), {}
    c = RouterChoice(3, stats, clock=clock)
    c.asking(0)
    c.answered(0, True, load=0.95)
    assert c.order() == [1, 2, 0] and stats["spills"] == 1
    c.asking(1)
    c.answered(1, True, load=0.3)
    assert c.order()[0] == 1
    clock.now += LOAD_TTL_S  # the report expired: asked again, and it reports afresh
    assert c.order() == [0, 1, 2]
    c.asking(0)
    c.answered(0, True, load=0.5)
    assert c.order()[0] == 0 and stats["spills"] == 2


def test_first_answer_fails_over_and_raises_only_when_no_router_answers():
    import asyncio

    stats: dict[str, int] = {}
    c = RouterChoice(2, stats)

    async def dead_first(i):
        if i == 0:
            raise TimeoutError("router 0 down")
        return i

    assert asyncio.run(c.first_answer(dead_first)) == 1 and stats["failovers"] == 1
    assert c.in_flight == [0, 0] and c.order() == [1]

    async def none(i):
        raise TimeoutError(f"router {i} down")

    with pytest.raises(TimeoutError, match="router 1 down"):
        asyncio.run(c.first_answer(none))
