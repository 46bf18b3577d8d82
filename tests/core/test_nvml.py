import os
import pickle
import sys
import warnings
from contextlib import contextmanager

import pytest
import torch

from lightning_mgpu.core import nvml
from lightning_mgpu.core.nvml import (
    DeviceReading,
    NVMLDevice,
    NVMLSession,
    NVMLWarning,
    normalize_uuid,
    parse_visible_devices,
    torch_device_uuid,
)
from tests.helpers.fake_pynvml import (
    FakeGPU,
    FakeMIG,
    FakeNVML,
    GiB,
    MiB,
    NVMLError_DriverNotLoaded,
    NVMLError_NoPermission,
)
from tests.helpers.runif import run_if

A100 = "GPU-aaaaaaaa-0000-1111-2222-333333333333"
T4 = "GPU-bbbbbbbb-0000-1111-2222-333333333333"
A100_MIG = "GPU-cccccccc-0000-1111-2222-333333333333"
MIG_1 = "MIG-dddddddd-0000-1111-2222-333333333333"
MIG_2 = "MIG-eeeeeeee-0000-1111-2222-333333333333"
MIG_3 = "MIG-ffffffff-0000-1111-2222-333333333333"
TWIN_0 = "GPU-11111111-0000-1111-2222-333333333333"
TWIN_1 = "GPU-22222222-0000-1111-2222-333333333333"


def mixed_fake(**kwargs) -> FakeNVML:
    """An A100, a T4 and an A100 in MIG mode with three MIG devices and an empty slot, in PCI bus order."""
    return FakeNVML(
        [
            FakeGPU("NVIDIA A100-SXM4-40GB", A100, mig_mode=0),
            FakeGPU("Tesla T4", T4),
            FakeGPU(
                "NVIDIA A100-SXM4-40GB",
                A100_MIG,
                temperature=61,
                power_mw=250_500,
                migs=[
                    FakeMIG(MIG_1, gpu_instance_id=1, compute_instance_id=0, memory_used=512 * MiB),
                    None,
                    FakeMIG(MIG_2, gpu_instance_id=2, compute_instance_id=0),
                    FakeMIG(MIG_3, gpu_instance_id=1, compute_instance_id=1),
                ],
            ),
        ],
        **kwargs,
    )


def twin_fake() -> FakeNVML:
    return FakeNVML([FakeGPU("NVIDIA H100 80GB HBM3", TWIN_0), FakeGPU("NVIDIA H100 80GB HBM3", TWIN_1)])


def session_of(fake: FakeNVML) -> tuple[NVMLSession, list[str]]:
    messages: list[str] = []
    return NVMLSession(load=lambda: fake, warn=messages.append), messages


@contextmanager
def nvml_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records: list[str] = []
        yield records
    records.extend(str(w.message) for w in caught if issubclass(w.category, NVMLWarning))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("0", ["0"]),
        ("1,0", ["1", "0"]),
        (" 2 , 0 ", ["2", "0"]),
        ("0,1,-1,2", ["0", "1"]),  # a negative index ends the list
        ("-1", []),
        ("0,abc,1", ["0"]),  # so does anything that is not an index or a UUID
        ("1gpu,+2", ["1", "2"]),  # CUDA reads indices like strtoul
        ("01", ["1"]),
        ("0,1,0", []),  # a repeated device hides all of them
        (f"{T4},{A100}", [T4, A100]),
        ("GPU-bbbb", ["GPU-bbbb"]),
        (f"{MIG_1},{MIG_2}", [MIG_1, MIG_2]),
        (f"MIG-{A100_MIG}/1/0", [f"MIG-{A100_MIG}/1/0"]),
        (f"{T4},bogus,{A100}", [T4]),
        (f"1,{T4}", ["1", T4]),
    ],
)
def test_parse_visible_devices(value, expected):
    assert parse_visible_devices(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (T4, T4[4:]),
        (T4.upper(), T4[4:]),
        (T4[4:], T4[4:]),
        (MIG_1, MIG_1[4:]),
        (f"MIG-{A100_MIG}/1/0", f"{A100_MIG[4:]}/1/0"),
        (f"  {MIG_2} ", MIG_2[4:]),
    ],
)
def test_normalize_uuid(value, expected):
    assert normalize_uuid(value) == expected


