"""The search as a whole: what it keeps between plans, what it says while it works, how it ends."""

import logging
import sys
import time

import pytest
import torch
import transformers as tf
from torch.distributed.tensor import Replicate

import shardfn as sf
from shardfn.strategy_search import levels, search, solver
from shardfn.strategy_search.lru import LRU


def _module_state() -> dict:
    """The size of every module-level container of the search's modules."""
    sizes = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("shardfn.strategy_search"):
            continue
        for attr, value in vars(module).items():
            if isinstance(value, (dict, list, set, LRU)) and not attr.startswith("__"):
                sizes[f"{name}.{attr}"] = len(value)
    return sizes


def test_repeated_plans_keep_nothing_more_between_them():
    def two_matmuls(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    args = [torch.empty(64, 32, device="meta"), torch.empty(32, 32, device="meta", requires_grad=True),
            torch.empty(32, 16, device="meta", requires_grad=True)]
    sf.explain(two_matmuls, *args, world_size=4)
    before = _module_state()
    for _ in range(5):
        sf.explain(two_matmuls, *args, world_size=4)
    assert _module_state() == before


def _tiny_llama(layers):
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)
    with torch.device("meta"):
        return tf.LlamaForCausalLM(cfg)


def test_values_computed_from_buffers_are_whole_and_tie_no_layers_together():
    # transformers computes RoPE's cos/sin from a buffer (inv_freq) and feeds them to every layer: as searched
    # values they tied all layers into one problem the integer program had to solve (a time limit at 32 layers)
    model = _tiny_llama(6)
    ids = torch.zeros(8, 16, dtype=torch.long, device="meta")
    mesh = sf.Layout((4, 2), ("dp", "tp"))
    plan = sf.explain(model, ids, world_size=8, in_strategy=(mesh("dp", "None"),), level=2, device="cuda")
    assert plan.search["ilp_decisions"] == 0 and plan.optimal, plan.search
    cos = [n for n in plan.nodes.values() if n.op == "aten.cos.default"]
    assert cos and all(p.is_replicate() for n in cos for p in n.outputs[0])


def test_the_steps_are_reported_on_the_shardfn_logger_as_they_start_and_end(caplog):
    with caplog.at_level(logging.DEBUG, logger="shardfn"):
        sf.explain(torch.mm, torch.empty(8, 4, device="meta"), torch.empty(4, 6, device="meta"), world_size=4)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("shardfn ")]
    steps = [(m.split(":")[0], "started" in m) for m in lines]
    assert steps == [(f"shardfn {s}", started) for s in ("capture", "search candidates", "search pricing",
                                                          "search solve", "search read-out")
                     for started in (True, False)], lines
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.getMessage() in lines)  # a small call


def test_a_large_call_reports_from_its_first_step(caplog):
    # a model of over 100 M elements: its capture says it started at INFO, before anything has taken a second
    with caplog.at_level(logging.INFO, logger="shardfn"):
        sf.explain(torch.mm, torch.empty(2**14, 2**14, device="meta"), torch.empty(2**14, 8, device="meta"),
                   world_size=4)
    first = next(r for r in caplog.records if r.getMessage().startswith("shardfn "))
    assert first.levelno == logging.INFO and first.getMessage().startswith("shardfn capture: started")


def test_a_search_stopped_by_its_time_limit_returns_its_best_plan_and_says_so(monkeypatch, caplog):
    real = levels.solve

    def stopped(problem, time_limit_s):
        sol = real(problem, time_limit_s)
        sol.optimal, sol.timed_out, sol.gap = False, True, 0.034
        return sol

    monkeypatch.setattr(levels, "solve", stopped)
    monkeypatch.setenv("SHARDFN_SEARCH_TIME_LIMIT", "0.5")
    with caplog.at_level(logging.WARNING, logger="shardfn"):
        plan = sf.explain(torch.mm, torch.empty(8, 4, device="meta"), torch.empty(4, 6, device="meta"),
                          world_size=4)
    assert not plan.optimal and plan.gap == pytest.approx(0.034)
    assert "within 3.40% of the best bound" in str(plan)
    assert any("time limit" in n for n in plan.notes)
    assert any("strategy search stopped at its time limit" in r.getMessage() for r in caplog.records)


def _tangled(x, y, z, w):
    # every pair of the four read together: exact elimination leaves a residue to the integer program
    return (x @ y) @ z + (x @ w) @ z + (y @ w) * (x @ z) + (z @ w) @ (y @ x)


@pytest.mark.parametrize("slow", ["capture", "pricing"])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_the_time_limit_bounds_the_whole_planning_not_its_solve_alone(monkeypatch, caplog, level, slow):
    # steps before the solve that use up the limit (the capture's included) leave it none: the plan is the best
    # found at once (exact elimination, then the incumbent), its gap in its notes; no integer program runs past
    # the limit
    from shardfn.call import planning

    args = [torch.empty(64, 64, device="meta", requires_grad=True) for _ in range(4)]
    timed = sf.explain(_tangled, *args, world_size=8, in_strategy=(None,) * 4, level=level)
    assert timed.search["ilp_decisions"] > 0 and timed.optimal
    owner, name = (search.Pricing, "terms") if slow == "pricing" else (planning, "_capture")
    step = getattr(owner, name)

    def slowed(*a, **k):
        time.sleep(0.3)
        return step(*a, **k)

    def past_the_limit(*args, **kwargs):
        raise AssertionError("the integer program ran with no time left")

    monkeypatch.setattr(owner, name, slowed)
    monkeypatch.setattr(solver, "_program", past_the_limit)
    monkeypatch.setenv("SHARDFN_SEARCH_TIME_LIMIT", "0.2")
    with caplog.at_level(logging.WARNING, logger="shardfn"):
        plan = sf.explain(_tangled, *args, world_size=8, in_strategy=(None,) * 4, level=level)
    assert not plan.optimal and plan.gap > 0
    assert any("stopped at its time limit" in n and f"{plan.gap:.2%}" in n for n in plan.notes), plan.notes
    assert any("strategy search stopped at its time limit" in r.getMessage() for r in caplog.records)
    if level == 2:  # the plan the full search proves best is no worse than the one found at once
        assert timed.cost.total_s <= plan.cost.total_s * (1 + 1e-9)


