"""``runtime.claims.InFlight``: what a claim whose reply was read late may take as its
deadline (the heartbeat's adopted renewal, or reads that show the claim had not landed)."""

from __future__ import annotations

from typing import Any

from lease_celery.models import Lease
from lease_celery.runtime.claims import InFlight


class Handle:
    """What InFlight calls on an Execution: ``token``, ``lease`` and ``renewed``."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.lease = Lease(key="k", owner="o", token=token, expires_at=0.0)
        self.renewals: list[tuple[Lease, float]] = []

    def renewed(self, lease: Lease, *, sent_at: float) -> None:
        self.renewals.append((lease, sent_at))


def _claim() -> InFlight:
    store: Any = None
    return InFlight(store, "k", "o", ttl=2.0, heartbeat_interval=0.5)


def test_reads_that_found_no_claim_count_only_as_a_chain_within_a_ttl() -> None:
    """Each not-landed read counts if it was sent within a ttl of the claim's send or of the
    previous counted read; one later (the chain broken: the claim may have landed, expired
    and been purged meanwhile) moves nothing. A read that saw the claim's own token or a
    later one moves nothing either."""
    claim = _claim()
    start = claim.sent_at
    claim.not_landed(start + 1.5, 0)
    claim.not_landed(start + 3.0, 0)
    claim.not_landed(start + 6.0, 0)  # 3 s after the last counted read: ignored
    handle = Handle(token=1)
    claim.answer(handle)
    assert [sent for _, sent in handle.renewals] == [start + 3.0]

    seen_own = _claim()
    seen_own.not_landed(seen_own.sent_at + 1.0, 7)
    handle = Handle(token=7)
    seen_own.answer(handle)
    assert handle.renewals == []


def test_an_adopted_renewal_goes_to_the_handle_whenever_it_lands() -> None:
    """A renewal the heartbeat made before the reply was read is handed over when it is;
    one that lands after (the reply read meanwhile) goes straight to the handle."""
    claim = _claim()
    first = Lease(key="k", owner="o", token=3, expires_at=10.0)
    claim.renewed(first, claim.sent_at + 0.5)
    handle = Handle(token=3)
    claim.answer(handle)
    later = Lease(key="k", owner="o", token=3, expires_at=11.0)
    claim.renewed(later, claim.sent_at + 1.0)
    assert handle.renewals == [(first, claim.sent_at + 0.5), (later, claim.sent_at + 1.0)]


def test_the_heartbeat_keeps_looking_while_reads_show_the_claim_has_not_landed() -> None:
    """A claim waiting for a pooled connection longer than the ttl (its reads keep finding no
    row) stays looked after: its deadline counts from the last counted read. (CI: a delivery
    whose claim waited ~5 s behind a busy body was given up at 2 s and ran twice.)"""
    claim = _claim()
    assert claim.deadline == claim.sent_at + 2.0
    claim.not_landed(claim.sent_at + 1.5, 0)
    claim.not_landed(claim.sent_at + 3.0, 0)
    assert claim.deadline == claim.sent_at + 5.0
