"""The search as a whole: what it keeps between plans, what it says while it works, how it ends."""

import logging
import sys

import pytest
import torch
import transformers as tf

import shardfn as sf
from shardfn.strategy_search import levels
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


def test_the_steps_are_reported_on_the_shardfn_logger(caplog):
    with caplog.at_level(logging.DEBUG, logger="shardfn"):
        sf.explain(torch.mm, torch.empty(8, 4, device="meta"), torch.empty(4, 6, device="meta"), world_size=4)
    steps = [r.getMessage().split(":")[0] for r in caplog.records if "search " in r.getMessage()]
    assert steps == ["shardfn search candidates", "shardfn search pricing", "shardfn search solve",
                     "shardfn search read-out"], steps


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


@pytest.mark.parametrize("value", ["0", "-3", "soon"])
def test_a_bad_time_limit_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("SHARDFN_SEARCH_TIME_LIMIT", value)
    with pytest.raises(ValueError, match="SHARDFN_SEARCH_TIME_LIMIT.*positive number of seconds"):
        sf.explain(torch.mm, torch.empty(8, 4, device="meta"), torch.empty(4, 6, device="meta"), world_size=4)
