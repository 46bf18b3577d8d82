"""The memory timeline's plot, checked on what it draws (lines, events, axis ranges), and the event records."""

import pickle

import pytest

from lightning_mgpu.core.training_events import EventFile, EventLog, TrainingEvent, events_path, read_events
from lightning_mgpu.memory.memory_sampler import MemorySample, MonitoredGPU, metric_keys
from lightning_mgpu.memory.memory_timeline import MemoryTimeline, plot_timeline, timeline_plot

HOST_KEYS = ["host/rss_mb", "host/peak_rss_mb", "host/available_mb"]


def host_timeline(path, steps=88, rss=360.0, available=20_000.0):
    """A short host-only fit like the main example's: RSS almost flat, a validation run every 29 steps."""
    timeline = MemoryTimeline(path, HOST_KEYS)
    for step in range(steps):
        stage = "validate" if step in (29, 58, 87) else "train"
        value = rss + 8.0 * min(step, 4) / 4  # 8 MiB of growth at the start, then flat
        timeline(MemorySample(step * 0.05, step, stage, {"host/rss_mb": value, "host/available_mb": available}))
    timeline.close()
    return timeline.path


def line(plot, role):
    (found,) = [candidate for candidate in plot.lines if candidate.role == role]
    return found


def test_the_axis_starts_at_zero_and_the_limit_and_threshold_are_drawn(tmp_path):
    path = host_timeline(tmp_path / "memory_fit_rank1.csv")
    plot = timeline_plot(path, warn_headroom_mb=1024)
    used, limit, threshold = line(plot, "used"), line(plot, "limit"), line(plot, "threshold")
    assert used.values[0] == 360.0 and max(used.values) == 368.0
    assert limit.values == [value + 20_000.0 for value in used.values]  # RSS + host available
    assert threshold.values == [value - 1024 for value in limit.values]  # warn_headroom_mb below the limit
    assert "1,024 MiB (warn_headroom_mb)" in threshold.label
    assert plot.y_limits[0] == 0 and plot.y_limits[1] >= max(limit.values)
    # 368 MiB of a 20 GiB limit cannot be read on that axis: a zoom panel, which must not claim to start at 0
    low, high = plot.zoom_limits
    assert 300 < low < 360 and 368 < high < 400
    assert plot.title == "Memory of rank 1 during fit: host memory (no GPU in this timeline)"
    assert plot.x_label == "training step (optimizer steps)" and plot.y_label == "memory (MiB)"
    assert plot.peaks == [("process RSS (resident host memory)", "train", 4, 368.0)]
    assert plot.samples == 88 and "88 samples over steps 0-87" in plot.subtitle


def test_without_a_threshold_none_is_drawn(tmp_path):
    plot = timeline_plot(host_timeline(tmp_path / "t.csv"), warn_headroom_mb=None)
    assert [candidate.role for candidate in plot.lines] == ["used", "limit"]


def test_gpu_lines_are_allocated_reserved_and_the_limit_is_allocated_plus_headroom(tmp_path):
    keys = metric_keys([MonitoredGPU("gpu0", 0)])
    timeline = MemoryTimeline(tmp_path / "memory_fit_rank0.csv", keys)
    for step in range(20):
        allocated = 60_000.0 + 500 * step
        values = {"gpu0/allocated_mb": allocated, "gpu0/reserved_mb": allocated + 2_000, "gpu0/headroom_mb": 15_000.0}
        timeline(MemorySample(step * 0.1, step, "train", {**values, "host/rss_mb": 3_000.0}))
    timeline.close()
    plot = timeline_plot(timeline.path, warn_headroom_mb=2048)
    assert [(candidate.label, candidate.role) for candidate in plot.lines] == [
        ("gpu0 allocated", "used"),
        ("gpu0 reserved", "reserved"),
        ("gpu0 limit: allocated + headroom", "limit"),
        ("gpu0 warning threshold: limit - 2,048 MiB (warn_headroom_mb)", "threshold"),
    ]
    assert line(plot, "limit").values == [60_000.0 + 500 * step + 15_000 for step in range(20)]
    assert line(plot, "threshold").values[0] == 75_000.0 - 2048
    assert plot.y_limits[0] == 0 and plot.zoom_limits is None  # the memory used fills the axis: no zoom
    assert plot.peaks == [("gpu0 allocated", "train", 19, 69_500.0)]
    assert "gpu0" in plot.title


