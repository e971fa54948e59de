"""The bookkeeping behind a consumer's /readyz and its rejoin: what it holds, and since when not."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from oncely.consumers.membership import Membership
from oncely.settings import ConsumerSettings

P0, P1 = ("t", 0), ("t", 1)


def test_not_ready_before_the_first_assignment_however_recent() -> None:
    m = Membership(bound=30, started=100)
    assert not m.ready(101)
    assert not m.stranded(129)  # not yet past the bound
    assert m.stranded(131)  # never joined within the bound: rejoin


def test_ready_while_holding_partitions_however_long() -> None:
    m = Membership(bound=30, started=0)
    m.assigned([P0, P1], 1)
    assert m.ready(10_000)
    assert m.unassigned_for(10_000) == 0
    assert not m.stranded(10_000)


def test_a_lost_assignment_is_ready_within_the_bound_then_stranded() -> None:
    m = Membership(bound=30, started=0)
    m.assigned([P0, P1], 1)
    m.revoked([P0, P1], 100, lost=True)
    assert m.ready(130)
    assert not m.stranded(130)
    assert m.unassigned_for(131) == 31
    assert not m.ready(131)
    assert m.stranded(131)


def test_a_member_given_nothing_is_not_ready_but_not_stranded() -> None:
    m = Membership(bound=30, started=0)
    m.assigned([], 1)  # more members than partitions: in the group, nothing to do
    assert m.ready(29)
    assert not m.ready(31)
    assert not m.stranded(10_000)  # recreating the client would not give it partitions


def test_the_bound_counts_from_the_last_partition_leaving() -> None:
    m = Membership(bound=30, started=0)
    m.assigned([P0, P1], 1)
    m.revoked([P0], 50, lost=False)  # cooperative: one of two moves away
    assert m.ready(200)
    m.revoked([P1], 200, lost=False)
    assert m.ready(229)
    assert not m.ready(231)
    assert not m.stranded(231)  # a revoke keeps it in the group


def test_a_new_assignment_after_a_loss_clears_both() -> None:
    m = Membership(bound=30, started=0)
    m.assigned([P0], 1)
    m.revoked([P0], 10, lost=True)
    m.assigned([P1], 60)
    assert m.ready(1_000)
    assert not m.stranded(1_000)


def test_a_recreated_client_gets_its_own_bound_to_join_but_stays_not_ready() -> None:
    m = Membership(bound=30, started=0)
    m.assigned([P0], 1)
    m.revoked([P0], 10, lost=True)
    assert m.stranded(41)
    m.restarted(41)
    assert not m.ready(42)  # without partitions since 10: readiness does not restart
    assert not m.stranded(70)  # the new client gets its own bound to join
    assert m.stranded(72)
    m.assigned([P0], 73)
    assert m.ready(73)


def test_the_assignment_timeout_must_exceed_the_session_timeout() -> None:
    with pytest.raises(ValidationError, match="ONCELY_CONSUMER_ASSIGNMENT_TIMEOUT_SECONDS"):
        ConsumerSettings(assignment_timeout_seconds=6, session_timeout_ms=6000)
    assert ConsumerSettings(assignment_timeout_seconds=7, session_timeout_ms=6000)


def test_consume_refuses_an_assignment_timeout_within_the_session_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from oncely.cli import app as cli
    from oncely.cli._errors import run

    monkeypatch.setenv("ONCELY_CONSUMER_ASSIGNMENT_TIMEOUT_SECONDS", "5")
    monkeypatch.setenv("ONCELY_CONSUMER_SESSION_TIMEOUT_MS", "6000")
    status = run(  # as `oncely` runs it: main() is this boundary
        cli,
        [
            "consume",
            "tests.apps.ledger:effects",
            "--effect",
            "ledger",
            "--database-url",
            "postgresql+psycopg://nobody@127.0.0.1:1/none",
            "--bootstrap-servers",
            "127.0.0.1:1",
        ],
    )
    assert status == 2
    [line] = [x for x in capsys.readouterr().err.splitlines() if "schema catalog" not in x]
    assert "ONCELY_CONSUMER_ASSIGNMENT_TIMEOUT_SECONDS (5) must exceed the session timeout" in line
    assert "ONCELY_CONSUMER_SESSION_TIMEOUT_MS" in line
