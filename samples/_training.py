"""What the training samples share: a few AdamW steps, and the check against the single-process copy."""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


def train(model, x, target, steps=5):
    """``steps`` AdamW steps on an MSE loss; the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def check_like_reference(model, reference, losses, ref_losses, what):
    """Assert the sharded model trained like its single-process copy; the largest parameter difference."""
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    max_diff = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        p = p.full_tensor() if isinstance(p, DTensor) else p
        # AdamW divides each gradient by its own magnitude: where a gradient is near zero, summing it in another
        # order (a sharded reduction) moves that element by up to lr per step, so parameters get a looser bound
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what} {name}: {m}")
        max_diff = max(max_diff, float((p - q).detach().abs().max()))
    return max_diff
