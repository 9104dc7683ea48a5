"""Stage 0, the call site: a call of a sharded callable, from its arguments to its outputs (call.engine), with one
program cache (call.programs); it builds the search's request (call.request) and glues capture, strategy_search
and exec together."""

from .engine import Engine
from .planning import plan_stage
from .sharded import ShardedFunction, ShardedModule, engine_of

__all__ = ["Engine", "ShardedFunction", "ShardedModule", "engine_of", "plan_stage"]
