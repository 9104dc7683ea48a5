import gc

import torch

import shardfn as sf
import shardfn.strategy_search.search as search
from shardfn._collector import collector_paused


def test_paused_inside_and_enabled_again_after():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # (nested: the outer one enables it again)
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_caller_who_disabled_the_collector_keeps_it_disabled():
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_enabled_again_when_the_plan_raises():
    try:
        with collector_paused():
            raise ValueError("a plan that fails")
    except ValueError:
        pass
    assert gc.isenabled()


def test_planning_runs_with_the_collector_paused(monkeypatch):
    seen = []
    real = search._make_plan

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(search, "_make_plan", recording)
    w = torch.randn(16, 16)
    sf.explain(lambda x: x @ w, torch.randn(8, 16), in_strategy=((2, 1),), world_size=2)
    assert seen == [False]
    assert gc.isenabled()
