"""The sampler's window reductions and GPU slots over a fake NVML, and the early-warning rules, without a GPU."""

import pytest

from lightning_mgpu.core.nvml import NVMLSession
from lightning_mgpu.memory.memory_headroom import HeadroomWatch
from lightning_mgpu.memory.memory_sampler import GPU_METRICS, MemorySample, MemorySampler, MonitoredGPU, metric_keys
from tests.helpers.fake_pynvml import FakeGPU, FakeNVML, GiB


def sampler_over_fake(**gpu_kwargs):
    gpu = FakeGPU(name="NVIDIA H100 80GB HBM3", uuid="GPU-1111aaaa-0000-0000-0000-000000000000", **gpu_kwargs)
    fake = FakeNVML([FakeGPU(name="NVIDIA H100 80GB HBM3", uuid="GPU-0000ffff-0000-0000-0000-000000000000"), gpu])
    session = NVMLSession(load=lambda: fake, warn=lambda message: None)
    assert session.start()
    # torch reports the UUID of its device 0: physical GPU 1, as under CUDA_VISIBLE_DEVICES=1
    mapping = session.map_torch_devices([0], ["1111aaaa-0000-0000-0000-000000000000"])
    monitored = MonitoredGPU("gpu0", 0, mapping[0])
    return MemorySampler([monitored], session, hz=10, step=lambda: 7), gpu, monitored


def test_gpu_slot_reads_its_own_nvml_device_matched_by_uuid():
    sampler, gpu, monitored = sampler_over_fake(memory_total=80 * GiB, memory_used=30 * GiB, temperature=55)
    assert monitored.uuid == gpu.uuid
    sample = sampler.sample()
    assert sample.step == 7 and sample.stage == "train"
    assert sample.values["gpu0/free_mb"] == pytest.approx(50 * 1024)
    assert sample.values["gpu0/temperature_c"] == 55
    assert sample.values["gpu0/power_w"] == pytest.approx(gpu.power_mw / 1000)
    # no CUDA on this machine: the allocator's numbers are unknown, not zero
    assert sample.values["gpu0/allocated_mb"] is None and sample.values["gpu0/headroom_mb"] is None
    assert sampler.keys == metric_keys([monitored]) and len([k for k in sampler.keys if k.startswith("gpu0/")]) == len(
        GPU_METRICS
    )


def test_sample_now_on_the_training_thread_asks_nvml_nothing():
    # a wedged driver call may block the sampling thread, never the training loop: its samples reuse the thread's
    gpu = FakeGPU(name="NVIDIA H100 80GB HBM3", uuid="GPU-1111aaaa-0000-0000-0000-000000000000", temperature=55)
    gpu.memory_total, gpu.memory_used = 80 * GiB, 30 * GiB
    fake = FakeNVML([gpu])
    session = NVMLSession(load=lambda: fake, warn=lambda message: None)
    assert session.start()
    mapping = session.map_torch_devices([0], ["1111aaaa-0000-0000-0000-000000000000"])
    sampler = MemorySampler([MonitoredGPU("gpu0", 0, mapping[0])], session, hz=10, step=lambda: 7)
    sampler.sample()  # the thread's sample
    queries = sum(count for name, count in fake.calls.items() if name != "nvmlInit")
    assert sampler.sample_now(min_gap_s=0.0)
    assert sum(count for name, count in fake.calls.items() if name != "nvmlInit") == queries
    assert sampler.latest.values["gpu0/free_mb"] == pytest.approx(50 * 1024)
    assert sampler.latest.values["gpu0/temperature_c"] == 55
    assert sampler.samples_taken == 2


def test_window_takes_max_of_peaks_min_of_free_mean_of_utilisation_and_last_of_the_rest():
    sampler, gpu, _ = sampler_over_fake(memory_total=80 * GiB)
    for used_gib, util in ((10, 20), (40, 60), (25, 100)):
        gpu.memory_used, gpu.utilization = used_gib * GiB, util
        sampler.sample()
    window = sampler.take_window()
    assert window["gpu0/free_mb"] == pytest.approx((80 - 40) * 1024)  # the window's minimum
    assert window["gpu0/utilization_pct"] == pytest.approx(60.0)  # the mean
    assert window["host/peak_rss_mb"] >= window["host/rss_mb"] > 0
    # a new window starts after a read; with no sample in it, the latest sample stands in
    assert sampler.take_window()["gpu0/free_mb"] == pytest.approx((80 - 25) * 1024)
    gpu.memory_used = 70 * GiB
    sampler.sample()
    assert sampler.take_window()["gpu0/free_mb"] == pytest.approx(10 * 1024)


