"""Performance: PerformanceMonitor (step timing, FLOPs and MFU, stragglers)."""
