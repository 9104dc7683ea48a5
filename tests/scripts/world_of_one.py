"""A plain `python` run is a world of one whose calls run traced graphs (not a simulated world): a function that
reads a tensor from outside it (a mask: a constant of the graph, an input of the traced step) and a module train
as eager does. Prints "match" when outputs and gradients agree."""

import copy

import torch

import shardfn as sf
from tests.models import GPTBlock

torch.manual_seed(0)
mask = torch.ones(16, 16, dtype=torch.bool).tril()


def masked_scores(q, k):
    return (q @ k.transpose(-1, -2)).masked_fill(~mask, -1e4).softmax(-1)


f = sf.shard(masked_scores, in_strategy=(None, None))
q, k = torch.randn(2, 16, 8, requires_grad=True), torch.randn(2, 16, 8, requires_grad=True)
q2, k2 = (t.detach().clone().requires_grad_() for t in (q, k))
for _ in range(2):  # the first call traces, the second runs the traced graphs
    q.grad = k.grad = q2.grad = k2.grad = None
    out, ref = f(q, k), masked_scores(q2, k2)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(q.grad, q2.grad)
    torch.testing.assert_close(k.grad, k2.grad)
mask[0, 0] = False  # read at every call, not frozen at the trace
torch.testing.assert_close(f(q, k), masked_scores(q, k))

reference = GPTBlock(16, 4)
model = sf.shard(copy.deepcopy(reference), in_strategy=(None,))
x = torch.randn(2, 8, 16)
for _ in range(2):
    model(x).square().mean().backward()
    reference(x).square().mean().backward()
for (name, p), q_ in zip(model.named_parameters(), reference.parameters()):
    torch.testing.assert_close(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad, q_.grad,
                               msg=lambda m: f"{name}: {m}")
print("match", flush=True)
