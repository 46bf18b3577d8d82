"""A Prometheus endpoint over HTTP: gauges labelled by rank and GPU UUID, shared by the pack's monitors.

GPUMemoryMonitor serves its memory samples here; PerformanceMonitor adds its step-time gauges to the endpoint of a
:class:`ServesPrometheus` callback of the same fit, or serves its own.
"""

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

NAMESPACE = "lightning_mgpu"


class LabelledGPU(Protocol):
    """A GPU's labels: its slot in this process (``gpu0``) and its UUID."""

    @property
    def slot(self) -> str:
        """``gpu0`` for this process's first device."""
        ...

    @property
    def uuid(self) -> str:
        """The NVML UUID, or ``"unknown"``."""
        ...


class Sample(Protocol):
    """What one sample holds: the training step, and values by ``<slot>/<metric>`` and ``host/<metric>``."""

    @property
    def step(self) -> int:
        """The training step the sample was taken at."""
        ...

    @property
    def values(self) -> Mapping[str, float | None]:
        """The values read, ``None`` where unknown."""
        ...


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
        gpu_metrics: the metric names of each GPU's gauges (``used_mb``...); none without samples to serve.
        host_metrics: the metric names of the host's gauges.

    Example::

        exporter = PrometheusExporter(9400, "127.0.0.1", rank=0, gpus=gpus, gpu_metrics=GPU_METRICS)
        exporter.start()  # http://127.0.0.1:9400/metrics
    """

    def __init__(
        self,
        port: int,
        host: str,
        rank: int,
        gpus: Sequence[LabelledGPU],
        gpu_metrics: Sequence[str] = (),
        host_metrics: Sequence[str] = (),
    ) -> None:
        self.port = port
        self.host = host
        self.rank = str(rank)
        self.gpus = list(gpus)
        self.gpu_metrics = tuple(gpu_metrics)
        self.host_metrics = tuple(host_metrics)
        self.url: str | None = None
        self._server: Any = None
        self._registry: Any = None
        self._gauges: dict[str, Any] = {}

    def start(self) -> str:
        """Register the gauges and start serving; returns the URL of the metrics page."""
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        registry = self._registry = CollectorRegistry()
        for metric in self.gpu_metrics:
            self._gauges[f"gpu/{metric}"] = Gauge(
                f"gpu_{metric}", f"GPU {metric}", ["rank", "gpu", "uuid"], namespace=NAMESPACE, registry=registry
            )
        for metric in self.host_metrics:
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

    def __call__(self, sample: Sample) -> None:
        """Update the gauges from one sample (called from the sampler thread)."""
        if not self._gauges:
            return
        self._gauges["step"].labels(self.rank).set(sample.step)
        for gpu in self.gpus:
            for metric in self.gpu_metrics:
                value = sample.values.get(f"{gpu.slot}/{metric}")
                if value is not None:
                    self._gauges[f"gpu/{metric}"].labels(self.rank, gpu.slot, gpu.uuid).set(value)
        for metric in self.host_metrics:
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


class ServesPrometheus:
    """A callback that may serve a Prometheus endpoint other callbacks of its fit add their gauges to.

    A declared role, read with ``isinstance``: GPUMemoryMonitor serves one with ``prometheus_port``, and
    PerformanceMonitor without a port of its own adds its gauges there.
    """

    @property
    def exporter(self) -> PrometheusExporter | None:
        """The endpoint this callback serves now, or ``None``."""
        return None
