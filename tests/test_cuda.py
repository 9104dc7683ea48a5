"""CUDA: forward and backward parity with eager for attention under every backend torch picks, in fp32, bf16,
fp16 and autocast, causal and masked, and a training step of a GPT block. Skipped without CUDA (python
bench/gpu_check.py runs these on a GPU machine); a world of one on the GPU."""

import copy

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from tests.models import GPTBlock

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _world_of_one():
    """These tests run in the real world of one that shard() forms on the GPU (NCCL); each ends it, as a script's
    exit would, so the next test (and conftest's check that none is left behind) starts clean."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()

TOLERANCE = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}


def _backends():
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def attention(q, k, v, mask=None, causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["causal", "masked", "plain"])
def test_attention_parity(backend, dtype, kind):
    from torch.nn.attention import sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 128, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    mask = None
    if kind == "masked":
        mask = torch.ones(128, 128, device="cuda", dtype=torch.bool).tril().expand(2, 1, 128, 128)
    ref_args = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    f = sf.shard(lambda q, k, v: attention(q, k, v, mask, kind == "causal"), in_strategy=(None, None, None))
    rtol, atol = TOLERANCE[dtype]
    try:
        with sdpa_kernel(_backends()[backend]):
            ref = attention(*ref_args, mask, kind == "causal")
    except RuntimeError as e:
        pytest.skip(f"eager has no {backend} kernel for this case: {e}")
    with sdpa_kernel(_backends()[backend]):
        out = f(q, k, v)
        out.float().square().sum().backward()
        ref.float().square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    for a, b in zip((q, k, v), ref_args):
        torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("autocast", [False, True])
def test_gpt_block_trains_like_eager(autocast):
    torch.manual_seed(0)
    reference = GPTBlock(dim=256, heads=8).cuda()
    model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), device="cuda")
    x = torch.randn(4, 128, 256, device="cuda")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss, ref_loss = model(x).float().square().mean(), reference(x).float().square().mean()
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-2 if autocast else 1e-4, atol=1e-4)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()


def test_static_cache_decoding_is_replayed_as_a_cuda_graph(monkeypatch):
    """generate() with a StaticCache: the decoding program's Inductor code captured once as a CUDA graph and
    replayed for every later token (exec.replay), the same tokens as the unsharded model's."""
    import transformers as tf

    from shardfn.exec import replay

    graphs, capture = [], replay._cuda_capture  # (the original: the patched name would call itself)

    def counting(fn, inputs):
        graphs.append(capture(fn, inputs))
        return graphs[-1]

    monkeypatch.setattr(replay, "_cuda_capture", counting)
    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    reference = tf.LlamaForCausalLM(config).cuda().eval()
    model = sf.shard(copy.deepcopy(reference), in_strategy={}, device="cuda")
    ids = torch.randint(0, 256, (2, 8), device="cuda")
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids),
                  cache_implementation="static")
    with torch.no_grad():
        want, got = reference.generate(ids, **kwargs), model.generate(ids, **kwargs)
    assert torch.equal(got, want)
    notes = [n for c in sf.engine_of(model).programs.values() for n in c.program.notes]
    # (a second where a token's input came back at the first one's address); the replayer's notes say why not
    assert 1 <= len(graphs) <= 2, f"{len(graphs)} captures in {sf.engine_of(model).captures} programs: {notes}"
