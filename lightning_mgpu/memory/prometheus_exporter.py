"""Serve the memory samples as Prometheus gauges over HTTP, labelled by rank and GPU UUID."""

from collections.abc import Sequence
from typing import Any

from lightning_mgpu.memory.memory_sampler import GPU_METRICS, HOST_METRICS, MemorySample, MonitoredGPU

NAMESPACE = "lightning_mgpu"


class PrometheusExporter:
    """An HTTP endpoint with one gauge per metric, updated by every sample.

    GPU gauges are named ``lightning_mgpu_gpu_<metric>`` with labels ``rank``, ``gpu`` (the slot, ``gpu0``) and
    ``uuid``; host gauges ``lightning_mgpu_host_<metric>`` with ``rank``; ``lightning_mgpu_step`` is the training
    step of the latest sample. An unknown value is left out rather than exported as 0. Needs ``prometheus-client``
    (``pip install lightning-mgpu[prometheus]``).

    Args:
        port: the TCP port; 0 picks a free one (read :attr:`url` after :meth:`start`).
        host: the address to bind; ``127.0.0.1`` keeps it off the network.
        rank: the process's global rank, a label on every gauge.
        gpus: the GPUs this process samples.

    Example::

        exporter = PrometheusExporter(port=9400, host="127.0.0.1", rank=0, gpus=gpus)
        exporter.start()  # http://127.0.0.1:9400/metrics
    """

    def __init__(self, port: int, host: str, rank: int, gpus: Sequence[MonitoredGPU]) -> None:
        self.port = port
        self.host = host
        self.rank = str(rank)
        self.gpus = list(gpus)
        self.url: str | None = None
        self._server: Any = None
        self._registry: Any = None
        self._gauges: dict[str, Any] = {}

    def start(self) -> str:
        """Register the gauges and start serving; returns the URL of the metrics page."""
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        registry = self._registry = CollectorRegistry()
        for metric in GPU_METRICS:
            self._gauges[f"gpu/{metric}"] = Gauge(
                f"gpu_{metric}", f"GPU {metric}", ["rank", "gpu", "uuid"], namespace=NAMESPACE, registry=registry
            )
        for metric in HOST_METRICS:
            self._gauges[f"host/{metric}"] = Gauge(
                f"host_{metric}", f"host {metric}", ["rank"], namespace=NAMESPACE, registry=registry
            )
        self._gauges["step"] = Gauge(
            "step", "training step of the latest sample", ["rank"], namespace=NAMESPACE, registry=registry
        )
        self._server, _thread = start_http_server(self.port, addr=self.host, registry=registry)
        bound_port = self._server.server_address[1]
        self.url = f"http://{self.host}:{bound_port}/metrics"
        return self.url

    def __call__(self, sample: MemorySample) -> None:
        """Update the gauges from one sample (called from the sampler thread)."""
        if not self._gauges:
            return
        self._gauges["step"].labels(self.rank).set(sample.step)
        for gpu in self.gpus:
            for metric in GPU_METRICS:
                value = sample.values.get(f"{gpu.slot}/{metric}")
                if value is not None:
                    self._gauges[f"gpu/{metric}"].labels(self.rank, gpu.slot, gpu.uuid).set(value)
        for metric in HOST_METRICS:
            value = sample.values.get(f"host/{metric}")
            if value is not None:
                self._gauges[f"host/{metric}"].labels(self.rank).set(value)

    def set_performance(self, values: dict[str, float], uuid: str) -> None:
        """Serve this rank's step-time figures as ``lightning_mgpu_perf_<metric>`` gauges (labels ``rank``, ``uuid``).

        Called by ``PerformanceMonitor`` at its logging steps; NaN (unknown) values are left out.
        """
        if self._registry is None:
            return
        from prometheus_client import Gauge

        for metric, value in values.items():
            if value != value:  # NaN: unknown
                continue
            key = f"perf/{metric}"
            if key not in self._gauges:
                labels = ["rank", "uuid"]
                description = f"training {metric}"
                self._gauges[key] = Gauge(
                    f"perf_{metric}", description, labels, namespace=NAMESPACE, registry=self._registry
                )
            self._gauges[key].labels(self.rank, uuid).set(value)

    def stop(self) -> None:
        """Stop serving and free the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._gauges = {}
        self._registry = None