def test_devices_lists_gpus_and_mig_devices():
    session, messages = session_of(mixed_fake())
    devices = session.devices()
    assert [(d.index, d.uuid, d.gpu_instance_id, d.compute_instance_id) for d in devices] == [
        (0, A100, None, None),
        (1, T4, None, None),
        (2, A100_MIG, None, None),
        (2, MIG_1, 1, 0),
        (2, MIG_2, 2, 0),
        (2, MIG_3, 1, 1),
    ]
    parent = devices[2]
    assert all(mig.parent_handle is parent.handle for mig in devices[3:])
    assert all(d.parent_handle is None for d in devices[:3])
    assert devices[3].name == "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
    # a GPU without MIG (NotSupported) and an empty MIG slot (NotFound) are normal, not worth a warning
    assert messages == []
    assert session.driver_version() == "550.54.15"


def test_enumeration_skips_what_nvml_refuses_and_warns_once():
    fake = mixed_fake()
    fake.gpus[1].raising["nvmlDeviceGetUUID"] = NVMLError_NoPermission()
    fake.gpus[2].migs[2].raising["nvmlDeviceGetUUID"] = NVMLError_NoPermission()
    fake.gpus[0].raising["nvmlDeviceGetMigMode"] = NVMLError_NoPermission()
    session, messages = session_of(fake)
    for _ in range(2):
        assert [d.uuid for d in session.devices()] == [A100, A100_MIG, MIG_1, MIG_3]
    session.shutdown()
    session.devices()  # enumerated again after a restart: the same problems are not reported twice
    assert len(messages) == 3
    assert any("UUID of GPU 1" in m for m in messages)
    assert any("MIG UUID" in m and "MIG slot 2" in m for m in messages)
    assert any("MIG mode" in m and A100 in m for m in messages)


def test_bytes_from_old_pynvml_are_decoded():
    fake = FakeNVML([FakeGPU("Tesla V100", T4)], driver_version="470.1", bytes_strings=True)
    session, _ = session_of(fake)
    [gpu] = session.devices()
    assert (gpu.name, gpu.uuid, session.driver_version()) == ("Tesla V100", T4, "470.1")


def _uuids(mapping):
    return [None if device is None else device.uuid for device in mapping.values()]


@pytest.mark.parametrize(
    ("fake", "visible", "order", "indices", "expected"),
    [
        # indices: trusted under PCI_BUS_ID, or when every GPU is the same model
        (twin_fake, "1,0", None, [0, 1], [TWIN_1, TWIN_0]),
        (twin_fake, None, None, [0, 1], [TWIN_0, TWIN_1]),
        (mixed_fake, "1,0", "PCI_BUS_ID", [0, 1], [T4, A100]),
        (mixed_fake, None, "PCI_BUS_ID", [0, 1], [A100, T4]),
        (mixed_fake, "1", "PCI_BUS_ID", [0], [T4]),
        # GPU UUIDs and unique prefixes, whatever the order
        (mixed_fake, f"{T4},{A100}", None, [0, 1], [T4, A100]),
        (mixed_fake, "GPU-bbbb,GPU-aaaa", "FASTEST_FIRST", [0, 1], [T4, A100]),
        (mixed_fake, f"{A100.upper()}", None, [0], [A100]),
        # MIG devices, new and legacy names
        (mixed_fake, f"{MIG_2},{MIG_1}", None, [0, 1], [MIG_2, MIG_1]),
        (mixed_fake, f"MIG-{A100_MIG}/2/0", None, [0], [MIG_2]),
        (mixed_fake, f"MIG-{A100_MIG}/1/1,MIG-{A100_MIG}/1/0", None, [0, 1], [MIG_3, MIG_1]),
        (mixed_fake, f"MIG-{A100_MIG}/1/0,{MIG_2}", None, [0, 1], [MIG_1, MIG_2]),
        (mixed_fake, f"MIG-{A100_MIG[:12]}/1/0", None, [0], [MIG_1]),
        # only the torch indices asked for
        (mixed_fake, f"{T4},{A100}", None, [1], [A100]),
    ],
)
def test_map_torch_devices_resolves(fake, visible, order, indices, expected):
    session, messages = session_of(fake())
    mapping = session.map_torch_devices(indices, visible_devices=visible, device_order=order)
    assert list(mapping) == indices
    assert _uuids(mapping) == expected
    assert messages == []


