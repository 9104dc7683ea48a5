"""The program cache (shardfn.call.programs): one owner of every program and per-signature memo of a sharded
callable, bounded by SHARDFN_CACHE_SIZE, emptied whole by clear()."""

import torch

import shardfn as sf
from shardfn.runtime import simulated_world
from tests.harness import on_rank

WORLD = 4


def _kept(programs) -> dict[str, int]:
    return {"by signature": len(programs.by_signature), "for every size": len(programs.for_every_size),
            "sizes seen": len(programs.sizes_seen), "static only": len(programs.static_only),
            "outside": len(programs.outside)}


def test_many_signatures_and_sizes_grow_nothing_past_the_bound(monkeypatch):
    monkeypatch.setenv("SHARDFN_CACHE_SIZE", "3")
    with simulated_world(WORLD):
        f = sf.shard(lambda x: x.sin() * 2, in_strategy=(None,), dynamic=False)
        for rank in range(1, 7):  # structures of other ranks (another structure each), sizes changing in each
            for length in (2, 3, 5):
                x = torch.randn(*(WORLD,) * rank, length)
                torch.testing.assert_close(on_rank(f(x), 0), x.sin() * 2)
        programs = sf.engine_of(f).programs
        kept = _kept(programs)
        assert all(n <= 3 for n in kept.values()) and kept["by signature"] == 3, kept
        g = sf.shard(lambda x: x.cos(), in_strategy=(None,))
        for rank in range(1, 7):  # a program for every size per structure, and the sizes each was first met at
            for length in (2, 3, 5):
                x = torch.randn(*(WORLD,) * rank, length)
                torch.testing.assert_close(on_rank(g(x), 0), x.cos())
        kept = _kept(sf.engine_of(g).programs)
        assert all(n <= 3 for n in kept.values()) and kept["for every size"] >= 1, kept


def test_clear_forgets_everything_kept():
    with simulated_world(WORLD):
        f = sf.shard(lambda x: x.exp(), in_strategy=((WORLD, 1),))
        for length in (2, 3, 4):
            f(torch.randn(WORLD, length))
        programs = sf.engine_of(f).programs
        assert _kept(programs)["for every size"] == 1 and _kept(programs)["sizes seen"] == 1
        programs.clear()
        assert set(_kept(programs).values()) == {0}


def test_explain_takes_every_option_of_shard():
    # shard()'s options are written once: explain() takes each, dynamic among them
    x = torch.randn(8, 6)
    plan = sf.explain(lambda x: x.sin(), x, world_size=WORLD, in_strategy=((WORLD, 1),), dynamic=False,
                      level=2, dataset_strategy="full_batch")
    assert plan.level == 2
    try:
        sf.explain(lambda x: x.sin(), x, world_size=WORLD, in_strategy=((WORLD, 1),), dynamics=False)
    except TypeError as e:
        assert "dynamics" in str(e) and "dynamic" in str(e)
    else:
        raise AssertionError("an unknown option was taken")
