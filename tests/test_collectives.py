"""The two collective timeouts and the stall report, in one process: which timeout is in force
when (recorded through torch.distributed.set_timeout), and what the report says from heartbeats
in a real c10d store.  The real thing, a rank stopped under accelerate launch, is in
test_elastic.py."""

from __future__ import annotations

import json
import time

import pytest
import torch.distributed as dist

from accel_train.run import collectives
from accel_train.run.collectives import LONG_TIMEOUT, CollectiveTimeouts, is_timeout


@pytest.fixture
def set_timeouts(monkeypatch) -> list[tuple[float, object]]:
    calls: list[tuple[float, object]] = []
    monkeypatch.setattr(collectives.dist, "set_timeout",
                        lambda timeout, group=None: calls.append((timeout.total_seconds(), group)))
    return calls


def _timeouts(store=None, fixed=None, rank=0, world_size=2) -> CollectiveTimeouts:
    return CollectiveTimeouts([None, "control"], store, rank, world_size, fixed)


def test_tight_is_twenty_slowest_steps_but_at_least_a_minute(set_timeouts):
    timeouts = _timeouts()
    for seconds in (0.5, 2.0, 1.0):
        timeouts.observe(seconds)
    agreed = []
    timeouts.tighten(lambda mine: agreed.append(mine) or 4.0)  # another rank saw a 4 s step
    assert agreed == [2.0], "this rank offers its slowest step to the agreement"
    assert set_timeouts == [(80.0, None), (80.0, "control")]  # 20 x 4 s, on both groups
    set_timeouts.clear()
    timeouts.tighten(lambda mine: 0.1)
    assert set_timeouts == [(60.0, None), (60.0, "control")]  # never below a minute


def test_the_flag_fixes_the_tight_timeout(set_timeouts):
    timeouts = _timeouts(fixed=7.0)
    timeouts.tighten(lambda mine: 100.0)
    assert set_timeouts == [(7.0, None), (7.0, "control")]


def test_healthy_long_waits_run_under_the_long_timeout_and_tight_comes_back(set_timeouts):
    timeouts = _timeouts(fixed=5.0)
    with timeouts.relaxed():  # before any tighten: the long one is in force already
        pass
    assert set_timeouts == []
    timeouts.tighten(lambda mine: mine)
    set_timeouts.clear()
    with timeouts.relaxed():
        assert set_timeouts == [(LONG_TIMEOUT.total_seconds(), None),
                                (LONG_TIMEOUT.total_seconds(), "control")]
    assert set_timeouts[2:] == [(5.0, None), (5.0, "control")]
    set_timeouts.clear()
    timeouts.relax()  # an epoch end: long until the next epoch's first step tightens again
    timeouts.relax()
    assert set_timeouts == [(LONG_TIMEOUT.total_seconds(), None),
                            (LONG_TIMEOUT.total_seconds(), "control")]


def test_one_process_changes_nothing(set_timeouts):
    timeouts = _timeouts(world_size=1)
    timeouts.tighten(lambda mine: pytest.fail("no agreement with nobody"))
    with timeouts.relaxed():
        timeouts.beat(3)
    assert set_timeouts == []


def _beat(store, rank, step, seconds_ago):
    store.set(collectives.HEARTBEAT_KEY.format(rank),
              json.dumps({"step": step, "time": time.time() - seconds_ago}))


def test_the_report_names_the_ranks_that_never_timed_out_with_their_last_step(set_timeouts,
                                                                             monkeypatch):
    """Four ranks; 0 and 2 time out waiting (2 has said so already); 1 stopped after step 35
    and 3 before its first step: neither says anything within the grace period."""
    monkeypatch.setattr(collectives, "ARRIVAL_GRACE_SECONDS", 0.3)
    store = dist.HashStore()
    timeouts = _timeouts(store=store, fixed=3.0, rank=0, world_size=4)
    timeouts.tighten(lambda mine: mine)
    _beat(store, 0, 35, 3)
    _beat(store, 1, 35, 61)  # the same completed step as rank 0: steps alone cannot tell
    _beat(store, 2, 35, 3)
    store.set(collectives.TIMED_OUT_KEY.format(2), json.dumps({"step": 35}))
    line = timeouts.describe_stall(my_step=35)
    assert line.startswith("a collective waited 3 s for another rank (--collective-timeout); "
                           "this is rank 0, at step 35; stalled: ")
    assert line.endswith("rank 1 (last completed step 35, 61 s ago), rank 3 (no step "
                         "completed)")
    assert store.check([collectives.TIMED_OUT_KEY.format(0)]), "this rank said it timed out"
    # a peer that ended closed its connection: no wait to speak of, and it is gone, not stalled
    line = timeouts.describe_stall(my_step=35, peer_gone=True)
    assert line.startswith("a collective lost another rank: its connection closed (that "
                           "process ended: a crash or a kill; its own output says which); this "
                           "is rank 0, at step 35; gone: ")


