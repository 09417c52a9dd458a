"""Per-device Prometheus series for a server on several devices (`model.devices`).

Read from `placement.device_stats(synth)` at scrape time. `index` is the device's position in
`model.devices` (two "cpu" entries are two workers), `role` is worker, replica, llm, token2wav or
all. Worker processes (`model.placement: workers`) add their state, restarts, busy seconds and
device memory; `cosyvoice_degraded` is 1 while one of them is not serving.

Every token2wav device adds its CUDA graph state (DeviceStats.graphs, token2wav/graph_state.py) by
graph `kind` (flow, HiFT, cached flow, flow estimator): graphs captured, buckets wanted (met by a
call, waiting for their capture: those calls run without a graph meanwhile), calls replayed,
deferred and past the buckets, and the captures of the batcher's capture thread with their seconds. A benchmark waits for the
wanted gauge to be 0 before it times anything. Worker processes are asked for their stats at each
scrape (WorkerPool.refresh_stats): their captures go on after their last reply.
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from async_cosyvoice.placement import device_stats
from async_cosyvoice.token2wav.graph_state import DeviceGraphState
from async_cosyvoice.worker_pool import WorkerPool

_LABELS = ["index", "device", "role"]
_KIND_LABELS = _LABELS + ["kind"]


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
        graph_families = GraphFamilies()
        try:
            if isinstance(self.synth, WorkerPool):
                self.synth.refresh_stats()
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
            if s.graphs is not None:
                graph_families.add(labels, s.graphs)
        degraded.add_metric([], float(bool(getattr(self.synth, "degraded", False))))
        yield from (active, assigned, running, up, restarts, busy, memory, degraded)
        yield from graph_families.families()


# (attribute of a GraphKindState, family, name, help): one series per device and graph kind
_KIND_FAMILIES = (
    ("graphs", GaugeMetricFamily, "cosyvoice_device_cuda_graphs",
     "CUDA graphs captured on a token2wav device, by kind"),
    ("wanted", GaugeMetricFamily, "cosyvoice_device_cuda_graphs_wanted",
     "Buckets a call met that wait for their CUDA graph's capture (their calls run without a graph meanwhile)"),
    ("replays", CounterMetricFamily, "cosyvoice_device_cuda_graph_replays",
     "Calls that ran in a CUDA graph (off CUDA: padded to their bucket)"),
    ("deferred", CounterMetricFamily, "cosyvoice_device_cuda_graph_deferred_calls",
     "Calls that ran without a graph while their bucket waited for its capture"),
    ("fallbacks", CounterMetricFamily, "cosyvoice_device_cuda_graph_fallback_calls",
     "Calls past the graph buckets (or of a bucket whose capture failed), run without a graph"),
    ("covered", CounterMetricFamily, "cosyvoice_device_cuda_graph_covered_calls",
     "Calls that ran in a larger bucket's CUDA graph while their own bucket waited for its capture"))
# (attribute of a DeviceGraphState, family, name, help): one series per device
_DEVICE_FAMILIES = (
    ("background_captures", CounterMetricFamily, "cosyvoice_device_cuda_graph_background_captures",
     "Wanted CUDA graphs the token2wav batcher's capture thread captured (beside the batches)"),
    ("capture_seconds", CounterMetricFamily, "cosyvoice_device_cuda_graph_capture_seconds",
     "Seconds of the token2wav batcher's captures of wanted graphs"),
    ("capture_gave_way_seconds", CounterMetricFamily, "cosyvoice_device_cuda_graph_capture_gave_way_seconds",
     "Seconds the token2wav batcher's captures waited for streams owed their first chunk"),
    ("capturing", GaugeMetricFamily, "cosyvoice_device_cuda_graph_capturing",
     "1 while the token2wav batcher's capture thread is capturing wanted graphs"))


class GraphFamilies:
    """The CUDA graph series of the token2wav devices (DeviceGraphState)."""

    def __init__(self):
        self.per_kind = [(attr, family(name, doc, labels=_KIND_LABELS)) for attr, family, name, doc in _KIND_FAMILIES]
        self.per_device = [(attr, family(name, doc, labels=_LABELS)) for attr, family, name, doc in _DEVICE_FAMILIES]

    def add(self, labels: list[str], state: DeviceGraphState) -> None:
        for k in state.kinds:
            for attr, family in self.per_kind:
                family.add_metric(labels + [k.kind], float(getattr(k, attr)))
        for attr, family in self.per_device:
            family.add_metric(labels, float(getattr(state, attr)))

    def families(self):
        return [family for _, family in self.per_kind + self.per_device]
