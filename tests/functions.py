"""Custom torch.autograd.Functions as users write them, for the tests: each backward differs from the derivative
of its forward's ops where it can (a straight-through estimator, a gradient reversal, a halved gradient), so a
sharded run that lost the Function's own backward gives other gradients than eager."""

import torch
import torch.nn as nn


class StraightThroughRound(torch.autograd.Function):
    """Rounds to quarters; the gradient passes straight through (doubled, to be unmistakable). New style, so
    torch.func.vmap may run it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.round(x * 4) / 4

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class GradientReversal(torch.autograd.Function):
    """Identity forward (a view), negated and scaled gradient (domain-adversarial training). Old style."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class MaskedScale(torch.autograd.Function):
    """``(x * mask * scale, x.sign())`` with a bool mask input and a saved tensor; the gradient is halved. Old style,
    two outputs, non-tensor and non-differentiable arguments."""

    @staticmethod
    def forward(ctx, x, mask, scale):
        ctx.save_for_backward(mask)
        ctx.scale = scale
        sign = x.sign()
        ctx.mark_non_differentiable(sign)
        return x * mask * scale, sign

    @staticmethod
    def backward(ctx, grad, _grad_sign):
        (mask,) = ctx.saved_tensors
        return grad * mask * (ctx.scale / 2), None, None


class RowSoftmax(torch.autograd.Function):
    """Softmax over the last dim with its own (exact) backward: not elementwise, so it runs on whole rows."""

    @staticmethod
    def forward(ctx, x):
        y = torch.softmax(x, dim=-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return y * (grad - (grad * y).sum(-1, keepdim=True))


class BloomGelu(torch.autograd.Function):
    """transformers' Bloom GeLU (a tanh approximation with a hand-written backward), as Bloom calls it in training."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
        return ff * grad


class CustomMLP(nn.Module):
    """Dense - BloomGelu - Dense, the activation a Function (as in Bloom's MLP)."""

    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(BloomGelu.apply(self.up(x)))


class Scale(torch.autograd.Function):
    """``x * s``, ``s`` a 0-dim tensor; elementwise both ways (autograd sums ``s``'s gradient to its shape)."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, grad):
        x, s = ctx.saved_tensors
        return grad * s, grad * x


class LearnedTemperature(nn.Module):
    """Dense, then a learnable scalar applied by a Function (a temperature): a whole parameter read by an op run
    on batch pieces, whose gradient is the sum of every rank's part."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.dense, self.temperature = nn.Linear(dim, dim), nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return Scale.apply(self.dense(x), self.temperature)


class TimesCount(torch.autograd.Function):
    """``x * count`` for a 0-dim integer tensor ``count``; the gradient tripled."""

    @staticmethod
    def forward(ctx, x, count):
        ctx.save_for_backward(count)
        return x * count

    @staticmethod
    def backward(ctx, grad):
        (count,) = ctx.saved_tensors
        return grad * count * 3, None


# misuses: refused at capture with an error that names the fix


class AddOneInPlace(torch.autograd.Function):
    """Writes into its input (ctx.mark_dirty)."""

    @staticmethod
    def forward(ctx, a):
        ctx.mark_dirty(a)
        return a.add_(1)

    @staticmethod
    def backward(ctx, g):
        return g


class ThroughNumpy(torch.autograd.Function):
    """A forward fake tensors cannot run (it reads the values through NumPy)."""

    @staticmethod
    def forward(ctx, a):
        return torch.from_numpy(a.numpy() + 1)

    @staticmethod
    def backward(ctx, g):
        return g
