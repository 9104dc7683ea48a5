"""A program's step traced once for every size of its dynamic dims (capture.dynamic), as torch.compile's dynamic
shapes trace: AOTAutograd on fake local tensors whose dynamic dims are symbols of a ShapeEnv of its own, so one
pair of per-rank graphs runs every size; what the trace assumed of the sizes (its guards) is checked per call."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ..capture._fake_internals import FakeTensorMode, constant_source
from ..strategy_search.lru import LRU

__all__ = ["ForEverySize"]

_log = logging.getLogger("shardfn")


class _Called(torch.nn.Module):
    """A function as the module AOTAutograd's entry for given fake inputs takes (no parameters of its own)."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class ForEverySize:
    """``fn`` of local tensors, traced at its first call into per-rank graphs (``compilers``: AOTAutograd's, as
    exec.traced gives them) with the ``dynamic`` dims of its inputs ({input position: dims}) as symbols, the
    other dims as they are then. A call runs those graphs where the trace's guards hold for its inputs (sizes
    that must be equal, a size of at least 2, strides that follow the sizes: :meth:`rejects`), else ``fallback``;
    every call runs ``fallback`` where the trace failed (``failed`` says why: the same on every rank)."""

    def __init__(self, fn: Callable, dynamic: dict, compilers: dict, fallback: Callable):
        self.fn, self.compilers, self.fallback = fn, compilers, fallback
        self.dynamic = {i: tuple(dims) for i, dims in dynamic.items()}
        self.compiled: Callable | None = None
        self.failed: str | None = None
        self._guards: tuple | None = None  # (the trace's ShapeEnv, its guards as one Python expression or None)
        self._verdicts = LRU(4096)  # the dynamic inputs' sizes and strides -> why not served (None: served)

    def rejects(self, args) -> str | None:
        """Why the trace does not hold for these local inputs (None: it does, or it is not made yet)."""
        if self._guards is None:
            return self.failed
        key = tuple((tuple(args[i].shape), args[i].stride()) for i in self.dynamic)
        return self._verdicts.get(key, lambda: self._verdict(args))

    def _verdict(self, args) -> str | None:
        shape_env, code = self._guards
        if code is None or shape_env.evaluate_guards_expression(code, list(args)):
            return None
        why = f"its trace for every size assumed {code}"
        _log.info("shardfn: calls of these sizes run interpreted: %s", why)
        return why

    def __call__(self, *args) -> Any:
        if self.compiled is None and self.failed is None:
            self._trace(args)
        if self.rejects(args):
            return self.fallback(*args)
        return self.compiled(*args)

    def _trace(self, args) -> None:
        from functorch.compile import aot_module_simplified
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

        shape_env = ShapeEnv()
        mode = FakeTensorMode(shape_env=shape_env)
        fakes = []
        for i, x in enumerate(args):
            dims = self.dynamic.get(i, ())
            sizes = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(x.dim())]
            fakes.append(mode.from_tensor(x, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes),
                                          source=constant_source(f"shardfn_local{i}")))
        try:
            self.compiled = aot_module_simplified(_Called(self.fn), fakes, **self.compilers)
        except Exception as e:  # noqa: BLE001 - the same trace fails alike on every rank: all run the fallback
            self.failed = f"its trace for every size failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            _log.warning("shardfn: %s; each call runs interpreted", self.failed)
            _log.debug("shardfn: the trace for every size failed", exc_info=True)
            return
        self._guards = (shape_env, shape_env.produce_guards_expression(fakes, ignore_static=True))
