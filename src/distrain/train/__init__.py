"""The worker loop and what it needs: schedules, optimizers, checkpoints, metrics."""
