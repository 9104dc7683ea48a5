"""A Llama-3-8B-shaped decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU), for planning benchmarks."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Config:
    def __init__(self, layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256):
        self.layers, self.hidden, self.ffn = layers, hidden, ffn
        self.heads, self.kv_heads, self.vocab = heads, kv_heads, vocab


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.heads, self.kv_heads, self.dim = c.heads, c.kv_heads, c.hidden // c.heads
        self.q = nn.Linear(c.hidden, c.heads * self.dim, bias=False)
        self.k = nn.Linear(c.hidden, c.kv_heads * self.dim, bias=False)
        self.v = nn.Linear(c.hidden, c.kv_heads * self.dim, bias=False)
        self.o = nn.Linear(c.heads * self.dim, c.hidden, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        repeat = self.heads // self.kv_heads
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(c.hidden), nn.RMSNorm(c.hidden)
        self.attn = Attention(c)
        self.gate = nn.Linear(c.hidden, c.ffn, bias=False)
        self.up = nn.Linear(c.hidden, c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        dim = self.c.hidden // self.c.heads
        freqs = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, device=tokens.device).float() / dim))
        angles = torch.outer(torch.arange(t, device=tokens.device).float(), freqs)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))
