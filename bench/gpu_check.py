"""The GPU check: CUDA tests, then training parity and step times on this machine's GPU(s).

    python bench/gpu_check.py                  # on a machine with CUDA
    python bench/gpu_check.py --device cpu --small    # the same steps on the CPU, small (a smoke run)

1. runs tests/test_cuda.py (attention under every backend and dtype, a GPT block's training);
2. trains a GPT block (tests.models.GPTBlock, dim 1024, 16 heads, batch 8 x 1024) and a transformers Llama-style
   decoder, each in fp32 and under bf16 autocast, sharded in a world of one, against eager: asserts the losses
   agree, and prints the median step time of eager, torch.compile and shardfn (forward, backward, AdamW).
With several GPUs, run it under torchrun to train on all of them (every rank checks against its own eager copy).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import shardfn as sf  # noqa: E402
from tests.models import GPTBlock  # noqa: E402


def _llama(small: bool):
    import transformers as tf

    cfg = tf.LlamaConfig(hidden_size=128 if small else 1024, intermediate_size=256 if small else 2816,
                         num_hidden_layers=2 if small else 4, num_attention_heads=4 if small else 16,
                         num_key_value_heads=2 if small else 8, vocab_size=512 if small else 32000,
                         max_position_embeddings=2048, use_cache=False)
    return tf.LlamaForCausalLM(cfg)


def _models(small: bool, device: str):
    torch.manual_seed(0)
    dim, heads, batch, seq = (64, 4, 2, 32) if small else (1024, 16, 8, 1024)
    x = torch.randn(batch, seq, dim, device=device)
    yield "GPT block", GPTBlock(dim, heads).to(device), (x,), lambda out: out.float().square().mean()
    vocab = 512 if small else 32000
    ids = torch.randint(0, vocab, (2 if small else 4, 32 if small else 512), device=device)
    yield "Llama decoder", _llama(small).to(device), (ids,), lambda out: out.logits.float().logsumexp(-1).mean()


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _step_times(model, args, loss_of, autocast, device, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, losses = [], []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(model(*args))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    return statistics.median(times[2:]) * 1e3, losses


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="small models (a smoke run)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--no-tests", action="store_true")
    args = p.parse_args()
    device = args.device
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name()}, {torch.cuda.device_count()} GPU)" if device == "cuda" else ""))
    if not args.no_tests:
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_cuda.py"], cwd=ROOT,
                             capture_output=True, text=True)
        print("tests/test_cuda.py:", res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-2000:])
    sf.init(device=device)
    print(f"{'model':<15} {'precision':<9} {'eager ms':>9} {'compile ms':>11} {'shardfn ms':>11} "
          f"{'shardfn/eager':>14} {'shardfn/compile':>16}  loss agreement")
    for name, model, inputs, loss_of in _models(args.small, device):
        for autocast in (False, True):
            eager = copy.deepcopy(model)
            sharded = sf.shard(copy.deepcopy(model), in_strategy=(None,) * len(inputs), device=device)
            e_ms, e_losses = _step_times(eager, inputs, loss_of, autocast, device, args.steps)
            s_ms, s_losses = _step_times(sharded, inputs, loss_of, autocast, device, args.steps)
            try:
                compiled = torch.compile(copy.deepcopy(model))
                c_ms, _ = _step_times(compiled, inputs, loss_of, autocast, device, args.steps)
            except Exception as e:  # noqa: BLE001 - report it and go on
                c_ms = float("nan")
                print(f"  torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            diff = max(abs(a - b) for a, b in zip(e_losses, s_losses))
            tol = 5e-2 if autocast else 1e-4 * max(1.0, abs(e_losses[0]))
            verdict = "ok" if diff <= tol else "MISMATCH"
            print(f"{name:<15} {'bf16 amp' if autocast else 'fp32':<9} {e_ms:>9.2f} {c_ms:>11.2f} {s_ms:>11.2f} "
                  f"{s_ms / e_ms:>14.2f} {s_ms / c_ms:>16.2f}  {verdict} (max |diff| {diff:.1e})")


if __name__ == "__main__":
    main()
