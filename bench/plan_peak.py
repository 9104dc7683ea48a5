"""The memory a plan reports against what its ranks hold: ``plan.cost.peak_bytes`` / the measured tensor peak.

    python bench/plan_peak.py [--models mlp,gpt,gpt2,llama] [--levels 0,1,2] [--meshes 2,2x2]

Each mesh runs in its own gloo ranks (``2``: two ranks, every layout searched, the batch given whole; ``2x2``:
four ranks on a ("dp", "tp") mesh, the batch split over "dp", the rest searched). On them, for each model (an MLP
of tests.models' BasicBlocks, a stack of two tests.models GPT blocks, transformers' GPT-2 and Llama at small
configs) and level: the model is sharded, one AdamW (foreach) step plans, compiles and makes the optimizer's
states, the gradients are set to None; then one step (forward, backward, optimizer) runs under a tracker of
tensor bytes (bench/_tensor_peak.py: every storage an op makes, from the parameters, optimizer states, buffers
and inputs held before it, until it is freed), the outputs held through the backward as a training loop holds
them. Printed per row: the plan's peak, the measured peak of the forward and backward and of the whole step
(each the largest over the ranks), plan / measured (the whole step), and a summary of the ratios. The loss of
tests.models' outputs is their mean (outside the plan, as a user computes it); transformers' models compute
theirs inside.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from bench._tensor_peak import TensorPeak  # noqa: E402
from tests.harness import free_port  # noqa: E402

MiB = 2**20
VOCAB, BATCH, SEQ = 1024, 8, 64


def _mlp():
    from tests.models import BasicBlock

    return nn.Sequential(BasicBlock(256, 1024), BasicBlock(256, 1024))


def _gpt():
    from tests.models import GPTStack

    return GPTStack(2, 256, 8)


def _gpt2():
    import transformers as tf

    return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _llama():
    import transformers as tf

    return tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                              max_position_embeddings=SEQ, use_cache=False))


# name: (make, the batch's shape, float input or tokens)
MODELS = {"mlp": (_mlp, (1024, 256), True), "gpt": (_gpt, (BATCH, 128, 256), True),
          "gpt2": (_gpt2, (BATCH, SEQ), False), "llama": (_llama, (BATCH, SEQ), False)}


def _call(name: str, mesh: str):
    """(args, kwargs, the loss of the outputs, shard's in_strategy) of one model on one mesh."""
    _, shape, floats = MODELS[name]
    torch.manual_seed(1)  # the same batch on every rank
    if floats:
        x = torch.randn(shape)
        args, kwargs, loss = (x,), {}, (lambda out: out.mean())
    else:
        ids = torch.randint(0, VOCAB, shape)
        args, kwargs, loss = (ids,), {"labels": ids}, (lambda out: out.loss)
    if mesh != "2x2":
        return args, kwargs, loss, (None,)
    import shardfn as sf

    split = sf.Layout((2, 2), ("dp", "tp"))("dp", *("None",) * (len(shape) - 1))
    return args, kwargs, loss, ((split,) if floats else {"input_ids": split, "labels": split})


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _precision():
    """bf16 autocast where ``--autocast`` asks (SHARDFN_BENCH_AUTOCAST, read by every rank), else nothing."""
    on = os.environ.get("SHARDFN_BENCH_AUTOCAST") == "1"
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def _measure(name: str, level: int, mesh: str) -> tuple[int, int, int]:
    """(the plan's peak, the measured peak of forward and backward, of the whole step) on this rank."""
    import shardfn as sf

    torch.manual_seed(0)
    args, kwargs, loss_of, strategy = _call(name, mesh)
    model = sf.shard(MODELS[name][0](), in_strategy=strategy, level=level)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    with _precision():
        loss_of(model(*args, **kwargs)).backward()  # plans, compiles; the optimizer makes its states
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    held = [_local(t) for t in [*model.parameters(), *model.buffers(), *states, *args, *kwargs.values()]]
    with TensorPeak(held, dtensors=True) as tracker, _precision():
        out = model(*args, **kwargs)  # held through the backward, as a training loop holds it
        loss_of(out).backward()
        backward = tracker.peak
        del out
        opt.step()
    opt.zero_grad(set_to_none=True)
    with _precision():
        plan = sf.explain(model, *args, kwargs=kwargs)
    return plan.cost.peak_bytes, backward, tracker.peak


def worker(rank: int, world: int, port: int, mesh: str, args, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import warnings

    import shardfn as sf

    warnings.simplefilter("ignore")
    sf.init()
    for name in args.models.split(","):
        for level in map(int, args.levels.split(",")):
            try:
                results[(mesh, name, level, rank)] = _measure(name, level, mesh)
            except Exception as e:  # noqa: BLE001 (the row says what failed; every rank fails alike)
                results[(mesh, name, level, rank)] = f"{type(e).__name__}: {e}".splitlines()[0][:90]
            gc.collect()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,gpt,gpt2,llama")
    p.add_argument("--levels", default="0,1,2")
    p.add_argument("--meshes", default="2,2x2")
    p.add_argument("--autocast", action="store_true", help="forward and backward under bf16 autocast")
    args = p.parse_args()
    if args.autocast:  # (the spawned ranks read it from their environment)
        os.environ["SHARDFN_BENCH_AUTOCAST"] = "1"
    results = mp.get_context("spawn").Manager().dict()
    ratios = []
    print(f"{'mesh':<5} {'model':<6} {'level':>5} {'plan MiB':>9} {'fwd+bwd MiB':>12} {'step MiB':>9} "
          f"{'plan/step':>9}")
    for mesh in args.meshes.split(","):
        world = 4 if mesh == "2x2" else int(mesh)
        mp.start_processes(worker, args=(world, free_port(), mesh, args, results), nprocs=world, join=True,
                           start_method="spawn")
        for name in args.models.split(","):
            for level in map(int, args.levels.split(",")):
                rows = [results[(mesh, name, level, r)] for r in range(world)]
                if any(isinstance(r, str) for r in rows):
                    print(f"{mesh:<5} {name:<6} {level:>5} failed: {next(r for r in rows if isinstance(r, str))}")
                    continue
                plan, backward, step = max(r[0] for r in rows), max(r[1] for r in rows), max(r[2] for r in rows)
                ratios.append(plan / step)
                print(f"{mesh:<5} {name:<6} {level:>5} {plan / MiB:>9.2f} {backward / MiB:>12.2f} "
                      f"{step / MiB:>9.2f} {plan / step:>9.3f}", flush=True)
    if not ratios:
        return
    within = sum(abs(r - 1) <= 0.10 for r in ratios)
    print(f"plan / measured: {min(ratios):.3f} to {max(ratios):.3f}; {within} of {len(ratios)} rows within 10%")


if __name__ == "__main__":
    main()
