"""The change state machine (tidal.runtime.change): every legal transition,
and every illegal one rejected with IllegalTransition."""

from __future__ import annotations

import dataclasses

import pytest

from tidal.runtime.change import (Abandon, Agree, Change, ChangeKind, ChangeStatus, IllegalTransition, Join, Publish,
                                  Restart, Switch, advance)

K, S = ChangeKind, ChangeStatus


def waiting(kind: ChangeKind = K.SCALE_OUT, **kw: object) -> Change:
    return Change(kind, 100.0, **kw)  # type: ignore[arg-type]


def at(status: ChangeStatus, kind: ChangeKind = K.SCALE_OUT, **kw: object) -> Change:
    return dataclasses.replace(waiting(kind, **kw), status=status)


# ----------------------------------------------------------------------------- legal transitions


@pytest.mark.parametrize("kind", [K.SCALE_OUT, K.MIGRATE])
def test_newcomers_join_one_by_one_then_the_plan_is_published(kind: ChangeKind) -> None:
    c = waiting(kind, expect=("w3", "w4"), leavers=("w0", "w1") if kind is K.MIGRATE else ())
    assert not c.ready and c.pending == f"{kind.value}:waiting"
    c = advance(c, Join("w4"))
    assert c.joiners == ("w4",) and c.status is S.WAITING and not c.ready
    c = advance(c, Join("w3"))
    assert c.joiners == ("w4", "w3") and c.ready
    c = advance(c, Publish(101.5))
    assert c.status is S.PUBLISHED and c.published_at == 101.5 and not c.ready and c.requested_at == 100.0


@pytest.mark.parametrize("kind", list(ChangeKind))
def test_published_agreed_switched(kind: ChangeKind) -> None:
    c = advance(waiting(kind), Publish(1.0))  # nothing awaited: ready at once
    assert c.status is S.PUBLISHED
    c = advance(c, Agree(46))
    assert c.status is S.AGREED and c.agreed_step == 46
    c = advance(c, Agree(46))  # a retried agreement
    assert c.status is S.AGREED and c.agreed_step == 46
    assert advance(c, Switch()).status is S.SWITCHED


def test_a_published_plan_may_switch_without_an_agreement_seen() -> None:
    # e.g. a newcomer died receiving its state: the failure of the new group proves it formed
    assert advance(at(S.PUBLISHED), Switch()).status is S.SWITCHED


@pytest.mark.parametrize("status", [S.WAITING, S.PUBLISHED, S.AGREED])
def test_any_live_change_can_be_abandoned(status: ChangeStatus) -> None:
    c = advance(at(status), Abandon("newcomers did not register in time"))
    assert c.status is S.ABANDONED and c.reason == "newcomers did not register in time"


@pytest.mark.parametrize("status", [S.WAITING, S.PUBLISHED, S.AGREED])
def test_a_scale_out_restarts_from_the_survivors_generation(status: ChangeStatus) -> None:
    c = at(status, expect=("w3",), joiners=("w3",), published_at=5.0, agreed_step=9)
    r = advance(c, Restart(("w0", "w2")))
    assert r == dataclasses.replace(c, status=S.WAITING, published_at=None, agreed_step=None)
    assert r.ready  # its newcomer registered already: the master publishes at once


def test_a_restarted_migration_keeps_its_surviving_leavers() -> None:
    c = at(S.PUBLISHED, K.MIGRATE, expect=("w4", "w5"), joiners=("w4", "w5"), leavers=("w0", "w1"))
    r = advance(c, Restart(("w0", "w2", "w3")))
    assert r.kind is K.MIGRATE and r.leavers == ("w0",) and r.status is S.WAITING and r.joiners == ("w4", "w5")


def test_a_migration_whose_movers_died_becomes_a_scale_out() -> None:
    c = at(S.WAITING, K.MIGRATE, expect=("w4",), leavers=("w1",))
    r = advance(c, Restart(("w0", "w2")))
    assert r.kind is K.SCALE_OUT and r.leavers == () and r.expect == ("w4",)


def test_a_migration_that_would_move_every_survivor_becomes_a_scale_out() -> None:
    # a live worker must stay to send the state
    c = at(S.AGREED, K.MIGRATE, expect=("w4", "w5"), leavers=("w0", "w1"))
    r = advance(c, Restart(("w0", "w1")))
    assert r.kind is K.SCALE_OUT and r.leavers == () and r.status is S.WAITING


def test_a_restarted_suspension_suspends_the_survivors() -> None:
    c = at(S.PUBLISHED, K.SUSPEND, leavers=("w0", "w1", "w2"))
    r = advance(c, Restart(("w0", "w2")))
    assert r.kind is K.SUSPEND and r.leavers == ("w0", "w2") and r.ready


def test_json_round_trip_and_old_snapshots() -> None:
    c = at(S.AGREED, K.MIGRATE, expect=("w4",), joiners=("w4",), leavers=("w1",), published_at=3.0, agreed_step=7)
    d = c.to_json()
    assert d["kind"] == "migrate" and d["status"] == "agreed" and d["leavers"] == ["w1"]
    assert Change.from_json(d) == c
    # a snapshot's change written before leavers and the times were recorded for every kind
    old = Change.from_json({"kind": "scale_out", "status": "waiting", "requested_at": 1, "expect": ["w2"],
                            "joiners": []})
    assert old == Change(K.SCALE_OUT, 1.0, expect=("w2",))


# ----------------------------------------------------------------------------- illegal transitions


@pytest.mark.parametrize("change,event", [
    (at(S.PUBLISHED, expect=("w3",), joiners=("w3",)), Join("w3")),  # not waiting any more
    (waiting(K.SCALE_IN, leavers=("w1",)), Join("w3")),  # a scale-in takes no newcomers
    (waiting(K.RESHARE), Join("w3")),
    (waiting(K.SUSPEND), Join("w3")),
    (waiting(expect=("w3",)), Join("w9")),  # not expected
    (waiting(expect=("w3",), joiners=("w3",)), Join("w3")),  # joined already
    (waiting(expect=("w3", "w4"), joiners=("w3",)), Publish(1.0)),  # w4 still to come
    (at(S.PUBLISHED), Publish(1.0)),  # published twice
    (waiting(), Agree(5)),  # nothing published to agree on
    (waiting(), Switch()),
    (waiting(K.SCALE_IN, leavers=("w1",)), Restart(("w0",))),  # planned for the failed generation: dropped
    (at(S.PUBLISHED, K.RESHARE), Restart(("w0",))),
])
def test_illegal_transitions_are_rejected(change: Change, event: object) -> None:
    with pytest.raises(IllegalTransition) as e:
        advance(change, event)  # type: ignore[arg-type]
    assert e.value.change is change and e.value.event is event and change.pending in str(e.value)


@pytest.mark.parametrize("status", [S.SWITCHED, S.ABANDONED])
@pytest.mark.parametrize("event", [Join("w3"), Publish(1.0), Agree(3), Switch(), Abandon("x"), Restart(("w0",))])
def test_a_finished_change_takes_no_event(status: ChangeStatus, event: object) -> None:
    with pytest.raises(IllegalTransition, match="over"):
        advance(at(status, expect=("w3",)), event)  # type: ignore[arg-type]


def test_an_illegal_transition_is_a_value_error() -> None:
    assert issubclass(IllegalTransition, ValueError)
