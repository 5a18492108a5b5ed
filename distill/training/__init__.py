"""Training: the distillation losses, the training loop, checkpoints and resume."""
