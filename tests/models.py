"""Small models for the tests: a GPT-style block (and a checkpointed stack of them), residual MLP blocks normed
after their sums, MindSpore's BasicBlock net, a batch-normed MLP, tied weights."""

import torch
import torch.nn as nn
import torch.utils.checkpoint
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        # k has no bias: its gradient is zero in exact arithmetic, and AdamW would amplify rounding noise
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        split = lambda y: y.view(b, t, self.heads, c // self.heads).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class GPTBlock(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 4, dropout: float = 0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.dropout(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPTStack(nn.Module):
    """``layers`` GPT blocks in a row (the benchmarks' transformer)."""

    def __init__(self, layers: int, dim: int, heads: int):
        super().__init__()
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class ResidualNormedMLP(nn.Module):
    """A residual MLP block normed after its sum: a Megatron plan reduces its row-parallel product before the
    sum, and the norm reads that sum in backward."""

    def __init__(self, dim: int = 256):
        super().__init__()
        self.fc, self.out, self.norm = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(x + self.out(F.gelu(self.fc(x))))


class ResidualMLPStack(nn.Module):
    """Three :class:`ResidualNormedMLP` blocks in a row."""

    def __init__(self, dim: int = 256):
        super().__init__()
        self.layers = nn.ModuleList(ResidualNormedMLP(dim) for _ in range(3))

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x


def megatron_mlp_plan(n: int) -> dict:
    """ResidualMLPStack's parameter_plan for ``n`` ranks: each fc column-parallel, each out row-parallel."""
    return {f"layers.{i}.{k}": v for i in range(3)
            for k, v in {"fc.weight": (n, 1), "fc.bias": (n,), "out.weight": (1, n)}.items()}


class CheckpointedStack(nn.Module):
    """Two GPT blocks, each under torch.utils.checkpoint (activation checkpointing) when ``checkpointed``."""

    def __init__(self, checkpointed: bool, dim: int = 16, heads: int = 4):
        super().__init__()
        self.blocks, self.checkpointed = nn.ModuleList(GPTBlock(dim, heads) for _ in range(2)), checkpointed

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x


class BasicBlock(nn.Module):
    """MindSpore's shard example cell: Dense - GELU - Dense."""

    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.dense1 = nn.Linear(dim, hidden)
        self.gelu = nn.GELU()
        self.dense2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.dense2(self.gelu(self.dense1(x)))


class Net(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.block1, self.block2, self.block3 = BasicBlock(dim), BasicBlock(dim), BasicBlock(dim)

    def forward(self, x):
        return self.block3(self.block2(self.block1(x)))


class NormedMLP(nn.Module):
    """Linear - BatchNorm1d - ReLU - Linear: a module whose forward updates buffers (running statistics)."""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        # fc1 has no bias: batch norm removes it, so its gradient is zero up to rounding (which AdamW amplifies)
        self.fc1, self.bn = nn.Linear(dim, hidden, bias=False), nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


class TiedLM(nn.Module):
    """Embedding - Linear - tanh - output head sharing the embedding's weight (tied weights)."""

    def __init__(self, vocab: int = 16, dim: int = 8):
        super().__init__()
        self.emb, self.lin = nn.Embedding(vocab, dim), nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.lin(self.emb(ids))))
