"""The GPU check: training steps at sizes people train, the plan's memory against CUDA's count, generate().

    python bench/gpu_check.py                  # on a machine with CUDA (a world of one on NCCL)
    python bench/gpu_check.py --device cpu --small    # the same steps on the CPU, small (a smoke run)

Parts (``--parts``, in this order; each prints a table, ``--out DIR`` keeps the profiles' full tables):

``tests``    tests/test_cuda.py (attention under every backend and dtype, a GPT block's training).
``train``    a GPT block (tests.models.GPTBlock, dim 2048, 16 heads, batch 8 x 2048) and transformers'
             LlamaForCausalLM with 4 layers at the Llama-3.2-1B config (batch 4 x 2048), forward + backward +
             AdamW (foreach), median step of eager, torch.compile and shardfn (level 2), under bf16 autocast; and
             shardfn with a bf16 ``MixedPrecisionPolicy`` (parameters fp32, used in bf16, gradients reduced in
             fp32) against the same autocast baselines. Losses asserted against eager. Where shardfn is over 1.05x
             torch.compile, both are profiled: each step split into forward, backward and optimizer (synchronized
             between), and torch.profiler's GPU time and kernel count per step, its top kernels.
``memory``   the plan's ``cost.peak_bytes`` against ``torch.cuda.max_memory_allocated()`` over a forward and
             backward (optimizer states alive, gradients made from none; the loss sharded with the model), at
             levels 1 and 2 with the attention kernel CUDA picks (flash) and at level 2 with the memory-efficient
             kernel; eager's peak beside it; and the peak of the tensors ops make over the same (bench/_tensor_peak:
             what the kernels allocate for themselves left out), which tells the plan's count of tensors from
             what the GPU adds. On the CPU (``--device cpu``) the tensors' peak is the one measured.
``generate`` bench/generate.py on the GPU (Llama 4 layers, dim 2048): per token, StaticCache and DynamicCache,
             against the unsharded model (transformers compiles it for a static cache); with and without the
             decoding step replayed as a CUDA graph (SHARDFN_CUDA_GRAPHS).

``--budget S`` skips the parts that would start after S seconds (a lent GPU's time is short).
"""

from __future__ import annotations

import argparse
import contextlib
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

BF16 = torch.bfloat16
_T0 = time.perf_counter()


def _elapsed() -> float:
    return time.perf_counter() - _T0


def _llama(small: bool):
    import transformers as tf

    if small:
        cfg = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, use_cache=False)
    else:  # Llama-3.2-1B, 4 of its 16 layers
        cfg = tf.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                             tie_word_embeddings=True, max_position_embeddings=8192, use_cache=False)
    return tf.LlamaForCausalLM(cfg)


def _models(small: bool, device: str):
    torch.manual_seed(0)
    dim, heads, batch, seq = (64, 4, 2, 32) if small else (2048, 16, 8, 2048)
    x = torch.randn(batch, seq, dim, device=device)
    yield "GPT block", lambda: GPTBlock(dim, heads).to(device), (x,), lambda out: out.float().square().mean()
    vocab = 512 if small else 128256
    ids = torch.randint(0, vocab, (2, 32) if small else (4, 2048), device=device)
    yield "Llama 3.2 1B x4", lambda: _llama(small).to(device), (ids,), lambda out: out.logits.float().logsumexp(-1).mean()


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _step(model, args, loss_of, opt, autocast, device):
    with torch.autocast(device, dtype=BF16, enabled=autocast):
        loss = loss_of(model(*args))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def _step_times(model, args, loss_of, autocast, device, steps):
    opt = _optimizer(model)
    times, losses = [], []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        loss = _step(model, args, loss_of, opt, autocast, device)
        _sync(device)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    return statistics.median(times[2:]) * 1e3, losses, opt


def _regions(model, args, loss_of, opt, autocast, device, steps=5) -> str:
    """Median forward / backward / optimizer milliseconds, synchronized between them."""
    parts = {"forward": [], "backward": [], "optimizer": []}
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=BF16, enabled=autocast):
            loss = loss_of(model(*args))
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        t3 = time.perf_counter()
        for v, took in zip(parts.values(), (t1 - t0, t2 - t1, t3 - t2)):
            v.append(took)
    return " ".join(f"{k} {statistics.median(v[1:]) * 1e3:.2f}" for k, v in parts.items())


