"""DataParallel for the Lightning 2.x Trainer: one process, the batch split across the GPUs it sees."""

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.nn.parallel import DataParallel
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.core.step_pieces import LogCall, capture_logs, merge_outputs, replay_logs
from lightning_mgpu.core.step_service import OwnStepService
from lightning_mgpu.core.strategy_choice import StrategyChoice
from lightning_mgpu.long_runs.exact_resume import ExactResume, OneProcessCheckpoints

log = logging.getLogger(__name__)


class DataParallelStrategy(OwnStepService, OneProcessCheckpoints, ParallelStrategy):
    """Train on all GPUs of one process with :class:`torch.nn.DataParallel`, which Lightning 2.x removed.

    Each step scatters the batch across the GPUs, runs the step on one replica of the module per GPU and merges
    the results: a scalar returned by a step (the loss) becomes the batch-size-weighted mean of the replicas'
    values, so gradients equal those of one device on the whole batch; batched tensors are concatenated in
    order. ``self.log`` calls made inside replicas are captured and re-logged once from the main thread,
    batch-size weighted (``reduce_fx="mean"``) or reduced with their ``reduce_fx``, so no replica races another.
    Checkpoints hold the plain LightningModule's state dict. Works with ``precision="16-mixed"`` and
    ``"bf16-mixed"`` (autocast is carried into the replica threads).

    Limits of DataParallel itself, checked in ``setup``: manual optimization raises (an optimizer step inside a
    replica would run once per GPU); a logged ``torchmetrics.Metric`` raises (its state lives in a replica that is
    thrown away: log ``metric(...)`` values or update metrics outside the step); state assigned to ``self`` inside
    a step is lost with the replica; BatchNorm running statistics come from the first replica only (warned
    once); ``transfer_batch_to_device`` is bypassed because DataParallel moves each chunk itself (warned once).

    Prefer DDP wherever it can run: it is faster. This strategy is what ``MultiGPUStrategy`` chooses in a notebook
    whose CUDA is already initialised.

    Args:
        accelerator: set by the Trainer.
        parallel_devices: the CUDA devices to use, set by the Trainer from ``devices=``.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.

    Raises:
        MisconfigurationException: at ``fit`` time, for manual optimization or non-CUDA devices.

    Example::

        trainer = Trainer(accelerator="cuda", devices=2, strategy="mgpu_dp")
        trainer = Trainer(accelerator="cuda", devices=2, strategy=DataParallelStrategy())
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.choice: StrategyChoice | None = None
        self._recorder = _ReplicaRecorder()
        self._data_parallel_class: type[DataParallel] = _ReplicaDataParallel
        self._exact_resume = ExactResume(type(self).__name__)

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[0]

    @property
    @override
    def global_rank(self) -> int:
        return 0

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    def is_distributed(self) -> bool:
        """One process: no distributed sampler, no process group."""
        return False

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        compat.check_lightning_internals(trainer, type(self).__name__)
        module = self.lightning_module
        assert module is not None and self.accelerator is not None
        self._check_supported(module)
        self.accelerator.setup(trainer)
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        device_ids = [device.index for device in self.parallel_devices or []]
        self.model = self._data_parallel_class(_ReplicaStepModule(module, self._recorder), device_ids=device_ids)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _check_supported(self, module: "pl.LightningModule") -> None:
        self._check_devices()
        if not module.automatic_optimization:
            raise MisconfigurationException(
                f"{type(self).__name__} supports automatic optimization only: with manual optimization the "
                "optimizer step would run inside every replica. Use DDP (strategy='mgpu_ddp') instead."
            )
        if any(isinstance(m, compat.BatchNormBase) for m in module.modules()):
            rank_zero_warn(
                f"{type(self).__name__}: BatchNorm statistics are computed per replica (per GPU) and the running "
                "statistics kept are the first replica's. Use DDP with sync_batchnorm for statistics over the "
                "whole batch."
            )
        if is_overridden("transfer_batch_to_device", module):
            rank_zero_warn(
                f"{type(self).__name__}: `transfer_batch_to_device` is not called; DataParallel moves each chunk "
                "of the batch to its GPU itself. `on_before_batch_transfer` and `on_after_batch_transfer` still run."
            )

    def _check_devices(self) -> None:
        devices = self.parallel_devices or []
        if any(device.type != "cuda" for device in devices):
            raise MisconfigurationException(
                f"{type(self).__name__} splits batches across CUDA GPUs, but got devices {devices}. "
                "Use MultiGPUStrategy(mode='ddp') for CPU devices."
            )

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        # the batch stays where it is: DataParallel scatters it, one chunk per GPU. The loops have already run
        # on_before_batch_transfer; on_after_batch_transfer goes through Lightning's dispatcher (DataModule too)
        module = self.lightning_module
        if module is None:
            return batch
        return compat.call_batch_hook(module, "on_after_batch_transfer", batch, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._replicated_step("training_step", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._replicated_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._replicated_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._replicated_step("predict_step", args, kwargs)

    def _replicated_step(self, step_name: str, args: tuple, kwargs: dict) -> Any:
        assert self.model is not None and self.lightning_module is not None
        self._recorder.reset()
        # torch's parallel_apply re-enters autocast in each thread without its dtype (bf16 would become fp16) and
        # drops inference mode: the replicas restore both from here
        self._recorder.thread_state = _ThreadState.capture(self.root_device.type)
        output = self.model(step_name, *args, **kwargs)
        replay_logs(self.lightning_module, self._recorder.calls(), step_name, self.root_device)
        return output

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        # one process: the replicas' results are already merged, there is nothing left to reduce
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        return None

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    @property
    @override
    def _replica_devices(self) -> list[torch.device]:
        return list(self.parallel_devices or [])[1:]  # each replica's dropout draws on its own GPU's stream

    @override
    def teardown(self) -> None:
        self.end_step_service()
        self._exact_resume.teardown()
        if isinstance(self.model, _ReplicaDataParallel):
            self.model = self.lightning_module
        # one process: ParallelStrategy.teardown would insist on a cluster environment this strategy never has
        Strategy.teardown(self)
        if self.root_device.type == "cuda":
            torch.cuda.empty_cache()


class _ReplicaRecorder:
    """Collects each replica's batch size and ``self.log`` calls for one step; replicas write distinct keys."""

    def __init__(self) -> None:
        self._records: dict[int, tuple[int, list[LogCall]]] = {}
        self.thread_state = _ThreadState()

    def reset(self) -> None:
        self._records = {}

    def calls(self) -> list[LogCall]:
        return [call for index in sorted(self._records) for call in self._records[index][1]]

    def batch_sizes(self, count: int) -> list[int]:
        if len(self._records) != count:
            raise RuntimeError(f"expected {count} replica records, found {len(self._records)}")
        return [self._records[index][0] for index in sorted(self._records)]

    @contextmanager
    def recording(self, replica: "pl.LightningModule", index: int, batch_size: int) -> Iterator[None]:
        calls: list[LogCall] = []
        self._records[index] = (batch_size, calls)  # one key per replica thread: no lock needed
        with capture_logs(replica, calls, batch_size), self.thread_state.restored():
            yield
        _refuse_metrics(calls)