@pytest.mark.parametrize(
    ("visible", "order", "indices", "expected", "why"),
    [
        # different models numbered fastest first: CUDA's 0 may be NVML's 1
        ("1,0", None, [0, 1], [None, None], "numbers them fastest first"),
        ("1,0", "FASTEST_FIRST", [0], [None], "numbers them fastest first"),
        (None, None, [0, 1], [None, None], "CUDA_VISIBLE_DEVICES is unset"),
        # the UUID entries still resolve beside a refused index
        (f"{T4},0", None, [0, 1], [T4, None], "entry 1 is '0'"),
        ("GPU-ffff", None, [0], [None], "no GPU has that UUID"),
        ("GPU-", None, [0], [None], "no GPU has that UUID"),
        ("0", "PCI_BUS_ID", [0, 1], [A100, None], "lists only 1 device"),
        ("7", "PCI_BUS_ID", [0], [None], "NVML has no GPU 7"),
        ("2", "PCI_BUS_ID", [0], [None], "in MIG mode"),
        (A100_MIG, None, [0], [None], "in MIG mode"),
        ("MIG-9999", None, [0], [None], "no MIG device has that UUID"),
        (f"MIG-{A100_MIG}/5/0", None, [0], [None], "no MIG device with that parent"),
        (f"MIG-{A100}/1/0", None, [0], [None], "no MIG device with that parent"),
        ("", None, [0], [None], "lists only 0 device"),
    ],
)
def test_map_torch_devices_refuses_to_guess(visible, order, indices, expected, why):
    session, messages = session_of(mixed_fake())
    mapping = session.map_torch_devices(indices, visible_devices=visible, device_order=order)
    assert _uuids(mapping) == expected
    assert len(messages) == 1
    assert why in messages[0]
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in messages[0] and "UUID" in messages[0]  # how to fix it


@pytest.mark.parametrize("visible", [None, "3", "GPU-ffff", "0"])
def test_with_one_gpu_in_nvml_the_first_torch_device_is_that_gpu(visible):
    # a container showing one of the host's GPUs may keep the host's number (or a name NVML does not know) in
    # CUDA_VISIBLE_DEVICES: CUDA sees a device, NVML one GPU, so they are the same
    session, messages = session_of(FakeNVML([FakeGPU("NVIDIA H100 80GB HBM3", TWIN_0)]))
    assert _uuids(session.map_torch_devices([0], visible_devices=visible, device_order=None)) == [TWIN_0]
    assert messages == []
    # a second torch device cannot be it as well
    assert _uuids(session.map_torch_devices([1], visible_devices=visible, device_order=None)) == [None]
    assert len(messages) == 1 and "torch device 1" in messages[0]


def test_map_torch_devices_warns_once_for_the_same_situation():
    session, messages = session_of(mixed_fake())
    for _ in range(3):
        assert session.map_torch_devices([0, 1], visible_devices="1,0", device_order=None) == {0: None, 1: None}
    assert len(messages) == 1
    session.map_torch_devices([0], visible_devices="GPU-ffff", device_order=None)
    assert len(messages) == 2


def test_map_torch_devices_reads_the_environment(monkeypatch):
    session, messages = session_of(mixed_fake())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert _uuids(session.map_torch_devices([0, 1])) == [T4, A100]
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    assert _uuids(session.map_torch_devices([0, 1])) == [None, None]
    assert len(messages) == 1


@pytest.mark.parametrize(
    ("uuid", "expected"),
    [
        (T4[4:], T4),  # how torch prints it: no prefix
        (T4, T4),
        (T4.upper(), T4),
        (MIG_2[4:], MIG_2),
        (MIG_2, MIG_2),
        (A100_MIG[4:], A100_MIG),
    ],
)
def test_map_torch_devices_by_torch_uuid(uuid, expected):
    session, messages = session_of(mixed_fake())
    # the UUID CUDA reports wins over an environment that would send index 0 elsewhere, or nowhere
    for visible in ("0", None, "GPU-ffff"):
        mapping = session.map_torch_devices([0], [uuid], visible_devices=visible, device_order=None)
        assert _uuids(mapping) == [expected]
    assert messages == []


def test_map_torch_devices_mixes_uuids_and_environment():
    session, messages = session_of(mixed_fake())
    mapping = session.map_torch_devices([0, 1], [None, MIG_1[4:]], visible_devices=f"{T4},{A100}", device_order=None)
    assert _uuids(mapping) == [T4, MIG_1]
    unknown = session.map_torch_devices([0], ["99999999-0000"], visible_devices=T4, device_order=None)
    assert unknown == {0: None}
    assert len(messages) == 1 and "'99999999-0000'" in messages[0]
    with pytest.raises(ValueError, match="torch_uuids has 1 entries but torch_indices has 2"):
        session.map_torch_devices([0, 1], [T4])


