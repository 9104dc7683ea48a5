"""The adapter of DTensor's rules: a whole-mesh rule that enumerates every placement itself (DTensor's full-mesh
expansion of its single-dim rules: gather, scatter) is asked once per node, not once per combination of its
inputs' layouts, and gives the same strategies."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from shardfn.strategy_search import _dtensor_adapter as adapter
from tests.strategy_search.truth import planning

aten = torch.ops.aten

CASES = {
    # the router's top-k weights read back by expert (DeepSeek-V3): 6,912 strategies asked one combination at a time
    "gather": (aten.gather.default, lambda: (torch.empty(8, 16, 12), -1, torch.empty(8, 16, 4, dtype=torch.long))),
    "gather_2d": (aten.gather.default, lambda: (torch.empty(32, 12), 1, torch.empty(32, 4, dtype=torch.long))),
    "scatter": (aten.scatter.src, lambda: (torch.empty(32, 12), 1, torch.empty(32, 4, dtype=torch.long),
                                           torch.empty(32, 4))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_rule_that_enumerates_every_placement_is_asked_once(name, monkeypatch):
    op, make = CASES[name]
    with FakeTensorMode():
        args = make()
    mesh = planning(2, 2, 2)
    asked = []
    per_combination = adapter._per_combination
    monkeypatch.setattr(adapter, "_per_combination", lambda *a: asked.append(1) or per_combination(*a))
    once = adapter.dtensor_strategies(op, args, {}, mesh)
    assert not asked
    monkeypatch.setattr(adapter, "_enumerated", lambda op, strategy: False)  # as before: once per combination
    every = adapter.dtensor_strategies(op, args, {}, mesh)
    assert asked and len(once) == len(every) and set(once) == set(every)
