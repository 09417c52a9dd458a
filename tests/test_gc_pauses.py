"""Garbage-collection pauses: counted per generation, a long full collection logged."""
import gc
import logging
from contextlib import contextmanager

from async_cosyvoice.gc_pauses import GCPauses


@contextmanager
def watching_alone(pauses: GCPauses):
    """`pauses` as the only gc callback (a server's warm-up in this process installed the global one)."""
    saved = gc.callbacks[:]
    gc.callbacks[:] = [pauses]
    try:
        yield pauses
    finally:
        gc.callbacks[:] = saved


def test_full_collections_are_counted_and_long_ones_logged(caplog):
    with watching_alone(GCPauses(slow_s=0.0)) as pauses, caplog.at_level(logging.INFO, "async_cosyvoice.gc_pauses"):
        gc.collect(1)
        assert pauses.count[1] == 1 and pauses.count[2] == 0
        assert not caplog.records  # only full collections are logged
        gc.collect()
    assert pauses.count[2] == 1 and pauses.seconds[2] > 0
    (record,) = caplog.records
    assert record.getMessage().startswith("full garbage collection: ")


def test_short_full_collections_are_counted_not_logged(caplog):
    with watching_alone(GCPauses(slow_s=60.0)) as pauses, caplog.at_level(logging.INFO, "async_cosyvoice.gc_pauses"):
        gc.collect()
    assert pauses.count[2] == 1 and not caplog.records