def test_read_converts_units_and_follows_changes():
    fake = mixed_fake()
    session, messages = session_of(fake)
    t4 = session.devices()[1]
    assert session.read(t4) == DeviceReading(
        memory_total_mb=16384.0,
        memory_free_mb=15360.0,
        memory_used_mb=1024.0,
        utilization_pct=50.0,
        temperature_c=40.0,
        power_w=100.0,
    )
    fake.gpus[1].memory_used = 3 * GiB + 512 * MiB
    fake.gpus[1].power_mw = 70_250
    fake.gpus[1].utilization = 97
    reading = session.read(t4)
    assert (reading.memory_used_mb, reading.memory_free_mb) == (3584.0, 12800.0)
    assert (reading.power_w, reading.utilization_pct) == (70.25, 97.0)
    assert messages == []
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == 2


def test_unsupported_query_is_none_and_warns_once():
    fake = mixed_fake()
    fake.gpus[0].unsupported.add("nvmlDeviceGetPowerUsage")
    fake.gpus[1].unsupported.add("nvmlDeviceGetPowerUsage")
    fake.gpus[1].raising["nvmlDeviceGetTemperature"] = NVMLError_NoPermission()
    session = NVMLSession(load=lambda: fake)
    a100, t4 = session.devices()[:2]
    with nvml_warnings() as messages:
        for _ in range(3):
            first = session.read(a100)
            assert first.power_w is None and first.memory_used_mb == 1024.0 and first.temperature_c == 40.0
    assert len(messages) == 1
    assert "power" in messages[0] and A100 in messages[0] and "Not Supported" in messages[0]
    with nvml_warnings() as messages:
        for _ in range(3):
            second = session.read(t4)
            assert second.power_w is None and second.temperature_c is None and second.utilization_pct == 50.0
    # one warning per query kind and device
    assert len(messages) == 2
    assert any("temperature" in m and T4 in m and "Insufficient Permissions" in m for m in messages)
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 6  # still asked every time: a reading is never cached


def test_globally_unsupported_query():
    fake = mixed_fake(unsupported={"nvmlDeviceGetUtilizationRates"})
    session, messages = session_of(fake)
    for device in session.devices()[:3]:
        for _ in range(2):
            assert session.read(device).utilization_pct is None
    assert len(messages) == 3


def test_mig_reads_memory_of_the_slice_and_temperature_power_of_the_board():
    session, messages = session_of(mixed_fake())
    mig = next(d for d in session.devices() if d.uuid == MIG_1)
    for _ in range(2):
        assert session.read(mig) == DeviceReading(
            memory_total_mb=5120.0,
            memory_free_mb=4608.0,
            memory_used_mb=512.0,
            utilization_pct=None,
            temperature_c=61.0,
            power_w=250.5,
        )
    # MIG handles do not report utilisation: one warning, naming the MIG device
    assert len(messages) == 1 and "utilization" in messages[0] and MIG_1 in messages[0]


def test_missing_pynvml_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    session = NVMLSession()
    with nvml_warnings() as messages:
        assert session.available is False
        assert session.start() is False
        assert session.devices() == []
        assert session.driver_version() is None
        assert session.map_torch_devices([0, 1]) == {0: None, 1: None}
        dummy = NVMLDevice(index=0, uuid=T4, name="Tesla T4", handle=object())
        assert session.read(dummy) == DeviceReading()
    assert len(messages) == 1
    assert "pynvml" in session.unavailable_reason and "nvidia-ml-py" in session.unavailable_reason
    assert session.unavailable_reason in messages[0]


def test_failing_nvml_init_is_unavailable_and_not_retried():
    fake = mixed_fake(init_error=NVMLError_DriverNotLoaded())
    session = NVMLSession(load=lambda: fake)
    with nvml_warnings() as messages:
        for _ in range(3):
            assert session.available is False
            assert session.devices() == []
    assert fake.init_count == 1
    assert len(messages) == 1
    assert "Driver Not Loaded" in session.unavailable_reason and "nvmlInit" in session.unavailable_reason


