"""torch's private tracing machinery that capture runs fn under, behind this one shim: fake tensors and their
exceptions, the Python dispatcher, the decomposition table, switching the active modes off, a dynamo source
for a symbol, and Python functionalization."""

from __future__ import annotations

from torch._decomp import get_decompositions
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes

__all__ = ["DataDependentOutputException", "DynamicOutputShapeException", "FakeTensorMode", "constant_source",
           "disable_current_modes", "enable_python_dispatcher", "functional_tensors", "get_decompositions"]


def constant_source(name: str):
    """A dynamo source naming a symbol (torch._dynamo loads lazily: only a dynamic capture needs it)."""
    from torch._dynamo.source import ConstantSource

    return ConstantSource(name)


def functional_tensors():
    """torch's Python functionalization: (FunctionalTensor, FunctionalTensorMode)."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    return FunctionalTensor, FunctionalTensorMode
