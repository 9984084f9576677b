"""ds3.process: the garbage collector a serving process runs with once it has started."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from ds3.process import GC_THRESHOLDS, settle_gc


@pytest.fixture
def restored_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_settling_freezes_what_lives_at_start_and_collects_less_often(restored_gc: None) -> None:
    kept = [[n] for n in range(10_000)]  # (lists are tracked by the collector)
    frozen = settle_gc()
    assert frozen >= len(kept) and gc.get_freeze_count() >= len(kept)  # (others may die meanwhile)
    assert gc.get_threshold() == GC_THRESHOLDS and GC_THRESHOLDS[0] > 700  # CPython's default young threshold
    # what serving creates afterwards is still collected: a cycle made now is found
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1
