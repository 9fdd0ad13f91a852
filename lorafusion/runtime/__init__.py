"""Training runtime: distributed set-up, trainer, per-adapter optimizers, checkpoints, PEFT export."""
