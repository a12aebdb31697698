"""`/metrics` gauges per GPU, read at scrape time from the GPU placement's latest figures (no
device read on a scrape: the placement refreshes them off the event loop):

    omni_router:gpu_memory_total_bytes{gpu,uuid,name}   the device's memory
    omni_router:gpu_memory_used_bytes{gpu,uuid,name}    what the driver reports used (all processes)
    omni_router:gpu_model_memory_bytes{gpu,model}       what each of our models is charged there
                                                        (measured once it runs, else its booked share)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from router.lifecycle.gpus import Inventory

Figures = Callable[[], tuple[Inventory, dict[str, dict[int, int]]]]


class GpuCollector:
    def __init__(self, figures: Figures) -> None:
        self._figures = figures

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        inv, by_model = self._figures()
        total = GaugeMetricFamily("omni_router:gpu_memory_total_bytes", "GPU memory of each device",
                                  labels=["gpu", "uuid", "name"])
        used = GaugeMetricFamily("omni_router:gpu_memory_used_bytes",
                                 "GPU memory used on each device, by every process",
                                 labels=["gpu", "uuid", "name"])
        model = GaugeMetricFamily("omni_router:gpu_model_memory_bytes",
                                  "GPU memory each model is charged on each device (measured once it runs)",
                                  labels=["gpu", "model"])
        for g in inv.gpus:
            labels = [str(g.index), g.uuid, g.name]
            total.add_metric(labels, g.total_bytes)
            used.add_metric(labels, g.used_bytes)
        for name, charges in sorted(by_model.items()):
            for index, b in sorted(charges.items()):
                model.add_metric([str(index), name], b)
        return [total, used, model]
