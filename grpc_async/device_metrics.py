"""Per-device Prometheus series for a server on several devices (`model.devices`).

Read from `placement.device_stats(synth)` at scrape time. `index` is the device's position in
`model.devices` (two "cpu" entries are two workers), `role` is replica, llm, token2wav or all.
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from async_cosyvoice.placement import device_stats

_LABELS = ["index", "device", "role"]


class DeviceCollector:
    def __init__(self, synth):
        self.synth = synth

    def describe(self):
        return []  # collected lazily: the device list is known only once the model is loaded

    def collect(self):
        active = GaugeMetricFamily("cosyvoice_device_active", "Requests (replica) or streams (token2wav) "
                                   "in progress on a device", labels=_LABELS)
        assigned = CounterMetricFamily("cosyvoice_device_assigned", "Requests or streams assigned to a device",
                                       labels=_LABELS)
        running = GaugeMetricFamily("cosyvoice_device_engine_running_requests",
                                    "LM engine requests being generated on a device", labels=_LABELS)
        try:
            stats = device_stats(self.synth)
        except Exception:  # a scrape must never fail because the model is gone
            stats = []
        for i, s in enumerate(stats):
            labels = [str(i), s.device, s.role]
            active.add_metric(labels, s.active)
            assigned.add_metric(labels, s.served)
            if s.engine is not None:
                running.add_metric(labels, s.engine.running)
        yield from (active, assigned, running)