def test_a_new_stage_starts_a_new_window():
    sampler, gpu, _ = sampler_over_fake(memory_total=80 * GiB, memory_used=70 * GiB)
    sampler.sample()
    sampler.set_stage("validate")
    gpu.memory_used = 1 * GiB
    sample = sampler.sample()
    assert sample.stage == "validate"
    assert sampler.take_window()["gpu0/free_mb"] == pytest.approx(79 * 1024)  # train's minimum is not carried over


def test_unsupported_nvml_queries_leave_keys_unknown():
    sampler, _, _ = sampler_over_fake(unsupported={"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage"})
    values = sampler.sample().values
    assert values["gpu0/utilization_pct"] is None and values["gpu0/power_w"] is None
    assert values["gpu0/temperature_c"] is not None
    assert "gpu0/utilization_pct" not in sampler.take_window()
    assert sampler.window_vector().isnan().sum() >= 2


def test_listeners_get_every_sample_from_the_thread():
    sampler, _, _ = sampler_over_fake()
    seen = []
    sampler.listeners = [seen.append]
    sampler.start()
    assert sampler.running
    import time

    time.sleep(0.35)
    sampler.stop()
    assert not sampler.running
    assert len(seen) == sampler.samples_taken >= 3  # the first on start, some from the thread, the last on stop


def gpu_sample(step, **values):
    return MemorySample(0.0, step, "train", {f"gpu0/{k}": v for k, v in values.items()})


def test_headroom_warning_once_with_the_numbers():
    messages = []
    watch = HeadroomWatch(threshold_mb=2048, warn=messages.append, rank=3)
    readings = [(9000, 40000, 41000), (4000, 44000, 45000), (1500, 46000, 46500), (900, 47000, 47100)]
    for step, (free, allocated, reserved) in enumerate(readings):
        headroom = free + reserved - allocated
        watch(gpu_sample(step, free_mb=free, allocated_mb=allocated, reserved_mb=reserved, headroom_mb=headroom))
    assert len(messages) == 1 and watch.warned == ["gpu0:headroom"]
    assert "step 2" in messages[0] and "rank 3" in messages[0]  # headroom 2000 < 2048 first at step 2
    assert "2,000 MiB" in messages[0] and "free 1,500 MiB" in messages[0]


def test_allocator_retries_growing_warn_once_even_above_the_headroom_threshold():
    messages = []
    watch = HeadroomWatch(threshold_mb=None, warn=messages.append)
    for step, retries in enumerate((2, 2, 2, 3, 5)):  # 2 retries before monitoring began do not count
        watch(gpu_sample(step, headroom_mb=50_000, alloc_retries=retries))
    assert watch.warned == ["gpu0:retries"] and "retry 1 allocation" in messages[0] and "step 3" in messages[0]


def test_host_is_watched_only_without_a_gpu():
    messages = []
    watch = HeadroomWatch(threshold_mb=1000, warn=messages.append)
    low_host = {"host/available_mb": 10.0, "host/rss_mb": 5000.0}
    watch(MemorySample(0.0, 1, "train", {**low_host, "gpu0/headroom_mb": 70_000.0}))
    assert messages == []
    watch(MemorySample(0.0, 2, "train", low_host))
    assert watch.warned == ["host:headroom"] and "host memory available 10 MiB" in messages[0]


def test_a_failing_listener_is_dropped_with_one_warning_and_sampling_goes_on():
    sampler, _, _ = sampler_over_fake()
    messages, seen = [], []
    sampler.warn = messages.append

    def full_disk(sample):
        raise OSError(28, "No space left on device")

    sampler.listeners = [full_disk, seen.append]
    for _ in range(3):
        sampler.sample()
    assert len(seen) == 3 and sampler.listeners == [seen.append]
    assert len(messages) == 1 and "full_disk failed and is switched off" in messages[0]


def test_plot_reads_a_long_timeline_thinned_and_leaves_the_matplotlib_backend_alone(tmp_path):
    import matplotlib

    from lightning_mgpu.memory.memory_timeline import MemoryTimeline, plot_timeline

    backend = matplotlib.get_backend()
    timeline = MemoryTimeline(tmp_path / "t.csv", ["host/rss_mb"])
    for step in range(20_000):
        stage = "validate" if 9_000 <= step < 9_100 else "train"
        rss = 5_000.0 if step == 12_345 else 1_000.0 + step % 7
        timeline(MemorySample(step * 0.5, step, stage, {"host/rss_mb": rss}))
    timeline.close()
    png = plot_timeline(timeline.path, tmp_path / "t.png", max_points=500)
    assert png.read_bytes()[:4] == b"\x89PNG" and matplotlib.get_backend() == backend
