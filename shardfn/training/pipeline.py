"""sf.pipeline: stages of a model on different ranks, micro-batches run by a schedule of torch's pipelining engine.

    stage0 = sf.shard(blocks0, in_strategy=..., parameter_plan=..., dataset_strategy="data_parallel")  # ranks 0-3
    stage1 = sf.shard(blocks1, in_strategy=..., parameter_plan=..., dataset_strategy="data_parallel")  # ranks 4-7
    pipe = sf.pipeline([stage0, stage1], microbatches=4, schedule="1f1b", loss_fn=F.cross_entropy)
    loss = pipe.step(x, target=y)      # every rank; the loss on the last stage's ranks, None elsewhere

Semantics. Each stage is a module sharded with ``sf.shard`` on its own ranks (``sf.Layout(..., ranks=...)``): tensor
and data parallelism inside a stage are the shard call's. The stages' rank sets are disjoint and equally large;
rank k of one stage's set sends its activations to rank k of the next (one pipeline process group per position
k), so stages must lay the batch out alike (the same ``dataset_strategy`` and batch axes). With more stages than
rank sets (interleaved schedules) stage i runs on rank set i mod P, P the number of sets.

``step(*inputs, target=)`` splits the batch (this rank's inputs, as each stage's shard call takes them) into
``microbatches`` equal micro-batches along dim 0, runs the schedule, and leaves in every parameter's ``.grad``
the gradient of the whole batch's loss: ``loss_fn(output, target)`` of a micro-batch is a mean over its rows, and
the batch's loss is its mean over micro-batches and data-parallel slices, which for a mean-reduced loss equals
``loss_fn`` over the whole batch on one device. Call it on every rank; inputs matter on the first stage's ranks
and ``target`` on the last's.

Schedules (torch.distributed.pipelining): ``"gpipe"``, ``"1f1b"`` (one stage per rank set), ``"interleaved_1f1b"``
and ``"zero_bubble"`` (torch's interleaved zero-bubble schedule; several stages per rank set).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import runtime
from ..call import ShardedModule, engine_of, plan_stage
from ..call.agreement import Agreement, digest, inputs_not_compared
from ..call.arguments import batch_slices
from ..strategy_search import Plan
from ..strategy_search.cost_model import local_numel
from ..strategy_search.pricing import parameter_copies

__all__ = ["Pipeline", "PipelinePlan", "StagePlan", "pipeline"]

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "zero_bubble": "ScheduleInterleavedZeroBubble"}
_SINGLE = ("gpipe", "1f1b")  # one stage per rank set


@dataclass
class StagePlan:
    """One stage: its ranks, its shard plan for one micro-batch, and its estimated per-rank peak memory."""

    index: int
    ranks: tuple[int, ...]
    plan: Plan
    state_bytes: int  # parameters, gradients and optimizer states per rank
    activation_bytes: int  # what one micro-batch keeps alive per rank until its backward
    in_flight: int  # micro-batches whose activations the schedule holds at once on this stage
    send_bytes: int  # the activation (forward) or gradient (backward) one rank sends to the next stage

    @property
    def peak_bytes(self) -> int:
        return self.state_bytes + self.in_flight * self.activation_bytes


@dataclass
class PipelinePlan:
    schedule: str
    microbatches: int
    stages: list[StagePlan]
    bubble_fraction: float  # idle share of a rank's step time, with equal stage times
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"pipeline: {len(self.stages)} stages, schedule {self.schedule}, {self.microbatches} micro-batches,"
                 f" bubble fraction {self.bubble_fraction:.3f}"]
        for s in self.stages:
            lines.append(f"  stage {s.index} on ranks {list(s.ranks)}: peak {_size(s.peak_bytes)}/rank (state "
                         f"{_size(s.state_bytes)} + {s.in_flight} micro-batches in flight x "
                         f"{_size(s.activation_bytes)} of activations); per micro-batch compute "
                         f"{s.plan.cost.compute_s * 1e3:.3f} ms, communication {s.plan.cost.comm_s * 1e3:.3f} ms")
            if s.index + 1 < len(self.stages):
                lines.append(f"    send_recv to stage {s.index + 1}: {_size(s.send_bytes)} per rank per micro-batch "
                             "forward (activations), the same backward (their gradients)")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def pipeline(stages: Sequence[nn.Module], microbatches: int, schedule: str = "1f1b",
             loss_fn: Callable | None = None) -> "Pipeline":
    """Run ``stages`` (modules sharded with sf.shard on their own ranks) as a pipeline; see the module docs."""
    return Pipeline(list(stages), microbatches, schedule, loss_fn)


class Pipeline:
    def __init__(self, stages: list[nn.Module], microbatches: int, schedule: str, loss_fn: Callable | None):
        if not stages or not all(isinstance(s, ShardedModule) for s in stages):
            raise TypeError("sf.pipeline: stages must be a non-empty list of modules sharded with sf.shard(module, "
                            "...) on their own ranks (sf.Layout(..., ranks=...))")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"sf.pipeline: microbatches must be a positive int, got {microbatches!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"sf.pipeline: schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        if schedule == "zero_bubble" and not _split_backward_passes_custom_nodes():
            raise ValueError(f"sf.pipeline: schedule 'zero_bubble' needs torch >= 2.12: torch {torch.__version__}'s "
                             "split backward cannot pass the autograd node a sharded stage's parameters go through "
                             "(it reads node metadata this torch hides for custom Functions); use "
                             "'interleaved_1f1b', or a newer torch")
        if loss_fn is None or not callable(loss_fn):
            raise TypeError("sf.pipeline: loss_fn(output, target) is required: the pipeline trains")
        configs = [engine_of(s).config for s in stages]
        sets: list[tuple[int, ...]] = []
        for i, c in enumerate(configs):
            if c.ranks is None:
                raise ValueError(f"sf.pipeline: stage {i} runs on every rank; give each stage's layouts the ranks "
                                 "it runs on: sf.Layout(..., ranks=(...))")
            if c.ranks not in sets:
                sets.append(c.ranks)
        if len({len(r) for r in sets}) > 1 or len({x for r in sets for x in r}) != sum(map(len, sets)):
            raise ValueError(f"sf.pipeline: the stages' rank sets {sets} must be disjoint and equally large (rank k "
                             "of one stage sends to rank k of the next)")
        for i, c in enumerate(configs):
            if c.ranks != sets[i % len(sets)]:
                raise ValueError(f"sf.pipeline: stage {i} runs on ranks {c.ranks} but stage i must run on rank set "
                                 f"i mod {len(sets)}: {sets[i % len(sets)]} (stages looped over the rank sets)")
        if len({c.dataset_strategy for c in configs}) > 1 or \
                len({batch_slices(c, len(c.ranks)) for c in configs}) > 1:
            raise ValueError("sf.pipeline: the stages lay the batch out differently (dataset_strategy, or the axes "
                             "splitting it); it flows from rank k of one stage to rank k of the next as it is, so "
                             "give every stage the same")
        for i, c in enumerate(configs):
            if c.out_strategy is not None:
                raise ValueError(f"sf.pipeline: stage {i} has an out_strategy; stages hand plain tensors to the "
                                 "next (rank k to rank k): leave out_strategy None")
        for k in range(len(sets[0])):
            position = [r[k] for r in sets]
            if position != sorted(position):  # torch's schedule maps stage i to the i-th rank of the group
                raise ValueError(f"sf.pipeline: rank {k} of each stage's set, {position}, must ascend from the first "
                                 "stage to the last; list the stages' rank sets in ascending order")
        if schedule in _SINGLE and len(stages) != len(sets):
            raise ValueError(f"sf.pipeline: schedule {schedule!r} runs one stage per rank set, but {len(stages)} "
                             f"stages share {len(sets)} rank sets; use 'interleaved_1f1b' or 'zero_bubble'")
        if len(sets) < 2 and len(stages) < 2:
            raise ValueError("sf.pipeline: a pipeline needs at least two stages")
        self.stages, self.microbatches, self.schedule, self.loss_fn = stages, microbatches, schedule, loss_fn
        self.rank_sets = sets
        self._runner = None
        # the groups of each pipeline position k (rank k of every stage) and of all the pipeline's ranks, made on
        # every rank now: their members alone could not make them later
        device = self._device()
        runtime.init(device=device)
        for r in sets:
            runtime.check_ranks(r, "sf.pipeline")
        if dist.get_world_size() > 1:
            for k in range(len(sets[0])):
                runtime.make_group(tuple(r[k] for r in sets), device)
            runtime.make_group(self._everyone(), device)
        # a stage's parameters on the ranks outside it hold nothing and get no gradient there: they ask for none,
        # so no optimizer keeps states for them here (get_state_dict steps every parameter that asks, and a
        # checkpoint would then hold a never-advancing copy of the stage's step counts beside the real one)
        for i, s in enumerate(stages):
            if dist.get_rank() not in self._ranks(i):
                for p in s.parameters():
                    p.requires_grad_(False)

    # -- running -----------------------------------------------------------------------------------------------

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor | None:
        """One training step's forward and backward over the batch; see the module docs."""
        me = dist.get_rank()
        mine = [i for i, s in enumerate(self.stages) if me in self._ranks(i)]
        if not mine:
            return None
        first, last = 0 in mine, len(self.stages) - 1 in mine
        error = None
        try:
            self._check_step(inputs if first else (), target, last)
        except ValueError as e:
            error = e
        # every rank of the pipeline learns of a bad step before any stage waits for another: no hang
        everyone = self._everyone()
        Agreement("sf.pipeline.step", digest(f"{self.schedule}|{self.microbatches}|{len(self.stages)}"),
                  {"schedule": self.schedule, "stages": str(len(self.stages))},
                  ranks=None if runtime.whole_world(everyone) else everyone).check(
            first=self._runner is None, error=error)
        schedule = self._schedule(mine)
        losses: list = []
        kwargs = {}
        if last:
            kwargs = {"target": target, "losses": losses}
        with inputs_not_compared():  # the stages' inputs are activations (see inputs_not_compared)
            schedule.step(*(inputs if first else ()), **kwargs)
        if not last:
            return None
        return self._batch_loss(losses)

    def _check_step(self, inputs, target, last: bool) -> None:
        for t in inputs:
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] % self.microbatches:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"sf.pipeline.step: inputs split into {self.microbatches} equal micro-batches along "
                                 f"dim 0, but an input has shape {shape}; use a batch divisible by {self.microbatches}")
        if last and (not isinstance(target, torch.Tensor) or target.dim() == 0 or
                     target.shape[0] % self.microbatches):
            shape = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
            raise ValueError(f"sf.pipeline.step: target is required on the last stage's ranks, a tensor whose dim 0 "
                             f"splits into {self.microbatches} micro-batches like the inputs; got {shape}")

    def _everyone(self) -> tuple[int, ...]:
        return tuple(sorted(x for r in self.rank_sets for x in r))

    def _ranks(self, i: int) -> tuple[int, ...]:
        return engine_of(self.stages[i]).config.ranks

    def _device(self) -> str:
        return runtime.resolve_device(engine_of(self.stages[0]).config.device)

    def _slices(self) -> int:
        """The number of distinct batch slices the last stage's ranks hold (1 for full_batch)."""
        engine = engine_of(self.stages[-1])
        return batch_slices(engine.config, len(engine.config.ranks))

    def _schedule(self, mine: list[int]):
        if self._runner is not None:
            return self._runner
        from torch.distributed import pipelining as pp

        device = self._device()
        position = self._ranks(mine[0]).index(dist.get_rank())
        group = runtime.group_of(tuple(r[position] for r in self.rank_sets))
        torch_device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        wrap = _Unviewed if self.schedule == "zero_bubble" else (lambda m: m)
        stages = [pp.PipelineStage(wrap(self.stages[i]), i, len(self.stages), torch_device, group=group)
                  for i in mine]
        share, loss_fn = self._slices() * self.microbatches, self.loss_fn

        def scaled_loss(output, target):
            # the mean over data-parallel slices and micro-batches folds into each micro-batch's loss; not torch's
            # scale_grads, which divides each parameter's .grad after the schedule and so misses the gradients a
            # stage-2 sharded optimizer has moved into its pieces by then
            return loss_fn(output, target) / share

        cls = getattr(pp, SCHEDULES[self.schedule])
        first = stages[0] if self.schedule in _SINGLE else stages
        self._runner = cls(first, self.microbatches, loss_fn=scaled_loss, scale_grads=False)
        return self._runner

    def _batch_loss(self, losses: list) -> torch.Tensor:
        """The whole batch's loss from this rank's micro-batch losses (each already divided by the slices and the
        micro-batches)."""
        mean = torch.stack([loss.detach() for loss in losses]).sum()
        ranks = self._ranks(len(self.stages) - 1)
        if len(ranks) > 1:
            mean = mean.clone()
            dist.all_reduce(mean, group=runtime.group_of(ranks))
            mean /= len(ranks) / self._slices()  # ranks holding one slice each added it
        return mean

    # -- planning ----------------------------------------------------------------------------------------------

    def explain(self, *inputs: torch.Tensor) -> PipelinePlan:
        """The pipeline's plan for a batch like ``inputs`` (this rank's, as step takes them; meta tensors do):
        each stage's shard plan for one micro-batch, its memory, the transfers between stages, the bubble."""
        m, stages = self.microbatches, []
        example = [torch.empty((t.shape[0] // m, *t.shape[1:]), dtype=t.dtype, device="meta") for t in inputs]
        p, v = len(self.rank_sets), len(self.stages) // len(self.rank_sets)
        for i, stage in enumerate(self.stages):
            plan, outs = plan_stage(engine_of(stage), *example)
            state = _state_bytes(stage, plan)
            send = sum(o.numel() * o.element_size() for o in outs) if i + 1 < len(self.stages) else 0
            # what a micro-batch keeps until its backward: the forward's peak above what its inputs (the stage's
            # parameters and optimizer states, the micro-batch) hold as it starts (plan.cost.peak_bytes is the
            # step's, its backward's gradients included, which one micro-batch at a time holds)
            live = [(n.op == "input", n.live_bytes) for n in plan.nodes.values() if n.live_bytes is not None]
            forward = max((b for _, b in live), default=plan.cost.peak_bytes)
            held = max((b for is_input, b in live if is_input), default=0)
            stages.append(StagePlan(i, self._ranks(i), plan, state, max(0, forward - held),
                                    _in_flight(self.schedule, m, p, v, i % p), send))
            example = outs
        notes = ["memory: each stage's plan for one micro-batch, its activations held for every micro-batch in "
                 "flight (the schedule's warm-up depth)"]
        return PipelinePlan(self.schedule, m, stages, _bubble(self.schedule, m, p, v), notes)


def _split_backward_passes_custom_nodes() -> bool:
    """Whether a custom autograd Function's node shows its input metadata, which the zero-bubble schedules'
    weight-gradient pass reads of every node between the loss and the parameters (torch 2.11 refuses it)."""

    class _Same(torch.autograd.Function):
        forward = staticmethod(lambda ctx, x: x.view_as(x))
        backward = staticmethod(lambda ctx, g: g)

    node = _Same.apply(torch.zeros(1, requires_grad=True)).grad_fn
    try:
        node._input_metadata
    except RuntimeError:
        return False
    return True


class _Unviewed(nn.Module):
    """A stage whose outputs are not views: the zero-bubble schedules detach stage outputs in place after the
    input-gradient pass, which torch refuses on views (a sharded call's outputs may be views of its program's)."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, *args):
        out = self.stage(*args)
        return out.clone() if isinstance(out, torch.Tensor) and out._base is not None else out


def _state_bytes(stage: nn.Module, plan: Plan) -> int:
    """Per-rank bytes of the stage's parameters as planned (a trainable one with its gradient and Adam's two
    states, split as a sharded optimizer splits them) and buffers, as the plan's peak counts them."""
    tensors = {**dict(stage.named_parameters()), **dict(stage.named_buffers())}
    zero = engine_of(stage).optimizer_stage
    total = 0
    for entry in plan.inputs:
        t = tensors.get(entry.name)
        if entry.kind in ("param", "buffer") and t is not None:
            n = local_numel(entry.shape, entry.planned, plan.mesh.shape) * t.element_size()
            trained = entry.kind == "param" and t.requires_grad
            copies = parameter_copies(entry.planned, plan.mesh.shape, zero, len(entry.shape)) if trained else 1
            total += int(n * copies)
    return total


def _bubble(schedule: str, m: int, p: int, v: int) -> float:
    """Idle share of a step with equal stage times: (p - 1) warm-up/cool-down slots against the v * m
    micro-batch slots of each rank (Narayanan et al. 2021; v stages per rank when interleaved). Zero bubble
    splits the backward, filling about two thirds of the 1F1B bubble (Qi et al. 2023, ZB-H1)."""
    bubble = (p - 1) / (v * m + p - 1)
    return bubble / 3 if schedule == "zero_bubble" else bubble


def _in_flight(schedule: str, m: int, p: int, v: int, r: int) -> int:
    """Micro-batches a stage on rank set r holds activations for at once."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - r)
    # interleaved (Megatron): (p - r - 1) * 2 + (v - 1) * p warm-up forwards over the rank's v stages, plus one
    return min(m, math.ceil(((p - r - 1) * 2 + (v - 1) * p + 1) / v))
