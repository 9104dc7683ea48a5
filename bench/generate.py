"""generate() on a sharded transformers Llama: seconds per token against the unsharded model, and captures.

    python bench/generate.py [--world 1] [--layers 2] [--dim 64] [--tokens 24] [--prompt 8] [--device cpu]
                             [--dp-tp] [--rounds 9]

The script starts its own gloo ranks (``--world``; 1 measures without oversubscribing the 2 cores); with
``--device cuda``, one rank on the GPU (NCCL, a world of one). A Llama
(transformers, random weights) generates ``--tokens`` greedy tokens from a batch of 2 prompts, three ways, all
in one run: unsharded; sharded whole with a Megatron parameter_plan and a StaticCache; the same with the default
DynamicCache (then a second generate() of the same lengths: "again"). The tokens of every way are asserted
equal to the unsharded model's. Each model forward that
generate() makes is timed (a hook around the model's call), so generate's own Python counts for none of them:

    first    the prompt's forward (shardfn: capture, plan and lowering of its signature)
    token    the median of the decoding forwards after the first one (shardfn with a StaticCache: the cached
             program; with a DynamicCache: from the second token on, the program for every cache length)
    captures the captures (and plans) the sharded model made: one per signature, one for every size of a
             structure whose sizes changed

``--dp-tp`` (an even ``--world``): the model as it trains data x tensor parallel instead, sharded with
dataset_strategy="data_parallel" on a (world/2, 2) ("dp", "tp") mesh and the Megatron plan over "tp"; each rank
passes its dp row's 2 prompts (other prompts on each row), and the unsharded model generates those same rows.

Then ``--rounds`` more generate()s with the DynamicCache, the unsharded and the sharded model taking turns: the
median of each generate()'s median token per way, and their ratio (one pass of each way, as the table has, swings
with the machine's slow spells; this ratio is the one to read).

With ``--world`` above 1 it also times the sharded model's cached forward at one fixed decoding shape (the same
call again and again): the floor a token costs on these ranks, against which a StaticCache's token is compared.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tests.harness import free_port  # noqa: E402


def _llama(args):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=args.dim, intermediate_size=2 * args.dim, num_hidden_layers=args.layers,
                            num_attention_heads=8, num_key_value_heads=4, vocab_size=128,
                            max_position_embeddings=args.prompt + args.tokens + 8)
    return tf.LlamaForCausalLM(config).eval()


def _megatron(layers: int, world: int, layout=None) -> dict:
    """Column- then row-parallel weights: split ``world`` ways, or over ``layout``'s "tp" axis."""
    column, row = ((world, 1), (1, world)) if layout is None else (layout("tp", "None"), layout("None", "tp"))
    plan = {}
    for i in range(layers):
        for n in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{n}.weight"] = column
        for n in ("gate_proj", "up_proj"):
            plan[f"model.layers.{i}.mlp.{n}.weight"] = column
        plan[f"model.layers.{i}.self_attn.o_proj.weight"] = row
        plan[f"model.layers.{i}.mlp.down_proj.weight"] = row
    return plan


