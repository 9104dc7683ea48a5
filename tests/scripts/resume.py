"""One rank of a training run that is saved, killed and resumed, for every way of training shardfn offers:
python resume.py PHASE FOLDER WAY[,WAY...]

  run     trains each way SAVE_AT steps, saves it (FOLDER/WAY: sf.save, or torch's dcp.async_save), trains AFTER
          more steps and writes what the uninterrupted run reached (losses, parameters, optimizer states, the LR)
          to FOLDER/WAY.RANK.pt
  resume  in fresh processes (another world size too): builds each way anew, loads FOLDER/WAY, trains the same
          AFTER steps and prints one line per way: RESUMED WAY <largest differences against the uninterrupted run>

Each way is a transformers GPT-2 (or, for the pipeline, two MLP stages) trained with AdamW and an LR schedule on
token batches drawn from one seed; each rank feeds the rows of the batch it holds.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
import transformers
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import shardfn as sf
from tests.training.test_pipeline import MLP

SAVE_AT, AFTER, BATCH, LENGTH, VOCAB = 1, 2, 8, 8, 64
transformers.logging.set_verbosity_error()


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def megatron_plan(model, layout):
    plan = {}
    for i in range(len(model.transformer.h)):  # Conv1D weights are (in, out): column parallel splits dim 1
        for name in ("attn.c_attn", "mlp.c_fc"):
            plan[f"transformer.h.{i}.{name}.weight"] = layout("None", "tp")
            plan[f"transformer.h.{i}.{name}.bias"] = layout("tp")
        for name in ("attn.c_proj", "mlp.c_proj"):
            plan[f"transformer.h.{i}.{name}.weight"] = layout("tp", "None")
    return plan


class Way:
    """One way of training: its model(s), optimizer, schedule, and which rows of a batch this rank feeds."""

    zero = 0        # sf.shard_optimizer's stage (0: the torch optimizer as it is)
    micro = 1       # micro-batches a step (all but the last inside sf.no_sync)
    recipe = "dcp"  # "dcp": get_state_dict / set_state_dict; "plain": model.state_dict() / opt.state_dict()
    writer = "sf"   # "sf": sf.save / sf.load; "dcp_async": torch's dcp.async_save / dcp.load

    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.models = self.build()
        opt = torch.optim.AdamW([p for m in self.models for p in m.parameters()], lr=1e-2, weight_decay=0.1)
        self.opt = sf.shard_optimizer(opt, *self.models, stage=self.zero) if self.zero else opt
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)

    def rows(self) -> slice:  # data parallel over every rank
        per = BATCH // self.world
        return slice(per * self.rank, per * (self.rank + 1))

    def loss(self, ids):
        return self.models[0](ids, labels=ids).loss

    def step(self, seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        total = torch.zeros(2)
        for m in range(self.micro):
            ids = torch.randint(VOCAB, (BATCH, LENGTH), generator=g)[self.rows()]
            with sf.no_sync(*self.models) if m < self.micro - 1 else _nothing():
                loss = self.loss(ids)
                (loss / self.micro).backward()  # (the model's loss: a mean over the global batch)
            total += torch.stack([loss.detach() * len(ids), torch.tensor(float(len(ids)))])
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()
        dist.all_reduce(total)  # the mean over the global batch (ranks holding the same rows count them alike)
        return (total[0] / total[1]).item()

    def state(self):
        if self.recipe == "plain":
            return {"model": self.models[0].state_dict(), "optim": self.opt.state_dict(),
                    "sched": self.sched.state_dict()}
        model_state, optim_state = get_state_dict(self.models[0], self.opt)
        return {"model": model_state, "optim": optim_state, "sched": self.sched.state_dict()}

    def set_state(self, state) -> None:
        if self.recipe == "plain":
            self.models[0].load_state_dict(state["model"])
            self.opt.load_state_dict(state["optim"])
        else:
            set_state_dict(self.models[0], self.opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        self.sched.load_state_dict(state["sched"])

    def summary(self):
        """What the run has reached, whole: parameters, AdamW's states by parameter name, the LR."""
        names = {id(p): f"{i}.{n}" for i, m in enumerate(self.models) for n, p in m.named_parameters()}
        params = {names[id(p)]: _whole(p) for m in self.models for p in m.parameters()}
        states = {f"{names[id(p)]}.{k}": _whole(v) for p, s in self.opt.state.items() for k, v in s.items()}
        return {"params": params, "states": states, "lr": self.opt.param_groups[0]["lr"]}


class DataParallel(Way):
    def build(self):
        return [sf.shard(gpt2(), in_strategy=(None,), dataset_strategy="data_parallel")]


class Level1(Way):
    def build(self):
        return [sf.shard(gpt2(), in_strategy=(None,), level=1)]

    def rows(self):
        return slice(0, BATCH)  # full batch: every rank feeds the whole batch


