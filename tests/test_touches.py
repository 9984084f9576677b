"""TTL renewals by reads (Store.touches): set on the event loop, folded into the WAL by the
writer thread. None may be lost: not to a renewal made while the writer forgets the previous
one, not to a fold whose commit fails."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from shared.errors import Unavailable
from tests.wal_harness import Clock, FailingCommits, Harness


def _renewed_at(h: Harness, path: str) -> float:
    """The latest renewal the ingester knows of: pending in touches, or stored."""
    meta = h.meta(path)
    assert meta is not None
    return max(h.store.touches.get(path, 0.0), meta.last_access)


def test_a_renewal_made_while_the_writer_forgets_the_last_one_is_kept(h: Harness, clock: Clock) -> None:
    """The event loop renews the TTL just before the writer deletes the entry it has folded
    (a thread switch between its check and its delete). Before: the new renewal was deleted
    with it, and the stream could expire under a reader who had just renewed it."""
    h.create("s", ttl=60)
    t1, t2 = clock.now + 1, clock.now + 2
    renewer: list[threading.Thread] = []

    class RenewedJustBeforeTheDelete(type(h.store.touches)):  # type: ignore[misc]
        def __delitem__(self, path: str) -> None:
            if not renewer:  # the loop's write, as if it came between the check and the delete
                renewer.append(threading.Thread(target=self.__setitem__, args=(path, t2)))
                renewer[0].start()
                renewer[0].join(0.3)  # (it waits for the writer if the writer holds a lock)
            super().__delitem__(path)

    touches: Any = RenewedJustBeforeTheDelete()
    touches["s"] = t1
    h.store.touches = touches
    for _ in range(3):
        h.run(h.store.fold_touches)
    assert renewer, "no entry was forgotten"
    renewer[0].join(5)
    assert _renewed_at(h, "s") == t2, "the renewal made during the fold was lost"
    h.run(h.store.fold_touches)
    assert _renewed_at(h, "s") == t2


def test_a_fold_whose_commit_fails_keeps_its_renewals(h: Harness, clock: Clock) -> None:
    """Before: the fold dropped the entries as it wrote them into the transaction; when the
    commit failed, the renewal was neither stored nor pending."""
    h.create("s", ttl=60)
    created = h.meta("s")
    assert created is not None
    touched = clock.now + 5
    h.store.touches["s"] = touched
    real = h.wal.env
    h.wal.env = FailingCommits(real)  # type: ignore[assignment]
    with pytest.raises(Unavailable):
        h.run(h.store.fold_touches)
    h.wal.env = real
    assert _renewed_at(h, "s") == touched, "the renewal was lost with the failed commit"
    h.run(h.store.fold_touches)  # stored now ...
    meta = h.meta("s")
    assert meta is not None and meta.last_access == touched
    h.run(h.store.fold_touches)  # ... and the entry goes once a later fold finds it stored
    assert "s" not in h.store.touches