def _shard(model, args):
    import shardfn as sf

    if not args.dp_tp:
        return sf.shard(model, in_strategy={}, parameter_plan=_megatron(args.layers, args.world), device=args.device)
    layout = sf.Layout((args.world // 2, 2), ("dp", "tp"))
    return sf.shard(model, in_strategy={"input_ids": layout("dp", "None")}, dataset_strategy="data_parallel",
                    parameter_plan=_megatron(args.layers, args.world, layout), device=args.device)


class _Timed:
    """Times every forward of ``model`` (hooks around its call). A sharded model's capture calls the model again
    inside its first call: only the outermost call is timed (and waits for the other ranks first)."""

    def __init__(self, model):
        self.times: list[float] = []
        self.depth = 0
        model.register_forward_pre_hook(lambda *_: self._enter())
        model.register_forward_hook(lambda *_: self._leave())

    def _enter(self):
        self.depth += 1
        if self.depth == 1:
            _wait_for_all()
            self.t = time.perf_counter()

    def _leave(self):
        self.depth -= 1
        if self.depth == 0:
            if torch.cuda.is_initialized():  # (the GPU's queued work done; no barrier inside the time)
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t)


def _wait_for_all():
    """Every rank here, and the GPU's queued work done."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dist.barrier()


def _generate(model, ids, args, cache: str):
    kwargs = dict(max_new_tokens=args.tokens, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        return model.generate(ids, **kwargs)


def worker(rank, args, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import shardfn as sf

    sf.init(device=args.device)
    reference = _llama(args).to(args.device)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2 * (args.world // 2 if args.dp_tp else 1), args.prompt)).to(args.device)
    if args.dp_tp:  # this rank's dp row's 2 prompts
        ids = ids[2 * (rank // 2): 2 * (rank // 2) + 2]
    rows, graph_notes, dynamic = [], [], {}
    want = None
    for name, cache, sharded in (("unsharded", "static", False), ("shardfn, StaticCache", "static", True),
                                 ("unsharded", "dynamic", False), ("shardfn, DynamicCache", "dynamic", True)):
        model = copy.deepcopy(reference)
        if sharded:
            model = _shard(model, args)
        timed = _Timed(model)
        if cache == "dynamic":
            dynamic[name] = (model, timed)
        out = _generate(model, ids, args, cache)
        want = out if want is None else want
        assert torch.equal(out, want), f"{name}: other tokens than the unsharded model's"
        captures = sf.engine_of(model).captures if sharded else 0
        notes = [f"{name}: {n}" for c in sf.engine_of(model).programs.values() for n in c.program.notes
                 if "CUDA graph" in n] if sharded else []  # whether a world of one's decoding graph is replayed
        graph_notes += notes
        rows.append((f"{name}" if sharded else f"unsharded ({cache} cache)", timed.times[0],
                     statistics.median(timed.times[2:]), captures))
        if rank == 0:  # (as it goes: a lent GPU's run cut short by its time limit still tells what it measured)
            print(f"  so far: {rows[-1][0]}: first {rows[-1][1]:.2f} s, token {rows[-1][2] * 1e3:.2f} ms", *notes,
                  sep="\n  ", flush=True)
        if sharded and cache == "static" and args.world > 1:
            floor = _fixed_shape_forward(model, ids, args)
        if sharded and cache == "dynamic":  # the same lengths again: served as before, no trace per length
            timed.times.clear()
            assert torch.equal(_generate(model, ids, args, cache), want)
            rows.append((f"{name}, again", timed.times[0], statistics.median(timed.times[2:]),
                         sf.engine_of(model).captures))
    turns = _taking_turns(dynamic, ids, args)
    if rank == 0:
        print(f"Llama {args.layers} layers, dim {args.dim}, batch 2{' a dp row' if args.dp_tp else ''}, prompt "
              f"{args.prompt}, {args.tokens} tokens, {args.world} {'gloo' if args.device == 'cpu' else args.device} "
              f"rank(s){', data x tensor parallel' if args.dp_tp else ''}, torch {torch.__version__}")
        print(f"{'':28s} {'first (s)':>10s} {'token (ms)':>11s} {'captures':>9s}")
        for name, first, token, captures in rows:
            print(f"{name:28s} {first:10.2f} {token * 1e3:11.2f} {captures or '':>9}")
        print(f"token, shardfn / unsharded: StaticCache {rows[1][2] / rows[0][2]:.2f}x, "
              f"DynamicCache {rows[3][2] / rows[2][2]:.2f}x")
        if args.world > 1:
            print(f"cached forward at one decoding shape {floor * 1e3:.2f} ms; a StaticCache token / that: "
                  f"{rows[1][2] / floor:.2f}x")
        if turns:
            ms = {name: statistics.median(t) * 1e3 for name, t in turns.items()}
            print(f"DynamicCache taking turns, {args.rounds} generate()s each (the median of each one's median "
                  f"token): unsharded {ms['unsharded']:.2f} ms, shardfn {ms['shardfn, DynamicCache']:.2f} ms, "
                  f"shardfn / unsharded {ms['shardfn, DynamicCache'] / ms['unsharded']:.2f}x")
        if graph_notes:
            print("\n".join(graph_notes))
    dist.barrier()


def _taking_turns(dynamic: dict, ids, args) -> dict[str, list[float]]:
    """``--rounds`` more generate()s with a DynamicCache, the unsharded and the sharded model taking turns (a slow
    spell of this shared machine falls on both alike): each generate()'s median token, per way."""
    turns: dict[str, list[float]] = {name: [] for name in dynamic}
    for _ in range(args.rounds):
        for name, (model, timed) in dynamic.items():
            timed.times.clear()
            _generate(model, ids, args, "dynamic")
            turns[name].append(statistics.median(timed.times[2:]))
    return {name: t for name, t in turns.items() if t}


def _fixed_shape_forward(model, ids, args) -> float:
    """The sharded model's cached program at one decoding shape: one token at a time into a StaticCache (whose
    shapes do not change), called directly, without generate()."""
    from transformers import StaticCache

    calls = 12
    cache = StaticCache(config=model.config, max_cache_len=args.prompt + calls + 1)
    token = ids[:, -1:]
    times = []
    with torch.no_grad():
        # (data_parallel takes every tensor for batch rows: there the cache's own counter gives the positions)
        position = (lambda i: {}) if args.dp_tp else (lambda i: {"cache_position": torch.arange(i, i + 1)})
        model(input_ids=ids, past_key_values=cache, use_cache=True,
              **({} if args.dp_tp else {"cache_position": torch.arange(args.prompt)}))
        for i in range(calls):
            dist.barrier()
            t = time.perf_counter()
            model(input_ids=token, past_key_values=cache, use_cache=True, **position(args.prompt + i))
            times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dp-tp", action="store_true", help="the model as it trains: data x tensor parallel")
    p.add_argument("--rounds", type=int, default=9, help="then this many more DynamicCache generate()s each, "
                   "unsharded and sharded taking turns (the ratio to trust on a shared machine; 0: none)")
    args = p.parse_args()
    if args.dp_tp and (args.world < 2 or args.world % 2):
        p.error("--dp-tp needs an even --world of 2 or more (a (world/2, 2) mesh)")
    if args.device == "cuda" and args.world != 1:
        p.error("--device cuda runs a world of one (one GPU)")
    mp.start_processes(worker, args=(args, free_port()), nprocs=args.world, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
