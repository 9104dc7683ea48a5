"""What shard() returns: ShardedFunction (a function's) and ShardedModule (put in front of a module's class), and
engine_of() to reach the Engine behind either."""

from __future__ import annotations

from .engine import Engine

__all__ = ["ShardedFunction", "ShardedModule", "engine_of"]


class ShardedFunction:
    """A function sharded over the world; call it like the function. See :func:`shardfn.shard`."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.__wrapped__ = engine.fn
        self.__doc__ = getattr(engine.fn, "__doc__", None)

    def __call__(self, *args, **kwargs):
        return self._engine(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<shardfn.ShardedFunction {self._engine.name}>"


class ShardedModule:
    """Mixin put in front of a sharded module's class: forward runs the sharded program."""

    _shardfn_engine: Engine

    def forward(self, *args, **kwargs):
        engine = self.__dict__["_shardfn_engine"]
        if engine.capturing_self:
            return super().forward(*args, **kwargs)
        return engine(*args, **kwargs)


def engine_of(sharded: ShardedFunction | ShardedModule) -> Engine:
    """The engine behind a sharded function or module, for tools and tests to read: its ``config``, its
    ``programs`` (by signature, and for every size: shardfn.call.programs), its ``captures`` (captures and plans
    made so far). Read it; changing it is not supported."""
    if isinstance(sharded, ShardedFunction):
        return sharded._engine
    if isinstance(sharded, ShardedModule):
        return sharded.__dict__["_shardfn_engine"]
    raise TypeError(f"engine_of takes what sf.shard returned, got {type(sharded).__name__}")
