"""CapturedGraph + PlanRequest -> Plan, in four named steps:

1. the problem (:mod:`.problem`): a decision per value, its candidates, where its inputs come from;
2. the terms (:mod:`.pricing`): what each choice costs: compute, memory, communication on every edge;
3. the solution (:mod:`.levels` over :mod:`.solver`): the level's objective, exact where the solver finishes;
4. the plan (:mod:`.readout`): placements, collectives, costs and notes read off the solution.

Each step says on the ``shardfn`` logger what it starts on and, when it ends, its size and time (:mod:`..progress`:
INFO for a large call or a plan that takes over a second, else DEBUG), so a user waiting on a large plan sees it
move. ``SHARDFN_SEARCH_TIME_LIMIT`` bounds the four steps together, and the capture before them where the caller
says when it started. Nothing a search builds outlives it; it runs with Python's collector paused and numpy's
huge pages off (their modules say what each costs).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
import warnings

from torch.distributed.device_mesh import DeviceMesh

from .._collector import collector_paused
from .._huge_pages import huge_pages_off
from ..capture.graph import CapturedGraph
from ..layout import MeshSpec
from ..progress import Progress
from . import cost_model as cm
from .levels import solve_level
from .plan import Plan, gap_text
from .pricing import Pricing
from .problem import CandidateLists, build_problem
from .readout import OverBudget, read_plan
from .recompute import plan_with_recompute
from .request import PlanRequest, search_time_limit

__all__ = ["PlanMemoryWarning", "make_plan"]

log = logging.getLogger("shardfn")
_BUDGET_ROUNDS = 3  # solves a plan over the memory gets before the error
# The seconds after the last solve as a share of pricing's, reserved: the read-out walks what pricing priced
# (Llama-405B's 1.0 s after pricing's 4.5 at level 2, 1.1-1.4 s after 3.9-4.2 at level 1), and Python's collector,
# paused while planning, then passes once over what planning allocated (0.3-0.5 s for the 405B's)
_READ_OUT_SHARE = 0.5


class PlanMemoryWarning(UserWarning):
    """A plan over the nominal memory of a profile whose memory is not a device's own (a CPU rank's share of its
    host): the plan is returned, with the figures and what would fit in its notes."""


def make_plan(captured: CapturedGraph, mesh: DeviceMesh, mesh_spec: MeshSpec, request: PlanRequest,
              progress: Progress | None = None, started: float | None = None) -> Plan:
    """The plan of one captured call. Its time limit bounds the whole search, from ``started`` (the capture's
    start on time.perf_counter, where the caller captured it; else now) to the plan: the solve takes what the
    steps before it left, less the read-out's share, and past the limit the best plan found so far is the
    answer, its gap to the best bound in its notes."""
    with collector_paused(), huge_pages_off():
        return _make_plan(captured, mesh, mesh_spec, request, progress, started)


def _make_plan(captured: CapturedGraph, mesh: DeviceMesh, mesh_spec: MeshSpec, request: PlanRequest,
               progress: Progress | None, started: float | None) -> Plan:
    time_limit_s = request.time_limit_s if request.time_limit_s is not None else search_time_limit()
    deadline = (time.perf_counter() if started is None else started) + time_limit_s
    step = progress if progress is not None else Progress()
    problem = step("search candidates", lambda: build_problem(captured, mesh, request, CandidateLists()),
                   lambda p: f"{len(p.decisions)} decisions, {sum(len(d.candidates) for d in p.decisions)} candidates",
                   f"{len(captured.gm.graph.nodes)} graph nodes on a mesh {tuple(mesh.shape)}, "
                   f"limit {time_limit_s:g} s")
    links = cm.mesh_links(problem.mesh_shape, request.profile, mesh_spec.links)  # each mesh dim's link
    pricing = Pricing(problem, request.profile, request.held(), request.optimizer_stage, request.reduce_dtype,
                      links, reshard=request.policy.regathers and request.grad,
                      every_value=request.policy.objective == "memory")
    priced_from = time.perf_counter()
    terms = step("search pricing", lambda: pricing.terms(request.keep_split), lambda t: f"{len(t.edges)} edges")
    priced_s = time.perf_counter() - priced_from
    solved_by = deadline - _READ_OUT_SHARE * priced_s  # (the read-out after it)
    # the regions backward computes again are chosen around the level's solve (recompute.py); a try of them, a
    # solve and its read-out, takes about what pricing did (Llama-405B's: 3.5-8 s against 5)
    within = functools.partial(_within_budget, request, mesh_spec, pricing, step, solved_by)
    plan = plan_with_recompute(problem, request, pricing, terms, within, solved_by, priced_s)
    if plan.search.get("timed_out"):  # (said of the plan returned, not of a solve tried and dropped)
        log.warning("shardfn: the strategy search stopped at its time limit (%g s, SHARDFN_SEARCH_TIME_LIMIT); "
                    "the plan is the best found, %s", time_limit_s, gap_text(plan.gap))
    return plan


def _within_budget(request: PlanRequest, mesh_spec: MeshSpec, pricing: Pricing, step, deadline: float, problem,
                   terms, final: bool, optional: bool = False) -> Plan:
    """The level's plan of ``problem`` priced by ``terms`` within the memory, the solve given what is left before
    ``deadline``; a ValueError where none fits (the figures of the closest). ``final``: a nominal memory's (a
    CPU's) over-budget plan is returned, said. ``optional``: a try that would improve on a plan found (a ValueError
    where it has none within the memory by ``deadline``)."""
    budget, over = request.profile.memory_bytes, None
    for attempt in range(_BUDGET_ROUNDS):
        try:
            left = max(deadline - time.perf_counter(), 0.0)
            solution = step("search solve",
                            lambda: solve_level(request.policy, terms, request.profile, left, budget, optional),
                            lambda s: f"{s.stats.get('ilp_decisions', 0)} decisions left to the integer program, "
                                      + ("optimal" if s.optimal else f"gap {s.gap:.2%}"), f"{left:.1f} s left")
            plan = step("search read-out", lambda: read_plan(problem, request, mesh_spec, pricing, terms, solution),
                        lambda p: f"{len(p.collectives)} collectives")
            break
        except OverBudget as e:
            # the solve bounds the pricing's estimate of memory, the read-out walks the plan's liveness: where
            # the walk finds more, solve again within a budget smaller by what it found over
            over = e
            if not request.profile.memory_is_hard and final:  # (a CPU's: the host's, shared): said, not refused
                warnings.warn(PlanMemoryWarning(str(e)), stacklevel=2)
                plan = dataclasses.replace(e.plan, notes=[*e.plan.notes, str(e)])
                break
            if not request.policy.solves_again_lower or attempt == _BUDGET_ROUNDS - 1 or math.isinf(budget) \
                    or e.outputs > request.profile.memory_bytes or not request.profile.memory_is_hard \
                    or not final and time.perf_counter() > deadline:
                # (outputs the caller holds that alone exceed the memory: no plan can fit; past the limit, a try
                # that is not the last leaves the time to the next: Llama-405B's plan keeping every value, solved
                # again within less at no time left, 4 s for a plan 20 times slower, over by twice as much)
                raise
            # (the walk exceeds the estimate by about as much in the next plan: lowered by that excess)
            budget = min(budget - 1.05 * (e.peak - request.profile.memory_bytes),
                         request.profile.memory_bytes - 1.05 * (e.peak - terms.memory_of(solution.choice))) - 2**20
        except ValueError:
            if over is not None:
                raise over from None  # (nothing fits the lower budget: the figures of the plan that did not fit)
            if not final or math.isinf(budget):
                raise
            # nothing fits the pricing's estimate: the level's plan without the memory, read out for its figures
            # (a CPU's returned with them, said; a device's error gives them and what would fit)
            budget = math.inf
    return plan
