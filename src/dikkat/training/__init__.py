"""Training: the loop, checkpoints, built-in data and tasks."""