@pytest.mark.parametrize("value", ["0", "-3", "soon"])
def test_a_bad_time_limit_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("SHARDFN_SEARCH_TIME_LIMIT", value)
    with pytest.raises(ValueError, match="SHARDFN_SEARCH_TIME_LIMIT.*positive number of seconds"):
        sf.explain(torch.mm, torch.empty(8, 4, device="meta"), torch.empty(4, 6, device="meta"), world_size=4)


def test_a_value_made_by_new_full_from_a_value_needing_a_gradient_needs_none():
    # binary_cross_entropy's decomposition clamps with p.new_full((), -100): that scalar carries no gradient, yet
    # the plan reduced its pending "gradient" in backward (one all_reduce a step that exec never ran, priced)
    def clamped_loss(x):
        p = torch.sigmoid(x)
        c = p.new_full((), -100.0)
        return (torch.maximum(torch.log1p(-p), c) - torch.maximum(torch.log(p), c)).sum()

    plan = sf.explain(clamped_loss, torch.empty(64, 1024, device="meta", requires_grad=True), world_size=4,
                      in_strategy=((4, 1),))
    assert not [c for c in plan.collectives if c.phase == "backward" and "new_full" in c.where], plan.table()


def _mlp(x, w1, w2):
    h = torch.tanh(x @ w1)
    return torch.sin(h * torch.sigmoid(h)) @ w2


def test_a_plan_of_shortlists_past_the_time_limit_runs_as_the_unsharded_call(monkeypatch):
    # with no time left after pricing, elimination keeps a shortlist of each large decision (here of 4: this
    # graph's decisions hold 8-36 candidates on 2 x 2 x 2, a 4-D mesh's hundreds); the plan says so, and runs
    # sharded as the call runs whole
    from tests.parity import check_parity

    terms = search.Pricing.terms

    def slow(self, keep_split=()):
        time.sleep(0.3)
        return terms(self, keep_split)

    monkeypatch.setattr(search.Pricing, "terms", slow)
    monkeypatch.setattr(solver, "_SHORTLIST", 4)
    monkeypatch.setenv("SHARDFN_SEARCH_TIME_LIMIT", "0.2")
    layout = sf.Layout((2, 2, 2), ("a", "b", "c"))

    def make():
        return (torch.randn(4, 8, 16), torch.randn(16, 32, requires_grad=True),
                torch.randn(32, 16, requires_grad=True))

    plan = check_parity(_mlp, make, (layout("a", "None", "None"), None, None), world=8, level=2)
    assert plan.search["shortlisted"] == 4 and not plan.optimal
    assert any("no bound known" in n for n in plan.notes), plan.notes
    whole = (Replicate(),) * 3
    assert any(o not in (None, whole) for n in plan.nodes.values() for o in n.outputs)  # (it splits values)


@pytest.mark.parametrize("past", [False, True])
def test_a_try_over_the_memory_is_solved_again_within_less_unless_past_the_limit_with_another_to_come(monkeypatch,
                                                                                                   past):
    # the read-out's walk finding the plan keeping every value over the memory: before the limit it is solved
    # again within a budget lowered by the excess; past it the try of recompute comes at once (Llama-405B's plan
    # keeping every value, solved again with no time left: 4 s for a plan 20 times slower, over by twice as much)
    import dataclasses

    from shardfn.strategy_search import readout
    from tests.models import GPTStack

    budgets = []
    real_solve, real_read = search.solve_level, search.read_plan

    def solve(policy, terms, profile, left, budget, optional=False):
        budgets.append(budget)
        return real_solve(policy, terms, profile, left, budget, optional)

    def read(problem, request, *args):
        plan = real_read(problem, request, *args)
        if not problem.recomputed:  # (the walk of the plan keeping every value, said to be over the memory)
            over = dataclasses.replace(plan, cost=dataclasses.replace(plan.cost, peak_bytes=int(90e9)))
            raise readout.OverBudget(over, 0, "over the memory")
        return plan

    monkeypatch.setattr(search, "solve_level", solve)
    monkeypatch.setattr(search, "read_plan", read)
    if past:
        monkeypatch.setattr(search, "_READ_OUT_SHARE", 10**6)  # (every solve starts past the limit)
    with torch.device("meta"):
        model, x = GPTStack(4, 1024, 16), torch.empty(64, 2048, 1024)
    plan = sf.explain(model, x, world_size=2, in_strategy=(None,), device="cuda", level=2)
    assert plan.recompute and plan.cost.peak_bytes <= 80e9
    # (the first: the plan keeping every value, within the memory; the last: a try of recompute, within it)
    assert budgets[0] == budgets[-1] == 80e9
    lower = [b for b in budgets if b < 80e9]
    assert (lower == []) if past else (lower and all(b < 80e9 - 10e9 for b in lower)), budgets
