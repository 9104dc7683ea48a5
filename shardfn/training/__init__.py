"""Training features around sharded calls: pipeline stages (pipeline), the sharded optimizer (optimizer),
checkpoints that survive a crash (checkpoint), models built on meta tensors (meta_init), DTensors moved between
meshes (reshard: sf.reshard) and this machine's cost-model constants measured (calibrate: python -m
shardfn.calibrate)."""