def test_a_rank_that_ended_on_an_error_is_named_with_it(set_timeouts, monkeypatch):
    """Rank 1 said, as it ended, which error ended it during step 36 (after 35 completed):
    the rank it left names the error, the step and where its traceback is."""
    monkeypatch.setattr(collectives, "ARRIVAL_GRACE_SECONDS", 0.3)
    store = dist.HashStore()
    _beat(store, 1, 35, 2)
    _timeouts(store=store, rank=1, world_size=3).note_crash(
        35, ValueError("the user's bug\nsecond line"))
    line = _timeouts(store=store, rank=0, world_size=3).describe_stall(my_step=35,
                                                                       peer_gone=True)
    assert line.endswith("gone: rank 1 (ended on ValueError: the user's bug in step 36; its "
                         "traceback in its log, logs/rank1.log), rank 2 (no step completed)")
    # one process, or no store: nothing to tell, nothing raised
    _timeouts(store=None, rank=0).note_crash(3, ValueError("x"))
    alone = dist.HashStore()
    _timeouts(store=alone, rank=0, world_size=1).note_crash(3, ValueError("x"))
    assert not alone.check([collectives.CRASHED_KEY.format(0)])


def test_when_every_rank_timed_out_none_is_named(set_timeouts, monkeypatch):
    monkeypatch.setattr(collectives, "ARRIVAL_GRACE_SECONDS", 5.0)
    store = dist.HashStore()
    store.set(collectives.TIMED_OUT_KEY.format(1), json.dumps({"step": 4}))
    started = time.monotonic()
    line = _timeouts(store=store, rank=0).describe_stall(my_step=4)
    assert time.monotonic() - started < 2, "no waiting once everyone has arrived"
    assert line.endswith("every rank timed out waiting: none stalled alone (a network fault?)")


def test_the_report_when_the_store_does_not_answer():
    class Gone:
        def set_timeout(self, timeout):
            pass

        def set(self, key, value):
            raise RuntimeError("Connection reset by peer")

        check = set

    timeouts = _timeouts(store=Gone(), rank=1)
    line = timeouts.describe_stall(my_step=9)
    assert "this is rank 1, at step 9" in line
    assert "waited 1800 s for another rank (the long timeout)" in line
    assert line.endswith("the process group's store does not answer, so its host (rank 0 or "
                         "the launcher's agent) is the one that stalled")


def test_only_the_first_rank_to_see_it_prints():
    store = dist.HashStore()
    first, second = _timeouts(store=store, rank=0), _timeouts(store=store, rank=2)
    assert first.first_to_report() and not second.first_to_report()


@pytest.mark.parametrize("text, timed_out", [
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms "
     "for recv operation to complete", True),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
     "[127.0.0.1]:43210", True),
    ("Application timeout caused pair closure", True),  # gloo on torch 2.15, seen here
    ("CUDA out of memory", False),
    ("mat1 and mat2 shapes cannot be multiplied", False),
])
def test_what_counts_as_a_collective_timeout(text, timed_out):
    assert is_timeout(RuntimeError(text)) is timed_out
    assert not is_timeout(ValueError(text))



def test_the_heartbeat_is_this_ranks_step_and_time():
    store = dist.HashStore()
    timeouts = _timeouts(store=store, rank=3, world_size=4)
    before = time.time()
    timeouts.beat(17)
    beat = json.loads(store.get(collectives.HEARTBEAT_KEY.format(3)))
    assert beat["step"] == 17 and before <= beat["time"] <= time.time()
    assert not store.check([collectives.HEARTBEAT_KEY.format(0)])


def test_a_rank_that_times_out_a_moment_later_is_not_called_stalled(monkeypatch):
    """The live ranks time out within moments of each other: one that says so 0.3 s after this
    rank, inside the grace period, arrived."""
    import threading

    monkeypatch.setattr(collectives, "ARRIVAL_GRACE_SECONDS", 3.0)
    store = dist.HashStore()
    late = threading.Timer(0.3, lambda: store.set(collectives.TIMED_OUT_KEY.format(1), "4"))
    late.start()
    try:
        line = _timeouts(store=store, rank=0).describe_stall(my_step=4)
    finally:
        late.join()
    assert line.endswith("every rank timed out waiting: none stalled alone (a network fault?)")


def test_without_a_store_or_with_a_broken_one_every_rank_speaks():
    class Broken:
        def add(self, key, amount):
            raise RuntimeError("Connection reset by peer")

    assert _timeouts(store=None).first_to_report()
    assert _timeouts(store=Broken()).first_to_report()
