"""Trainer keyword arguments shared by the tests."""

# no logger, checkpoints, progress bar or model summary: tests read what they assert on from the objects
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
