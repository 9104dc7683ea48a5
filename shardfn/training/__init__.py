"""Training features around sharded calls: pipeline stages (pipeline), the sharded optimizer (optimizer),
checkpoints that survive a crash (checkpoint), and models built on meta tensors (meta_init)."""
