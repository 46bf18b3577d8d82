"""Replicated data parallelism: DDP, its bucket tuning, comm hooks and step flag; DataParallel; one device."""