def test_real_pynvml_without_a_driver_does_not_raise():
    session = NVMLSession()
    with nvml_warnings() as messages:
        started = session.start()
    if started:
        session.shutdown()
        pytest.skip("NVML works on this machine")
    assert session.available is False
    assert "library" in session.unavailable_reason.lower()
    assert len(messages) == 1


def test_construction_touches_nothing():
    fake = mixed_fake()
    session, _ = session_of(fake)
    assert sum(fake.calls.values()) == 0
    assert session.unavailable_reason is None


def test_restarts_after_a_fork(monkeypatch):
    fake = mixed_fake()
    session, messages = session_of(fake)
    t4 = session.devices()[1]
    assert (fake.init_count, fake.calls["nvmlDeviceGetHandleByIndex"]) == (1, 3)
    session.devices()
    assert (fake.init_count, fake.calls["nvmlDeviceGetHandleByIndex"]) == (1, 3)

    parent_pid = os.getpid()
    monkeypatch.setattr(nvml.os, "getpid", lambda: parent_pid + 1)
    fake.invalidate_handles()  # the parent's handles mean nothing in the child
    assert session.available is True
    assert fake.init_count == 2
    devices = session.devices()
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == 6
    assert devices[1].uuid == T4 and devices[1].handle is not t4.handle
    # a device found before the fork is read through this process's handle
    assert session.read(t4).memory_used_mb == 1024.0
    assert messages == []


def test_failed_start_is_retried_in_a_forked_child_without_a_second_warning(monkeypatch):
    fake = mixed_fake(init_error=NVMLError_DriverNotLoaded())
    session, messages = session_of(fake)
    assert session.start() is False
    parent_pid = os.getpid()
    monkeypatch.setattr(nvml.os, "getpid", lambda: parent_pid + 1)
    fake.init_error = None
    assert session.start() is True and session.unavailable_reason is None
    assert fake.init_count == 2
    assert len(messages) == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_restarts_in_a_real_forked_child():
    fake = mixed_fake()
    session, _ = session_of(fake)
    session.devices()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe and never returns to pytest
        try:
            fake.invalidate_handles()
            used = session.read(session.devices()[0]).memory_used_mb
            os.write(write_end, f"{fake.init_count},{used}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        report = pipe.read()
    os.waitpid(pid, 0)
    assert report == "2,1024.0"
    assert fake.init_count == 1  # the parent's session was not restarted


def test_pickle_drops_the_library_and_restarts_lazily(monkeypatch):
    fake = mixed_fake()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    session = NVMLSession()
    assert len(session.devices()) == 6
    with pytest.raises(TypeError):
        pickle.dumps(fake)  # a module: the session pickles only because it leaves the library behind
    clone = pickle.loads(pickle.dumps(session))
    assert fake.init_count == 1
    assert clone.unavailable_reason is None
    assert [d.uuid for d in clone.devices()] == [d.uuid for d in session.devices()]
    assert fake.init_count == 2


def test_shutdown(monkeypatch):
    fake = mixed_fake()
    session, _ = session_of(fake)
    session.shutdown()  # never started: nothing to shut down
    assert fake.calls["nvmlShutdown"] == 0
    session.devices()
    session.shutdown()
    session.shutdown()
    assert fake.calls["nvmlShutdown"] == 1 and fake.initialized == 0
    assert len(session.devices()) == 6  # starts again on demand
    assert fake.init_count == 2
    parent_pid = os.getpid()
    monkeypatch.setattr(nvml.os, "getpid", lambda: parent_pid + 1)
    session.shutdown()  # started by another process: not ours to shut down
    assert fake.calls["nvmlShutdown"] == 1


def test_torch_device_uuid_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert torch_device_uuid(0) is None
    assert not torch.cuda.is_initialized()


@run_if(min_cuda_gpus=1)
def test_real_gpu_maps_torch_device_zero_by_uuid():
    session = NVMLSession()
    if not session.start():
        pytest.skip(f"NVML does not start: {session.unavailable_reason}")
    try:
        uuid = torch_device_uuid(0)
        assert uuid is not None
        device = session.map_torch_devices([0], [uuid])[0]
        assert device is not None
        assert normalize_uuid(device.uuid) == normalize_uuid(uuid)
        reading = session.read(device)
        assert reading.memory_total_mb is not None and reading.memory_total_mb > 0
        assert reading.memory_used_mb is not None and reading.memory_free_mb is not None
        assert abs(reading.memory_total_mb - torch.cuda.get_device_properties(0).total_memory / 2**20) < 1024
    finally:
        session.shutdown()
