"""Long runs: exact resume, atomic saves, SIGTERM and SLURM requeue, the hang watchdog.

Built on ``core`` only; the strategies of ``ddp`` and ``fsdp`` mix these in.
"""
