"""MindSpore's functional shard example: relu(x @ weight + bias) with x split (4, 2).

    torchrun --nproc-per-node 8 samples/dense_relu.py
    mpirun -n 8 python samples/dense_relu.py
    python samples/dense_relu.py            # a world of one

Every rank checks the sharded result and gradients against single-process eager and prints the verdict.
"""

import torch

import shardfn as sf


def dense_relu(x, weight, bias):
    return torch.relu(x @ weight + bias)


def main():
    mesh = sf.init()
    world = mesh.size()
    torch.manual_seed(0)  # the same inputs on every rank (full_batch)
    x = torch.randn(32, 64)
    weight = torch.randn(64, 48, requires_grad=True)
    bias = torch.randn(48, requires_grad=True)

    # (4, 2) needs 8 ranks; on smaller worlds split what divides.
    split = (4, 2) if world % 8 == 0 else (world, 1)
    sharded = sf.shard(dense_relu, in_strategy=(split, None, None))
    y = sharded(x, weight, bias)
    y.square().mean().backward()

    ref_w, ref_b = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    ref = dense_relu(x, ref_w, ref_b)
    ref.square().mean().backward()

    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, ref_w.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias.grad, ref_b.grad, rtol=1e-5, atol=1e-5)
    if torch.distributed.get_rank() == 0:
        print(sf.explain(sharded, x, weight, bias))
    diff = float((y - ref).detach().abs().max())
    print(f"rank {torch.distributed.get_rank()}/{world}: dense_relu in_strategy=({split}, None, None) "
          f"matches eager (output {tuple(y.shape)}, max |diff| {diff:.2e})", flush=True)


if __name__ == "__main__":
    main()
