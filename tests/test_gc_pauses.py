"""Garbage-collection pauses: counted per generation, a long full collection logged."""
import gc
import logging
from contextlib import contextmanager

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from async_cosyvoice.gc_pauses import GC_PAUSES, GCPauses
from grpc_async.metrics import Metrics


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


def test_the_metrics_endpoint_exports_the_pauses():
    """A server's /metrics (grpc_async/metrics.py) reads the process's pause counters at each scrape."""
    metrics = Metrics()
    with watching_alone(GC_PAUSES):
        before = GC_PAUSES.count[2]
        gc.collect()
    samples = {(s.name, s.labels.get("generation")): s.value
               for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               for s in f.samples}
    assert samples[("cosyvoice_gc_collections_total", "2")] == before + 1 == GC_PAUSES.count[2]
    assert samples[("cosyvoice_gc_pause_seconds_total", "2")] == GC_PAUSES.seconds[2] > 0
