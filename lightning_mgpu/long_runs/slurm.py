"""Requeue the running SLURM job: the job ID as SLURM names it, and ``scontrol requeue`` with a bounded wait."""

import logging
import os
import re
import subprocess

log = logging.getLogger(__name__)

# seconds ``scontrol requeue`` may take: it asks slurmctld, which answers in well under a second when healthy, and
# the job has only its --signal lead (often 60-120 s) before the time limit
REQUEUE_TIMEOUT = 30.0


def slurm_job_id() -> str | None:
    """The ID ``scontrol`` knows this job by: ``<array job>_<task>`` inside a job array, else ``SLURM_JOB_ID``."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}" if array_job else os.environ.get("SLURM_JOB_ID")
    if job is None or not re.fullmatch(r"[0-9]+(_[0-9]+)?", job):
        return None
    return job


def requeue_slurm_job(timeout: float = REQUEUE_TIMEOUT) -> bool:
    """Run ``scontrol requeue <job>`` for this job; ``True`` when it succeeded, else ``False`` with an error logged."""
    job = slurm_job_id()
    if job is None:
        log.error(
            "lightning_mgpu: cannot requeue: SLURM_JOB_ID (or SLURM_ARRAY_JOB_ID and SLURM_ARRAY_TASK_ID) is missing "
            f"or not a job ID ({os.environ.get('SLURM_JOB_ID')!r}); the job will not restart by itself"
        )
        return False
    command = ["scontrol", "requeue", job]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        log.error(f"lightning_mgpu: `{' '.join(command)}` failed ({error}); the job will not restart by itself")
        return False
    if completed.returncode != 0:
        output = (completed.stderr or completed.stdout).strip()
        log.error(
            f"lightning_mgpu: `{' '.join(command)}` exited with status {completed.returncode} ({output}); the job "
            "will not restart by itself (was it submitted with --requeue?)"
        )
        return False
    log.info(f"lightning_mgpu: requeued SLURM job {job}")
    return True
