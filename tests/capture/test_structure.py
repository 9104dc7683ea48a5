"""Values with tensors inside: fn's outputs come back in the structure fn built (containers, plain objects such
as transformers' ModelOutput and DynamicCache); argument objects fn changes get their new state."""

import dataclasses

import pytest
import torch

import shardfn as sf
from shardfn.capture.structure import split
from tests.parity import check_parity


class Cache:
    """Like transformers' DynamicCache: layers holding key/value tensors, and a reference back to the cache."""

    def __init__(self):
        self.layers, self.seen = [], 0

    def update(self, k, v):
        layer = Layer(k, v, self)
        self.layers.append(layer)
        self.seen += k.shape[-2]
        return layer


class Layer:
    def __init__(self, keys, values, cache):
        self.keys, self.values, self.cache = keys, values, cache


@dataclasses.dataclass
class Result:
    logits: torch.Tensor
    cache: Cache
    note: str = "done"


def decoder(x, w):
    cache = Cache()
    h = torch.tanh(x @ w)
    cache.update(h * 2, h + 1)
    cache.update(h.exp(), h)
    return Result(h.sum(-1), cache), "tag", 3


def test_objects_holding_tensors_come_back_rebuilt():
    with_grad = lambda: (torch.randn(8, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True))  # noqa
    check_parity(decoder, with_grad, ((4, 1), None))
    from shardfn.runtime import simulated_world
    import shardfn as sf

    with simulated_world(4):
        x, w = with_grad()
        result, tag, three = sf.shard(decoder, in_strategy=((4, 1), None))(x, w)
        ref, _, _ = decoder(x, w)
        assert (tag, three, result.note, result.cache.seen) == ("tag", 3, "done", 16)
        first, second = result.cache.layers
        assert first.cache is result.cache and second.cache is result.cache  # references kept, not copied twice
        torch.testing.assert_close(second.keys, ref.cache.layers[1].keys)


def test_the_template_rebuilds_fresh_objects_each_time():
    tensors, _, template = split(decoder(torch.randn(2, 3), torch.randn(3, 3)))
    assert len(tensors) == 5
    a, b = template.rebuild([torch.zeros(1)] * 5), template.rebuild([torch.ones(1)] * 5)
    assert a[0] is not b[0] and a[0].cache is not b[0].cache
    assert float(a[0].logits) == 0 and float(b[0].cache.layers[0].values) == 1


class Slotted:
    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


def test_an_object_whose_tensors_cannot_be_reached_is_refused():
    with pytest.raises(TypeError, match=r"output\[1\] is a Slotted holding tensors that shardfn cannot reach.*"
                                        r"register_pytree_node"):
        split((torch.zeros(1), Slotted(torch.zeros(2))), path="output")


def append_to(x, cache):
    """Like a transformers decoder layer: appends this call's keys to the cache it is given."""
    layer = cache.layers[0] if cache.layers else cache.update(x[:0], x[:0])
    layer.keys = torch.cat([layer.keys, x * 2])
    cache.seen += x.shape[0]
    return x + 1


def test_an_argument_object_fn_changes_gets_its_new_state_after_each_call():
    from shardfn.runtime import simulated_world
    import shardfn as sf

    with simulated_world(4):
        f = sf.shard(append_to, in_strategy=((4, 1), None))
        cache, ref_cache = Cache(), Cache()
        for step in range(3):
            x = torch.randn(8, 6)
            y = f(x, cache)
            ref = append_to(x, ref_cache)
            torch.testing.assert_close(y, ref)
            assert cache.seen == ref_cache.seen == 8 * (step + 1)
            assert len(cache.layers) == 1 and cache.layers[0].cache is cache
            torch.testing.assert_close(cache.layers[0].keys, ref_cache.layers[0].keys)
        # an empty cache, then caches of 8 and 16 rows: three signatures, no recapture for a repeated one
        assert len(sf.engine_of(f).programs) == 3
        f(torch.randn(8, 6), Cache())
        assert len(sf.engine_of(f).programs) == 3


def test_an_object_compared_by_identity_is_shown_by_name():
    # the signature holds it by identity (no reuse across two lambdas), its text by name (the same on every rank)
    from shardfn.call.arguments import call_key

    f, g = (lambda t: t), (lambda t: t)
    x = torch.zeros(2)
    assert call_key((x, f), {})[0] != call_key((x, g), {})[0]
    assert call_key((x, f), {})[0] == call_key((x, f), {})[0]
    assert "0x" not in repr(call_key((x, f), {})[0])


class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b


def test_a_class_registered_with_pytree_after_a_split_is_taken_apart_as_pytree_says():
    # split remembers per type whether pytree takes it for a leaf (an object walked by its attributes); a class
    # registered since is flattened by its registration, not walked as before
    from torch.utils import _pytree as torch_pytree

    first = split(Pair(torch.zeros(1), torch.ones(2)))[2]
    assert [type(o) for o in first.objects()] == [Pair]
    torch_pytree.register_pytree_node(Pair, lambda p: ([p.b, p.a], None), lambda c, _: Pair(c[1], c[0]))
    try:
        tensors, _, again = split(Pair(torch.zeros(1), torch.ones(2)))
        assert again.objects() == [] and [t.numel() for t in tensors] == [2, 1]  # pytree's order: b, then a
    finally:
        torch_pytree._deregister_pytree_node(Pair)
    assert [type(o) for o in split(Pair(torch.zeros(1), torch.ones(2)))[2].objects()] == [Pair]


def test_a_signature_is_hashed_once_and_compares_and_reads_as_its_structure():
    # a call looks its signature up in several tables: the structure's hash is computed once (pytree's specs hash
    # in Python); equal structures stay equal keys, other ones differ, and the text ranks compare is the structure's
    from shardfn.call.arguments import call_key

    cache = Cache()
    cache.update(torch.zeros(2, 3), torch.zeros(2, 3))
    key, _, objects = call_key((torch.zeros(4, 3),), {"cache": cache, "flag": True})
    again = call_key((torch.zeros(5, 3),), {"cache": cache, "flag": True})[0]
    other = call_key((torch.zeros(4, 3),), {"cache": cache, "flag": False})[0]
    assert objects[0] is cache
    assert key[0] == again[0] and hash(key[0]) == hash(again[0]) and key[1] != again[1]
    assert key[0] != other[0] and key != other
    assert repr(key[0]) == repr(key[0].value) and "flag" in repr(key[0])
