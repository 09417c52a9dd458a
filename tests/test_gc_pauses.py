"""Garbage-collection pauses: counted per generation, a long full collection logged."""
import gc
import logging

from async_cosyvoice.gc_pauses import GCPauses


def test_full_collections_are_counted_and_long_ones_logged(caplog):
    pauses = GCPauses(slow_s=0.0)
    gc.callbacks.append(pauses)
    try:
        with caplog.at_level(logging.INFO, logger="async_cosyvoice.gc_pauses"):
            gc.collect(1)
            assert pauses.count[1] == 1 and pauses.count[2] == 0
            assert not caplog.records  # only full collections are logged
            gc.collect()
    finally:
        gc.callbacks.remove(pauses)
    assert pauses.count[2] == 1 and pauses.seconds[2] > 0
    (record,) = caplog.records
    assert record.getMessage().startswith("full garbage collection: ")


def test_short_full_collections_are_counted_not_logged(caplog):
    pauses = GCPauses(slow_s=60.0)
    gc.callbacks.append(pauses)
    try:
        with caplog.at_level(logging.INFO, logger="async_cosyvoice.gc_pauses"):
            gc.collect()
    finally:
        gc.callbacks.remove(pauses)
    assert pauses.count[2] == 1 and not caplog.records
