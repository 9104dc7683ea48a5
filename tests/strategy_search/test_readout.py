"""The plan's notes, read off the solution: where a batch given split is gathered, and why."""

import torch

import shardfn as sf


def test_a_split_input_gathered_where_no_way_runs_on_its_pieces_is_said():
    def scan(x):  # a running sum along the split dim: every way to run it needs the dim whole
        return torch.cumsum(x * 2, 0)

    plan = sf.explain(scan, torch.empty(16, device="meta"), world_size=4, in_strategy=((4,),))
    assert "input 0 split as given, then gathered where no rule runs on the pieces: mul -> cumsum" in plan.notes


def test_a_split_input_the_objective_gathers_is_said_with_the_plans_costs():
    def scan(x, w):  # the product could run on the pieces; the scan after it cannot
        return torch.cumsum(x @ w, 0)

    plan = sf.explain(scan, torch.empty(16, 8, device="meta"), torch.empty(8, 8, device="meta"), world_size=4,
                      in_strategy=((4, 1), None))
    (note,) = plan.notes
    assert note.startswith("input 0 split as given, but the level-0 objective gathers it at mm -> cumsum")
    assert "dataset_strategy='data_parallel'" in note
