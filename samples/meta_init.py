"""A decoder too big for one rank: built on meta, sharded, each rank given only its pieces, trained.

    torchrun --nproc-per-node 4 samples/meta_init.py                 # 12 layers of width 2048: 2.4 GiB of weights
    torchrun --nproc-per-node 4 samples/meta_init.py --check         # small, against the unsharded model
    torchrun --nproc-per-node 4 samples/meta_init.py --load DIR      # the pieces read from a safetensors checkpoint

Each rank gets a memory budget (its data memory, set with a resource limit once torch and the process group are
up) smaller than the whole model's weights, and shows first that building the model whole does not fit in it. Then, the recipe FSDP2 and torchtitan document:

    with torch.device("meta"):
        model = Decoder(config)                                  # no memory
    model = sf.shard(model, in_strategy=..., level=1, example_inputs=(tokens on meta,))   # planned, laid out
    torch.manual_seed(0); sf.materialize(model)                  # each rank its pieces, as Decoder(config) inits
    (or: sf.materialize(model, init=None); sf.load(model, checkpoint))

and a few SGD steps. Every rank prints its peak resident memory against the whole model's size. ``--check`` runs
a small decoder and compares the first steps' losses and gradients with the unsharded model built the ordinary way
(``torch.manual_seed(0); Decoder(config)``).
"""

import argparse
import resource
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardfn as sf


@dataclass
class Config:
    vocab: int = 8192
    dim: int = 2048
    heads: int = 16
    layers: int = 12
    seq: int = 32
    batch: int = 2


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.heads = c.heads
        self.norm1, self.norm2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)
        self.up = nn.Linear(c.dim, 4 * c.dim)
        self.down = nn.Linear(4 * c.dim, c.dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def resident_mb() -> tuple[float, float]:
    """(now, peak) resident memory of this process in MiB."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) / 1024
    return found["VmRSS"], found["VmHWM"]


def _reset_peak() -> float:
    """Start measuring the peak resident memory afresh (Linux: clear_refs 5); the resident memory now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return resident_mb()[0]


def data_mb() -> float:
    """This process's private writable memory (what RLIMIT_DATA counts), in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmData"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="small: compare with the unsharded model")
    parser.add_argument("--load", metavar="DIR", help="read the pieces from this safetensors checkpoint")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    mesh = sf.init()
    rank, world = mesh.get_rank(), mesh.size()
    config = Config(vocab=128, dim=32, heads=4, layers=2, seq=16) if args.check else Config()
    whole_mb = _params(config) * 4 / 2**20
    tokens = torch.randint(0, config.vocab, (config.batch, config.seq + 1), generator=torch.Generator().manual_seed(1))

    if not args.check:
        # the budget: this rank's data memory now, plus less than the whole model's weights alone
        budget_mb = 0.9 * whole_mb
        limit = int((data_mb() + budget_mb) * 2**20)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        try:
            whole = Decoder(config)
            for p in whole.parameters():
                p.grad = torch.empty_like(p)
            fits = True
            del whole
        except (MemoryError, RuntimeError) as e:  # torch's CPU allocator raises a RuntimeError
            if "allocate" not in str(e):
                raise
            fits = False
        if rank == 0:
            print(f"budget {budget_mb:.0f} MiB per rank; the whole model's weights ({whole_mb:.0f} MiB) and "
                  f"gradients {'FIT (budget too large?)' if fits else 'do not fit'}", flush=True)

    baseline = _reset_peak()  # what the process holds before the model: torch, the process group
    with torch.device("meta"):
        model = Decoder(config)
    example = torch.empty(config.batch, config.seq, dtype=torch.long, device="meta")
    model = sf.shard(model, in_strategy=(None,), level=1, example_inputs=(example,))
    if args.load:
        sf.materialize(model, init=None)
        sf.load(model, args.load)
    else:
        torch.manual_seed(0)
        sf.materialize(model)
    ready_peak = resident_mb()[1] - baseline
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(args.steps):
        loss = loss_of(model, tokens)
        loss.backward()
        if args.check and step == 0:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    _, peak = resident_mb()
    local_mb = sum(p.to_local().numel() for p in model.parameters()) * 4 / 2**20
    print(f"rank {rank}/{world}: meta_init losses {' '.join(f'{v:.4f}' for v in losses)}; holds {local_mb:.1f} of "
          f"{whole_mb:.1f} MiB of weights; peak resident above the {baseline:.0f} MiB held before: {ready_peak:.0f} MiB "
          f"to build, shard and initialise, {peak - baseline:.0f} MiB by the last step", flush=True)
    if args.check:
        torch.manual_seed(0)
        reference = Decoder(config)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        ref_losses = []
        for step in range(args.steps):
            loss = loss_of(reference, tokens)
            loss.backward()
            if step == 0:
                for n, p in reference.named_parameters():
                    torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(loss.item())
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
        print(f"rank {rank}/{world}: meta_init trains like the unsharded model built the ordinary way", flush=True)


def _params(c: Config) -> int:
    per_block = 2 * 2 * c.dim + (3 * c.dim * c.dim + 3 * c.dim) + (c.dim * c.dim + c.dim) \
        + (4 * c.dim * c.dim + 4 * c.dim) + (4 * c.dim * c.dim + c.dim)
    return c.vocab * c.dim + c.layers * per_block + 2 * c.dim + c.dim * c.vocab


if __name__ == "__main__":
    main()
