"""shardfn: MindSpore-style functional operator sharding for PyTorch.

    import shardfn as sf
    y = sf.shard(dense_relu, in_strategy=((4, 2), None, None))(x, weight, bias)
"""

from .api import ShardedFunction, ShardedModule, engine_of, explain, no_sync, shard, shard_optimizer
from .capture import CaptureError
from .layout import Layout
from .call.reshard import reshard
from .show import show
from .runtime import init
from .strategy_search import Plan
from .training.checkpoint import load, save
from .training.meta_init import materialize
from .training.pipeline import Pipeline, pipeline

__all__ = ["CaptureError", "Layout", "Pipeline", "Plan", "ShardedFunction", "ShardedModule", "engine_of", "explain",
           "init", "load", "materialize", "no_sync", "pipeline", "reshard", "save", "shard", "shard_optimizer", "show"]