def _profile(model, args, loss_of, opt, autocast, device, label, out_dir, steps=3) -> str:
    """GPU time and kernels per step (torch.profiler), the top kernels in ``out_dir``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            _step(model, args, loss_of, opt, autocast, device)
        _sync(device)
    events = prof.key_averages()
    kernels = [e for e in events if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    launches = sum(e.count for e in kernels) / steps
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:6]
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"profile_{label}.txt"), "w") as f:
            f.write(events.table(sort_by="self_device_time_total" if device == "cuda" else "self_cpu_time_total",
                                 row_limit=60))
    tops = "; ".join(f"{e.key[:48]} x{e.count // steps} {e.self_device_time_total / 1e3 / steps:.2f}" for e in top)
    return f"GPU {gpu_ms:.2f} ms/step in {launches:.0f} kernels; top: {tops}"


def part_tests():
    # (a failure's reason, not the warnings: the output's tail is what comes back from a lent GPU)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "--tb=short", "-rf",
                          "tests/test_cuda.py"], cwd=ROOT, capture_output=True, text=True)
    lines = res.stdout.strip().splitlines()
    print("tests/test_cuda.py:", "\n".join(lines[-1:] if res.returncode == 0 else lines[-60:]) or res.stderr[-2000:])


def part_train(args):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    device = args.device
    print(f"{'model':<16} {'precision':<13} {'eager ms':>9} {'compile ms':>11} {'shardfn ms':>11} "
          f"{'/eager':>7} {'/compile':>9}  loss agreement  (at {_elapsed():.0f} s)")
    for name, make, inputs, loss_of in _models(args.small, device):
        model = make()
        e_ms, e_losses, _ = _step_times(copy.deepcopy(model), inputs, loss_of, True, device, args.steps)
        compiled = torch.compile(copy.deepcopy(model))
        c_ms, _, c_opt = _step_times(compiled, inputs, loss_of, True, device, args.steps)
        for precision in ("bf16 autocast", "bf16 mp_policy"):
            policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32) \
                if precision == "bf16 mp_policy" else None
            sharded = sf.shard(copy.deepcopy(model), in_strategy=(None,) * len(inputs), device=device, level=2,
                               mp_policy=policy)
            autocast = policy is None
            s_ms, s_losses, s_opt = _step_times(sharded, inputs, loss_of, autocast, device, args.steps)
            diff = max(abs(a - b) for a, b in zip(e_losses, s_losses))
            verdict = "ok" if diff <= 5e-2 * max(1.0, abs(e_losses[0])) else "MISMATCH"
            print(f"{name:<16} {precision:<13} {e_ms:>9.2f} {c_ms:>11.2f} {s_ms:>11.2f} {s_ms / e_ms:>7.2f} "
                  f"{s_ms / c_ms:>9.2f}  {verdict} (max |diff| {diff:.1e})  (at {_elapsed():.0f} s)", flush=True)
            if s_ms / c_ms > 1.05 or args.profile:
                label = f"{name.split()[0]}_{precision.split()[1]}"
                print(f"  shardfn: {_regions(sharded, inputs, loss_of, s_opt, autocast, device)}")
                print(f"  compile: {_regions(compiled, inputs, loss_of, c_opt, True, device)}")
                print(f"  shardfn: {_profile(sharded, inputs, loss_of, s_opt, autocast, device, 'shardfn_' + label, args.out)}")
                print(f"  compile: {_profile(compiled, inputs, loss_of, c_opt, True, device, 'compile_' + label, args.out)}")
            del sharded, s_opt
        del compiled, c_opt, model
        _empty(device)


def _empty(device):
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _peak_of_step(model, inputs, loss_of, device) -> tuple[int, int]:
    """max_memory_allocated over a forward and backward, optimizer states alive, gradients made from none; and
    the peak of tensor bytes over the same (bench/_tensor_peak.py: the storages ops make, which leaves out what
    a kernel allocates for itself, cuBLAS's and attention's workspaces, and Inductor's own buffers)."""
    from bench._tensor_peak import TensorPeak

    opt = _optimizer(model)
    for _ in range(2):
        _step(model, inputs, loss_of, opt, True, device)
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    with TensorPeak([*model.parameters(), *model.buffers(), *states, *inputs], dtensors=True) as tracker:
        with torch.autocast(device, dtype=BF16):
            loss = loss_of(model(*inputs))
        loss.backward()
        _sync(device)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else tracker.peak
    opt.zero_grad(set_to_none=True)
    return peak, tracker.peak


class _WithLoss(torch.nn.Module):
    """The model and its loss as one module, so that the plan covers the loss's memory too (the fp32 upcast of
    the Llama's logits: 3.9 GiB, and as much for its gradient)."""

    def __init__(self, model, loss_of):
        super().__init__()
        self.model, self.loss_of = model, loss_of

    def forward(self, *inputs):
        return self.loss_of(self.model(*inputs))


def part_memory(args):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = args.device
    print(f"{'model':<16} {'level':>5} {'attention':<10} {'plan peak GiB':>14} {'measured GiB':>13} "
          f"{'plan/measured':>14} {'tensors GiB':>12} {'plan/tensors':>13} {'eager GiB':>10}")
    for name, make, inputs, loss_of in _models(args.small, device):
        model, loss_of = _WithLoss(make(), loss_of), lambda loss: loss
        eager_peak, _ = _peak_of_step(copy.deepcopy(model), inputs, loss_of, device)
        _empty(device)
        for level, backend in ((2, None), (1, None), (2, SDPBackend.FLASH_ATTENTION),
                               (2, SDPBackend.EFFICIENT_ATTENTION)):
            kernel = "CUDA's" if backend is None else backend.name.split("_")[0].lower()
            try:
                with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                    sharded = sf.shard(copy.deepcopy(model), in_strategy=(None,) * len(inputs), device=device,
                                       level=level)
                    peak, tensors = _peak_of_step(sharded, inputs, loss_of, device)
                    with torch.autocast(device, dtype=BF16):
                        plan = sf.explain(sharded, *inputs)
            except RuntimeError as e:  # flash attention takes no explicit mask (transformers' GQA passes one)
                print(f"{name:<16} {level:>5} {kernel:<10} {str(e).splitlines()[0][:80]}")
                continue
            est = plan.cost.peak_bytes
            print(f"{name:<16} {level:>5} {kernel:<10} {est / 2**30:>14.2f} {peak / 2**30:>13.2f} "
                  f"{est / peak:>14.2f} {tensors / 2**30:>12.2f} {est / tensors:>13.2f} {eager_peak / 2**30:>10.2f}"
                  f"  (at {_elapsed():.0f} s)", flush=True)
            del sharded
            _empty(device)
        del model
        _empty(device)


def part_generate(args):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "generate.py"), "--device", args.device]
    cmd += ["--layers", "2", "--dim", "64", "--tokens", "8"] if args.small else \
        ["--layers", "4", "--dim", "2048", "--tokens", "32", "--prompt", "16"]
    cmd += ["--rounds", "3"]  # (about 110 s a run on the H200, transformers' compile of the unsharded model in it)
    for graphs in ("1", "0") if args.device == "cuda" else ("0",):  # the decoding step replayed as a CUDA graph
        print(f"SHARDFN_CUDA_GRAPHS={graphs}", flush=True)
        env = dict(os.environ, SHARDFN_CUDA_GRAPHS=graphs)
        try:
            res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=args.part_s)
            print(res.stdout.strip() if res.returncode == 0 else res.stdout[-2000:] + res.stderr[-4000:], flush=True)
        except subprocess.TimeoutExpired as e:  # what it printed as it went (each way's row, the replayer's notes)
            print(f"(stopped after {args.part_s:.0f} s)", (e.stdout or b"").decode()[-3000:], flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="small models (a smoke run)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--parts", default="train,memory,generate", help="of tests,train,memory,generate")
    p.add_argument("--profile", action="store_true", help="profile every training row")
    p.add_argument("--budget", type=float, default=float("inf"), help="start no part after these seconds")
    p.add_argument("--part-s", type=float, default=150, help="generate: stop each run after these seconds")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for the profiles' tables")
    args = p.parse_args()
    device = args.device
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name()}, {torch.cuda.device_count()} GPU)" if device == "cuda" else ""))
    sf.init(device=device)
    parts = {"tests": part_tests, "train": lambda: part_train(args), "memory": lambda: part_memory(args),
             "generate": lambda: part_generate(args)}
    for part in args.parts.split(","):
        if _elapsed() > args.budget:
            print(f"{part}: skipped (at {_elapsed():.0f} s, over --budget)")
            continue
        print(f"== {part} (at {_elapsed():.0f} s)", flush=True)
        parts[part]()


if __name__ == "__main__":
    main()
