"""Host memory of this process and of the machine (or its container), read without psutil.

On Linux the numbers come from ``/proc`` and the cgroup files, which cost a few microseconds to read; elsewhere
``resource.getrusage`` gives the peak resident set and the rest is unknown (``None``).
"""

import functools
import os
import sys
from pathlib import Path

MIB = float(2**20)
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_CGROUP_LIMITS = (
    # (limit file, usage file) for cgroup v2, then v1
    (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
    (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")),
)
# cgroup v1 reports "no limit" as a huge number rather than "max"
_UNLIMITED = 2**60


def process_rss_mb() -> float | None:
    """Resident set size of this process in MiB, or ``None`` where it cannot be read.

    Example::

        >>> process_rss_mb() > 0
        True
    """
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE / MIB
    except (OSError, IndexError, ValueError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # ru_maxrss is in KiB on Linux and in bytes on macOS; it is the peak, the best this platform offers
        return peak / MIB if sys.platform == "darwin" else peak / 1024.0
    except (ImportError, OSError):
        return None


def host_available_mb() -> float | None:
    """Memory this process could still allocate, in MiB: the smaller of ``MemAvailable`` and the cgroup headroom.

    Inside a container with a memory limit, ``/proc/meminfo`` shows the whole machine; the cgroup limit minus its
    usage is what is really left before the kernel's OOM killer steps in.
    """
    available = _meminfo_available_mb()
    for limit_file, usage_file in _CGROUP_LIMITS:
        headroom = _cgroup_headroom_mb(limit_file, usage_file)
        if headroom is not None:
            available = headroom if available is None else min(available, headroom)
            break
    return available


def _meminfo_available_mb() -> float | None:
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, IndexError, ValueError):
        pass
    return None


def _cgroup_headroom_mb(limit_file: Path, usage_file: Path) -> float | None:
    limit = _cgroup_limit_bytes(limit_file)
    if limit is None:
        return None
    try:
        with open(usage_file, "rb") as usage:
            return (limit - int(usage.read())) / MIB
    except (OSError, ValueError):
        return None


@functools.cache
def _cgroup_limit_bytes(limit_file: Path) -> int | None:
    # a container's limit is fixed for its life: read it once, the usage every time
    try:
        text = limit_file.read_text().strip()
        return None if text == "max" or int(text) >= _UNLIMITED else int(text)
    except (OSError, ValueError):
        return None
