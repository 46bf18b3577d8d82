"""Memory: GPUMemoryMonitor, OOMBackoff, BatchSizeSearch, GPU selection, and their algorithms."""
