"""Per-device Prometheus series for a server on several devices (`model.devices`).

Read from `placement.device_stats(synth)` at scrape time. `index` is the device's position in
`model.devices` (two "cpu" entries are two workers), `role` is worker, replica, llm, token2wav or
all. Worker processes (`model.placement: workers`) add their state, restarts, busy seconds and
device memory; `cosyvoice_degraded` is 1 while one of them is not serving.
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
        active = GaugeMetricFamily("cosyvoice_device_active", "Requests (worker, replica) or streams (token2wav) "
                                   "in progress on a device", labels=_LABELS)
        assigned = CounterMetricFamily("cosyvoice_device_assigned", "Requests or streams assigned to a device",
                                       labels=_LABELS)
        running = GaugeMetricFamily("cosyvoice_device_engine_running_requests",
                                    "LM engine requests being generated on a device", labels=_LABELS)
        up = GaugeMetricFamily("cosyvoice_device_up", "1 while a device's worker serves (0: starting, restarting "
                               "or given up)", labels=_LABELS)
        restarts = CounterMetricFamily("cosyvoice_device_restarts", "Times a device's worker process was started "
                                       "again after dying", labels=_LABELS)
        busy = CounterMetricFamily("cosyvoice_device_busy_seconds", "Seconds a device worker's stages (LLM steps, "
                                   "token2wav batches) were busy", labels=_LABELS)
        memory = GaugeMetricFamily("cosyvoice_device_memory_bytes", "Device memory a worker process holds (CUDA: "
                                   "the caching allocator's reserved bytes; CPU: the process RSS)", labels=_LABELS)
        degraded = GaugeMetricFamily("cosyvoice_degraded", "1 while a device of a server on several devices is not "
                                     "serving (the others are)")
        try:
            stats = device_stats(self.synth)
        except Exception:  # a scrape must never fail because the model is gone
            stats = []
        for i, s in enumerate(stats):
            labels = [str(i), s.device, s.role]
            active.add_metric(labels, s.active)
            assigned.add_metric(labels, s.served)
            up.add_metric(labels, float(s.state == "serving"))
            restarts.add_metric(labels, s.restarts)
            if s.engine is not None:
                running.add_metric(labels, s.engine.running)
            if s.busy_s is not None:
                busy.add_metric(labels, s.busy_s)
            if s.memory_bytes is not None:
                memory.add_metric(labels, s.memory_bytes)
        degraded.add_metric([], float(bool(getattr(self.synth, "degraded", False))))
        yield from (active, assigned, running, up, restarts, busy, memory, degraded)
