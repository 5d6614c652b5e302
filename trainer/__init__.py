"""The trainer: model, FSDP2, losses, optimizer, checkpoints, weight export."""