def test_events_are_passed_to_the_plot_and_a_storm_is_thinned(tmp_path):
    path = host_timeline(tmp_path / "t.csv")
    storm = [TrainingEvent(step, "skipped_steps", "NaN/Inf loss") for step in range(10, 70)] * 5
    events = [TrainingEvent(3, "oom_backoff", "rank 1, micro-batch 64 -> 32"), *storm, TrainingEvent(29, "validation")]
    plot = timeline_plot(path, events)
    assert plot.event_counts == {"oom_backoff": 1, "skipped_steps": 300, "validation": 1}
    kinds = [event.kind for event in plot.events]
    assert kinds.count("oom_backoff") == 1 and kinds.count("validation") == 1
    assert 0 < kinds.count("skipped_steps") <= 60  # drawn: a storm must not paint the plot over
    assert plot.event_x == [event.step for event in plot.events] and plot.event_x == sorted(plot.event_x)


def test_an_evaluation_stage_is_plotted_over_time(tmp_path):
    timeline = MemoryTimeline(tmp_path / "memory_validate_rank0.csv", HOST_KEYS)
    for tick in range(10):
        timeline(MemorySample(tick * 0.5, 40, "validate", {"host/rss_mb": 500.0 + tick, "host/available_mb": 9e3}))
    timeline.close()
    plot = timeline_plot(timeline.path, [TrainingEvent(40, "oom_backoff", "validation_step", time=2.0)])
    assert plot.x_label == "seconds since the stage started"
    assert line(plot, "used").x == [tick * 0.5 for tick in range(10)]
    assert plot.event_x == [2.0]


def test_plot_timeline_reads_the_events_beside_the_csv_and_writes_a_png(tmp_path):
    path = host_timeline(tmp_path / "memory_fit_rank0.csv")
    log = EventLog()
    log.record(5, "skipped_steps", "NaN/Inf loss")
    log.record(10, "oom_backoff", "rank 1, micro-batch 64 -> 32")
    file = EventFile(events_path(path), time_origin=log.since(0)[0].time)
    file.write(log.since(0))
    file.close()
    assert events_path(path).name == "memory_fit_rank0.events.csv"
    read = read_events(events_path(path))
    assert [(e.step, e.kind, e.detail) for e in read] == [
        (5, "skipped_steps", "NaN/Inf loss"),
        (10, "oom_backoff", "rank 1, micro-batch 64 -> 32"),
    ]
    assert read[0].time == 0.0 and read[1].time >= 0.0
    png = plot_timeline(path, tmp_path / "t.png", warn_headroom_mb=1024)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert read_events(tmp_path / "missing.csv") == []


def test_event_log_holds_the_last_events_counts_all_and_pickles():
    log = EventLog(capacity=3)
    for step in range(5):
        log.record(step, "skipped_steps")
    assert log.recorded == 5
    assert [event.step for event in log.since(0)] == [2, 3, 4]  # the first two were dropped
    assert [event.step for event in log.since(3)] == [3, 4]
    assert log.since(5) == []
    clone = pickle.loads(pickle.dumps(log))
    clone.record(5, "validation")
    assert clone.recorded == 6 and log.recorded == 5


@pytest.mark.parametrize("capacity", [1, 1000])
def test_a_reader_that_keeps_up_misses_nothing(capacity):
    log, seen, cursor = EventLog(capacity=capacity), [], 0
    for step in range(50):
        log.record(step, "skipped_steps")
        seen += log.since(cursor)
        cursor = log.recorded
    assert [event.step for event in seen] == list(range(50))