@dataclass
class _ThreadState:
    """Thread-local torch state that a replica thread must share with the thread that scattered the batch."""

    device_type: str = "cpu"
    autocast: bool = False
    autocast_dtype: torch.dtype | None = None
    inference: bool = False

    @classmethod
    def capture(cls, device_type: str) -> "_ThreadState":
        autocast = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if autocast else None
        return cls(device_type, autocast, dtype, torch.is_inference_mode_enabled())

    @contextmanager
    def restored(self) -> Iterator[None]:
        with torch.inference_mode(self.inference):
            if self.autocast:
                with torch.autocast(self.device_type, dtype=self.autocast_dtype):
                    yield
            else:
                yield


def _batch_size(batch: Any) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return extract_batch_size(batch)
        except Exception:
            return 1


def _refuse_metrics(calls: list[LogCall]) -> None:
    from torchmetrics import Metric

    for call in calls:
        if isinstance(call.value, Metric):
            raise MisconfigurationException(
                f"self.log({call.name!r}, <{type(call.value).__name__}>) inside a step is not supported under "
                "DataParallelStrategy: the metric's state is updated in a replica that is discarded after the step. "
                "Log the value returned by calling the metric, or use DDP."
            )


class _ReplicaStepModule(nn.Module):
    """What DataParallel replicates: runs the named step of (a replica of) the LightningModule and records it."""

    def __init__(self, module: "pl.LightningModule", recorder: _ReplicaRecorder) -> None:
        super().__init__()
        self.module = module
        self.recorder = recorder

    @override
    def forward(
        self, step_name: str, *args: Any, _replica_index: int = 0, _replica_batch_size: int = 1, **kwargs: Any
    ) -> Any:
        replica = self.module
        _point_device_attributes_at_parameters(replica)
        with self.recorder.recording(replica, _replica_index, _replica_batch_size):
            return getattr(replica, step_name)(*args, **kwargs)


def _point_device_attributes_at_parameters(replica: nn.Module) -> None:
    """A replica's ``__dict__`` is a copy of the original's: its ``self.device`` still names the first GPU."""
    parameter = next(replica.parameters(), None)
    if parameter is None:
        return
    compat.point_device_at(replica, parameter.device)


class _ReplicaDataParallel(DataParallel):
    """DataParallel that tells each replica its index and merges outputs batch-size weighted."""

    @override
    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Any) -> Any:
        scattered_inputs, scattered_kwargs = self._split(inputs, kwargs, device_ids)
        # batch sizes are measured here, in the main thread: inputs are (step name, batch, ...)
        sizes = [_batch_size(chunk[1]) if len(chunk) > 1 else 1 for chunk in scattered_inputs]
        return scattered_inputs, tuple(
            dict(kw, _replica_index=i, _replica_batch_size=size)
            for i, (kw, size) in enumerate(zip(scattered_kwargs, sizes, strict=True))
        )

    def _split(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Any) -> Any:
        return super().scatter(inputs, kwargs, device_ids)

    @override
    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        weights = self.module.recorder.batch_sizes(len(outputs))
        return merge_outputs(outputs, weights, output_device)