class MegatronDP(DataParallel):
    def build(self):
        model = gpt2()
        layout = sf.Layout((2, self.world // 2), ("dp", "tp"))
        rows = layout("dp", "None")  # the batch over "dp" only (tp's ranks hold the same rows)
        return [sf.shard(model, in_strategy={"input_ids": rows, "labels": rows}, dataset_strategy="data_parallel",
                         parameter_plan=megatron_plan(model, layout))]

    def rows(self):
        per = BATCH // 2
        return slice(per * (self.rank // (self.world // 2)), per * (self.rank // (self.world // 2) + 1))


class Zero1(DataParallel):
    zero, writer = 1, "dcp_async"


class Zero2NoSync(DataParallel):
    zero, micro, recipe = 2, 2, "plain"


class MixedPrecision(DataParallel):
    def build(self):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return [sf.shard(gpt2(), in_strategy=(None,), dataset_strategy="data_parallel", mp_policy=policy)]


class Pipeline(Way):
    """Two MLP stages on ranks (0, 1) and (2, 3), each data parallel over its two ranks, 1F1B."""

    def build(self):
        torch.manual_seed(0)
        mods = [MLP(), MLP()]
        for i, m in enumerate(mods):
            layout = sf.Layout((2,), ("dp",), ranks=((0, 1), (2, 3))[i])
            sf.shard(m, in_strategy=(layout("dp", "None"),), dataset_strategy="data_parallel")
        self.pipe = sf.pipeline(mods, microbatches=2, schedule="1f1b", loss_fn=F.mse_loss)
        return mods

    def step(self, seed):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
        row = self.rank % 2
        loss = self.pipe.step(x.chunk(2)[row], target=y.chunk(2)[row])
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()
        total = torch.zeros(1) if loss is None else loss.detach().reshape(1) / 2  # the last stage's ranks
        dist.all_reduce(total)
        return total.item()

    def state(self):
        model_state, optim_state = get_state_dict(nn.ModuleList(self.models), self.opt)
        return {"model": model_state, "optim": optim_state, "sched": self.sched.state_dict()}

    def set_state(self, state):
        set_state_dict(nn.ModuleList(self.models), self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.sched.load_state_dict(state["sched"])


WAYS = {"data_parallel": DataParallel, "level1": Level1, "megatron_dp": MegatronDP, "zero1": Zero1,
        "zero2_no_sync": Zero2NoSync, "mixed_precision": MixedPrecision, "pipeline": Pipeline}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _whole(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()


def run(folder: str, name: str) -> None:
    way = WAYS[name]()
    for step in range(SAVE_AT):
        way.step(step)
    if way.writer == "sf":
        sf.save(way.state(), os.path.join(folder, name))
    else:
        dcp.async_save(way.state(), checkpoint_id=os.path.join(folder, name)).result()
    losses = [way.step(SAVE_AT + i) for i in range(AFTER)]
    summary = {"losses": losses, "world": dist.get_world_size(), **way.summary()}
    torch.save(summary, os.path.join(folder, f"{name}.{dist.get_rank()}.pt"))  # (a pipeline rank's own stage)


def _largest(got: dict, want: dict) -> float:
    return max((0.0, *((got[k] - v).abs().max().item() for k, v in want.items() if v.numel())))


def resume(folder: str, name: str) -> str:
    way = WAYS[name]()
    state = way.state()  # (a fresh optimizer's states made to load into)
    if way.writer == "sf":
        sf.load(state, os.path.join(folder, name))
    else:
        dcp.load(state, checkpoint_id=os.path.join(folder, name))
    way.set_state(state)
    losses = [way.step(SAVE_AT + i) for i in range(AFTER)]
    got, want = way.summary(), torch.load(os.path.join(folder, f"{name}.{dist.get_rank()}.pt"))
    assert got["params"].keys() == want["params"].keys() and got["states"].keys() == want["states"].keys(), name
    gaps = {"loss": max(abs(a - b) for a, b in zip(losses, want["losses"])),
            "params": _largest(got["params"], want["params"]), "states": _largest(got["states"], want["states"]),
            "lr": abs(got["lr"] - want["lr"])}
    gaps = {k: torch.tensor(v) for k, v in gaps.items()}
    for v in gaps.values():
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return f"RESUMED {name} world {want['world']}->{dist.get_world_size()} " + " ".join(
        f"{k}={v.item():.3g}" for k, v in gaps.items())


if __name__ == "__main__":
    phase, folder, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    sf.init()
    for name in names:
        if phase == "run":
            run(folder, name)
        else:
            line = resume(folder, name)
            if dist.get_rank() == 0:
                print(line, flush=True)
    dist.barrier()
