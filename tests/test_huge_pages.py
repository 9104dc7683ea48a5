"""numpy's huge-page advice is off while a plan is searched and as it was after."""

import pytest
import torch

import shardfn as sf
from shardfn import _huge_pages
from shardfn.strategy_search import search

setter = _huge_pages._setter()
pytestmark = pytest.mark.skipif(setter is None, reason="this numpy has no huge-page switch")


def _advice_on() -> bool:
    was = setter(True)  # (reads the setting by setting it: restored at once)
    setter(was)
    return was


@pytest.mark.parametrize("before", [True, False])
def test_huge_pages_are_off_inside_and_as_they_were_after(before):
    was = setter(before)
    try:
        with _huge_pages.huge_pages_off():
            assert not _advice_on()
        assert _advice_on() is before
        with pytest.raises(RuntimeError):
            with _huge_pages.huge_pages_off():
                raise RuntimeError("a plan that fails")
        assert _advice_on() is before
    finally:
        setter(was)


def test_a_plan_is_searched_with_huge_pages_off(monkeypatch):
    seen = []
    real = search._make_plan

    def recording(*args, **kwargs):
        seen.append(_advice_on())
        return real(*args, **kwargs)

    monkeypatch.setattr(search, "_make_plan", recording)
    w = torch.randn(16, 16)
    was = setter(True)
    try:
        sf.explain(lambda x: x @ w, torch.randn(8, 16), in_strategy=((2, 1),), world_size=2)
        assert seen == [False]
        assert _advice_on()
    finally:
        setter(was)
