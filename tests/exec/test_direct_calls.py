"""direct_calls: a graph whose ops are called through torch's bindings computes what the graph itself does."""

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn.exec.direct_calls import direct_calls
from shardfn.strategy_search.registry import REGISTRY

# table ops a CPU trace of the function below does not reach: attention kernels of CUDA (tests/test_cuda.py runs
# them), factories whose values are undefined (empty, new_empty), and detach (which later releases' make_fx drops)
_NOT_REACHED = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention", "empty", "new_empty", "detach"}


def _many_ops(x, w, b, ids, table, q, k, v):
    h = F.linear(x, w, b)  # t, addmm
    h = F.layer_norm(h, (h.shape[-1],)) + F.gelu(h) + F.silu(h) * torch.sigmoid(h) - torch.tanh(h).relu()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) / (h.abs() + 1).sqrt()
    h = torch.where(h > 0, h.exp(), (h.abs() + 1).log()) + torch.erf(h) + 1 / (h.abs() + 1)
    h = torch.maximum(h, torch.minimum(h.sin(), h.cos())).clamp(-3, 3) + (1 - h) - h.neg()
    m = ((h >= 0) & (h < 1)) | (h == 2) | (h != 3)
    h = h + (~m).float() + torch.logical_not(m).float() + (h <= 0).float()
    s = F.softmax(h, -1) + F.log_softmax(h, -1) + h.amax(-1, keepdim=True) + h.sum(0)
    s = torch.cat([s, s.clone()], 0) + torch.stack([s, s]).sum(0).repeat(2, 1)
    e = F.embedding(ids, table)  # (4, 8) -> (4, 8, 16)
    e = torch.bmm(e, e.transpose(1, 2)).unsqueeze(1).squeeze(1).permute(0, 2, 1)
    e = torch.baddbmm(e, e, e).select(0, 1).view(8, 8).expand(2, 8, 8).detach() + e[0]
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    f = torch.arange(8.0) + torch.full((8,), 2.0) + torch.zeros(8) + torch.ones(8) + x.new_ones(8)
    f = f + x.new_zeros(8) + x.new_full((8,), 3.0) + torch.scalar_tensor(1.5)
    return s.sum() + e.sum() * 1e-3 + a.sum() + (f * torch.mm(x, w.t()).sum()).sum()


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True),
            torch.randn(8, requires_grad=True), torch.randint(0, 10, (4, 8)), torch.randn(10, 16, requires_grad=True),
            *(torch.randn(2, 2, 8, 4, requires_grad=True) for _ in range(3))]


def _run(gm, inputs):
    inputs = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
    out = gm(*inputs)
    out.backward()
    return out, [t.grad for t in inputs if t.requires_grad]


def test_ops_called_through_their_bindings_give_the_graphs_own_results_and_gradients():
    gm = make_fx(_many_ops)(*_inputs())
    direct = direct_calls(gm)
    called = {n.target if n.op == "call_method" else n.target.__name__ for n in direct.graph.nodes
              if n.op in ("call_method", "call_function") and not isinstance(n.target, torch._ops.OpOverload)}
    table = set(REGISTRY.bindings())
    assert table - called <= _NOT_REACHED, f"table ops not exercised: {table - called - _NOT_REACHED}"
    out, grads = _run(gm, _inputs())
    out_direct, grads_direct = _run(direct, _inputs())
    assert torch.equal(out, out_direct)
    for g, h in zip(grads, grads_direct):
        assert torch.equal(g, h)


def test_ops_outside_the_table_keep_their_overload_and_the_graph_itself_is_untouched():
    def f(x):
        return x[:, 1:].reshape(-1) @ torch.ones(6)  # slice.Tensor: no binding takes its arguments

    gm = make_fx(f)(torch.randn(2, 4))
    before = gm.code
    direct = direct_calls(gm)
    assert gm.code == before  # plans, explain and traces read the graph itself
    kept = [n.target for n in direct.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    assert torch.ops.aten.slice.Tensor in kept
    x = torch.randn(2, 4)
    assert torch.equal(direct(x), gm(x))
