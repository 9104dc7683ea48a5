"""The bad-input matrix: every misuse is a clear error of the documented type, naming the argument and the fix,
raised on every rank alike, and the world stays usable after it (4 real gloo ranks)."""

import time

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from tests.functions import AddOneInPlace, ThroughNumpy
from tests.models import BasicBlock, TiedLM


def dense_relu(x, w, b):
    return torch.relu(x @ w + b)


def _xwb(rows=8, cols=16):
    return torch.randn(rows, cols), torch.randn(cols, 12), torch.randn(12)


def _call(in_strategy, *args, **shard_kwargs):
    return lambda: sf.shard(dense_relu, in_strategy=in_strategy, **shard_kwargs)(*(args or _xwb()))


L = sf.Layout((2, 2), ("dp", "mp"))


def _module(**kw):
    return lambda: sf.shard(BasicBlock(), in_strategy=((4, 1),), **kw)(torch.randn(8, 32))


class _Cache:
    def __init__(self, keys):
        self.keys = keys


def _cache_layout_of_other_dims():
    f = sf.shard(lambda x, cache: x + cache.keys.sum(1), in_strategy={"cache": (4, 1)},
                 dataset_strategy="data_parallel")
    f(torch.randn(2, 8), _Cache(torch.randn(2, 3, 8)))


def _nested():
    inner = sf.shard(lambda x: x + 1, in_strategy=((4, 1),))
    sf.shard(lambda x: inner(x) * 2, in_strategy=((4, 1),))(torch.randn(8, 4))


def _vmap_around():
    f = sf.shard(lambda x: x * 2, in_strategy=((4, 1),))
    torch.func.vmap(f)(torch.randn(3, 8, 4))


def _shard_twice():
    f = sf.shard(dense_relu, in_strategy=((4, 1), None, None))
    sf.shard(f, in_strategy=((4, 1), None, None))


def _data_dependent():
    def branchy(x):
        if x.sum() > 0:
            return x
        return -x

    sf.shard(branchy, in_strategy=((4, 1),))(torch.randn(8, 4))


def _closure_requiring_grad():
    w = torch.randn(4, 4, requires_grad=True)
    sf.shard(lambda x: x @ w, in_strategy=((4, 1),))(torch.randn(8, 4))


class _Slotted:
    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


def _check_setting():
    import os

    os.environ["SHARDFN_CHECK"] = "sometimes"
    try:
        f = sf.shard(lambda x: x * 2, in_strategy=((4, 1),))
        f(torch.randn(8, 4))
        f(torch.randn(8, 4))
    finally:
        del os.environ["SHARDFN_CHECK"]


def _tied_two_strategies():
    sf.shard(TiedLM(), in_strategy=(None,), parameter_plan={"emb.weight": (4, 1), "head.weight": (1, 4)})


# name: (call, exception type, words the message must hold: the argument, and the fix)
BAD = {
    # in_strategy: the tuple form
    "in_strategy missing": (lambda: sf.shard(dense_relu, in_strategy=None), TypeError,
                            ["in_strategy is required", "one entry per positional input"]),
    "in_strategy a string": (lambda: sf.shard(dense_relu, in_strategy="dp"), TypeError,
                             ["in_strategy must be a tuple", "or a dict"]),
    "in_strategy an int": (lambda: sf.shard(dense_relu, in_strategy=4), TypeError, ["in_strategy must be a tuple"]),
    "in_strategy too short": (_call(((4, 1), None)), ValueError, ["in_strategy has 2 entries", "3 positional",
                                                                  "give one entry per positional input"]),
    "in_strategy too long": (_call(((4, 1), None, None, None)), ValueError, ["in_strategy has 4 entries"]),
    "entry of strings": (_call((("a", 1), None, None)), TypeError, ["in_strategy[0]", "tuple of ints"]),
    "entry of floats": (_call(((4.0, 1), None, None)), TypeError, ["in_strategy[0]", "tuple of ints"]),
    "entry of bools": (_call(((True, 1), None, None)), TypeError, ["in_strategy[0]", "tuple of ints"]),
    "entry a set": (_call(({4, 1}, None, None)), TypeError, ["in_strategy[0]", "tuple of ints"]),
    "entry too many dims": (_call(((4, 1, 1), None, None)), ValueError, ["in_strategy[0]", "3 entries but the tensor "
                                                                         "has 2 dims", "one split count per dim"]),
    "entry too few dims": (_call(((4,), None, None)), ValueError, ["in_strategy[0]", "1 entries but the tensor has "
                                                                   "2 dims"]),
    "split not dividing the world": (_call(((3, 1), None, None)), ValueError,
                                     ["in_strategy[0]", "does not divide the world size 4", "whose product divides"]),
    "split over more than the world": (_call(((8, 1), None, None), *_xwb(16)), ValueError,
                                       ["in_strategy[0]", "splits over 8 devices"]),
    "zero split": (_call(((0, 1), None, None)), ValueError, ["in_strategy[0]", "must be >= 1"]),
    "negative split": (_call(((-4, 1), None, None)), ValueError, ["in_strategy[0]", "must be >= 1"]),
    "strategy for an int argument": (lambda: sf.shard(lambda x, k: x * k, in_strategy=((4, 1), (4,)))(
        torch.randn(8, 2), 3), ValueError, ["in_strategy[1] is (4,)", "not a tensor; use None"]),
    "strategy for None": (lambda: sf.shard(lambda x, k: x, in_strategy=((4, 1), (4,)))(torch.randn(8, 2), None),
                          ValueError, ["in_strategy[1]", "not a tensor; use None"]),
    # in_strategy: containers and names
    "container entry too short": (lambda: sf.shard(lambda x, p: x * p[0] + p[1], in_strategy=((4, 1), ((4, 1),)))(
        torch.randn(8, 2), (torch.randn(8, 2), torch.randn(8, 2))), ValueError,
        ["in_strategy[1] has 1 entries but input 1 holds 2 items", "one entry per item"]),
    "strategy for a tuple argument": (lambda: sf.shard(lambda x, p: x * p[0], in_strategy=((4, 1), (4, 1)))(
        torch.randn(8, 2), (torch.randn(8, 2),)), ValueError, ["in_strategy[1] is (4, 1) but input 1 is a tuple"]),
    "container entry for a tensor": (lambda: sf.shard(lambda x, y: x * y, in_strategy=((4, 1), ((4, 1), None)))(
        torch.randn(8, 2), torch.randn(8, 2)), ValueError, ["in_strategy[1]", "is one tensor", "give one strategy"]),
    "dict entry naming a missing key": (lambda: sf.shard(lambda x, d: x * d["w"], in_strategy=(None, {"v": (2,)}))(
        torch.randn(8, 2), {"w": torch.randn(2)}), ValueError, ["in_strategy[1] names ['v']", "has only the keys"]),
    "unknown argument name": (lambda: sf.shard(dense_relu, in_strategy={"weight": (4, 1)}), ValueError,
                              ["in_strategy names 'weight'", "not an argument of dense_relu", "x, w, b"]),
    "argument name close to a real one": (lambda: sf.shard(dense_relu, in_strategy={"bb": None}), ValueError,
                                          ["did you mean 'b'?"]),
    "argument name not a str": (lambda: sf.shard(dense_relu, in_strategy={0: (4, 1)}), TypeError,
                                ["in_strategy keys must be argument names"]),
    "named entry of strings": (lambda: sf.shard(dense_relu, in_strategy={"x": ("dp",)}), TypeError,
                               ["in_strategy['x']", "tuple of ints"]),
    "named entry too many dims": (lambda: sf.shard(dense_relu, in_strategy={"x": (4, 1, 1)})(*_xwb()), ValueError,
                                  ["in_strategy['x']", "has 3 entries but the tensor has 2 dims"]),
    "keyword tensor split badly": (lambda: sf.shard(lambda x, scale=None: x * scale,
                                                    in_strategy={"scale": (3,)})(torch.randn(8, 6),
                                                                                 scale=torch.randn(6)),
                                   ValueError, ["in_strategy['scale']", "does not divide the world size 4"]),
    # layouts
    "Layout not called": (_call((L, None, None)), TypeError, ["in_strategy[0] is a Layout", "call it"]),
    "Layout unknown alias": (lambda: L("dp", "tp"), ValueError, ["unknown alias 'tp'", "use one of"]),
    "Layout alias twice": (lambda: L("dp", "dp"), ValueError, ["alias 'dp' is used twice", "at most once"]),
    "Layout names fewer axes": (lambda: sf.Layout((2, 2), ("dp",)), ValueError,
                                ["alias_name must name each of the 2 device_matrix axes"]),
    "Layout alias 'None'": (lambda: sf.Layout((2, 2), ("dp", "None")), ValueError,
                            ["alias names must be non-empty strings other than 'None'"]),
    "Layout empty alias": (lambda: sf.Layout((2, 2), ("dp", "")), ValueError, ["alias names must be non-empty"]),
    "Layout repeated alias": (lambda: sf.Layout((2, 2), ("dp", "dp")), ValueError, ["repeated name"]),
    "Layout non-int matrix": (lambda: sf.Layout((2, 2.0), ("dp", "mp")), TypeError,
                              ["device_matrix entries must be positive ints"]),
    "Layout empty matrix": (lambda: sf.Layout((), ()), TypeError, ["device_matrix must be a non-empty tuple"]),
    "Layout matrix not dividing the world": (_call((sf.Layout((3,), ("dp",))("dp", "None"), None, None), *_xwb(6)),
                                             ValueError, ["device_matrix (3,) holds 3 devices",
                                                          "does not divide the world size 4"]),
    "Layout maps fewer dims": (_call((L("dp"), None, None)), ValueError, ["maps 1 dims but the tensor has 2 dims",
                                                                          "one alias (or 'None') per dim"]),
    "Layout inner axis first": (_call((L(("mp", "dp"), "None"), None, None)), ValueError,
                                ["inner device axis outermost", "in device-matrix order: ('dp', 'mp')"]),
    "strategies that share no mesh": (lambda: sf.explain(lambda x, y: x + y, torch.randn(6, 6), torch.randn(6, 6),
                                                         in_strategy=((2, 1), (3, 1)), world_size=6), ValueError,
                                      ["cannot share one device mesh of 6 ranks", "device matrices nest"]),
    # out_strategy
    "out_strategy too long": (_call((None, None, None), out_strategy=((4, 1), (4, 1))), ValueError,
                              ["out_strategy has 2 entries but dense_relu returns 1"]),
    "out_strategy a string": (_call((None, None, None), out_strategy="dp"), TypeError,
                              ["out_strategy must be a tuple"]),
    "out_strategy entry too many dims": (_call((None, None, None), out_strategy=((4, 1, 1),)), ValueError,
                                         ["out_strategy[0]", "3 entries but the tensor has 2 dims"]),
    "out_strategy entry of strings": (_call((None, None, None), out_strategy=(("dp",),)), TypeError,
                                      ["out_strategy[0]", "tuple of ints"]),
    "out_strategy not dividing the world": (_call((None, None, None), out_strategy=((3, 1),)), ValueError,
                                            ["out_strategy[0]", "does not divide the world size 4"]),
    # parameter_plan
    "parameter_plan on a function": (_call(((4, 1), None, None), parameter_plan={"w": (4, 1)}), TypeError,
                                     ["parameter_plan applies to nn.Module"]),
    "parameter_plan not a dict": (_module(parameter_plan=[("dense1.weight", (4, 1))]), TypeError,
                                  ["parameter_plan must be a dict"]),
    "parameter_plan unknown name": (_module(parameter_plan={"dense2.weigth": (4, 1)}), ValueError,
                                    ["unknown parameter 'dense2.weigth'", "'dense2.weight'"]),
    "parameter_plan key not a str": (_module(parameter_plan={1: (4, 1)}), TypeError,
                                     ["parameter_plan keys must be parameter names"]),
    "parameter_plan bad entry": (_module(parameter_plan={"dense1.weight": "row"}), TypeError,
                                 ["parameter_plan['dense1.weight']", "tuple of ints"]),
    "parameter_plan split not dividing": (_module(parameter_plan={"self.dense2.weight": (3, 1)}), ValueError,
                                          ["parameter_plan['dense2.weight']", "does not divide"]),
    "parameter_plan too many dims": (_module(parameter_plan={"dense1.bias": (4, 1)}), ValueError,
                                     ["parameter_plan['dense1.bias']", "2 entries but the tensor has 1 dims"]),
    "tied weight, two strategies": (_tied_two_strategies, ValueError, ["one tied parameter, two different "
                                                                       "strategies; give one"]),
    # level, device, dataset_strategy
    "level 3": (_call(((4, 1), None, None), level=3), ValueError, ["level must be 0", "1 (min memory) or 2"]),
    "level -1": (_call(((4, 1), None, None), level=-1), ValueError, ["level must be 0"]),
    "level a string": (_call(((4, 1), None, None), level="fast"), ValueError, ["level must be 0"]),
    "level a bool": (_call(((4, 1), None, None), level=True), ValueError, ["level must be 0"]),
    "level a float": (_call(((4, 1), None, None), level=1.0), ValueError, ["level must be 0"]),
    "device tpu": (_call(((4, 1), None, None), device="tpu"), ValueError, ["device must be 'cpu', 'cuda' or None"]),
    "device cuda without CUDA": (_call(((4, 1), None, None), device="cuda"), ValueError,
                                 ["device='cuda'", "CUDA is not available", "use device='cpu' or None"]),
    "dataset_strategy unknown": (_call(((4, 1), None, None), dataset_strategy="sharded"), ValueError,
                                 ["dataset_strategy must be 'full_batch'", "or 'data_parallel'"]),
    "data_parallel 0-dim input": (lambda: sf.shard(lambda x: x * 2, in_strategy=(None,),
                                                   dataset_strategy="data_parallel")(torch.tensor(3.0)), ValueError,
                                  ["input 0: data_parallel inputs need a batch dim 0", "pass a Python number"]),
    "data_parallel strategy other than the batch split": (lambda: sf.shard(
        lambda x: x * 2, in_strategy=((1, 4),), dataset_strategy="data_parallel")(torch.randn(2, 8)), ValueError,
        ["with dataset_strategy='data_parallel' each input arrives split", "use None or (4, 1)"]),
    "a layout for an object that fits none of its tensors": (_cache_layout_of_other_dims, ValueError,
        ["in_strategy['cache'] = (4, 1) lays out 2-dim tensors", "is a _Cache whose tensors have [3] dims",
         "give a strategy for its tensors' dims, or None"]),
    # fn and how it is used
    "fn not callable": (lambda: sf.shard(42, in_strategy=(None,)), TypeError, ["fn must be a function or an "
                                                                                "nn.Module"]),
    "shard a sharded callable": (_shard_twice, ValueError, ["is already sharded", "shard the original"]),
    "shard a sharded module": (lambda: sf.shard(sf.shard(BasicBlock(), in_strategy=(None,)), in_strategy=(None,)),
                               ValueError, ["is already sharded"]),
    "nested shard": (_nested, ValueError, ["nested shard calls are not supported", "Shard the outer function"]),
    "vmap around a sharded callable": (_vmap_around, TypeError, ["inside a torch.func transform",
                                                                 "put the transform inside fn"]),
    "data-dependent control flow": (_data_dependent, sf.CaptureError, ["depends on tensor values", "branchy",
                                                                       "torch.where/torch.cond"]),
    "a tensor from outside that requires grad": (_closure_requiring_grad, sf.CaptureError,
                                                 ["requires grad but is not one of its inputs",
                                                  "Pass it as an argument"]),
    "an autograd.Function writing into its input": (
        lambda: sf.shard(lambda x: AddOneInPlace.apply(x * 2), in_strategy=((4, 1),))(torch.randn(8, 4)),
        sf.CaptureError, ["AddOneInPlace.apply writes into its input", "Return a new tensor"]),
    "an autograd.Function fake tensors cannot run": (
        lambda: sf.shard(lambda x: ThroughNumpy.apply(x), in_strategy=((4, 1),))(torch.randn(8, 4)),
        sf.CaptureError, ["could not run ThroughNumpy.apply on fake tensors", "torch.library.custom_op",
                          "register_fake"]),
    # (a DTensor on other ranks than the call's is no misuse: the call moves it, see tests/test_reshard.py)
    "a layout naming ranks outside the world": (lambda: sf.shard(lambda t: t * 2, in_strategy=(
        sf.Layout((2,), ("a",), ranks=(4, 5))("a"),))(torch.randn(8, 4)), ValueError,
        ["names ranks (4, 5) but the world has 4 ranks", "name ranks of this world"]),
    "an argument holding tensors out of reach": (lambda: sf.shard(lambda x, o: x * o.t, in_strategy=(None, None))(
        torch.randn(8, 2), _Slotted(torch.randn(2))), TypeError, ["input 1 is a _Slotted holding tensors",
                                                                 "register_pytree_node"]),
    "an output holding tensors out of reach": (lambda: sf.shard(lambda x: (x, _Slotted(x)), in_strategy=(None,))(
        torch.randn(8, 2)), TypeError, ["_Slotted holding tensors", "register_pytree_node"]),
    "SHARDFN_CHECK unknown": (_check_setting, ValueError, ["SHARDFN_CHECK='sometimes'", "use one of"]),
    # explain
    "explain unknown keyword": (lambda: sf.explain(dense_relu, *_xwb(), in_strategy=(None,) * 3, levle=2), TypeError,
                                ["explain: unknown keyword arguments ['levle']", "kwargs={...}"]),
    "explain world_size 0": (lambda: sf.explain(dense_relu, *_xwb(), world_size=0), ValueError,
                             ["world_size must be a positive int"]),
    "explain world_size a bool": (lambda: sf.explain(dense_relu, *_xwb(), world_size=True), ValueError,
                                  ["world_size must be a positive int"]),
    # init
    "init with another backend": (lambda: sf.init(backend="nccl"), ValueError,
                                  ["the process group already runs 'gloo'", "backend=None or the same backend"]),
}


def _matrix():
    results = {}
    for name, (call, _, _) in BAD.items():
        torch.manual_seed(0)
        start = time.monotonic()
        try:
            call()
            results[name] = ("no error", "", 0.0)
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            results[name] = (type(e).__name__, str(e), time.monotonic() - start)
    t = torch.ones(1)
    dist.all_reduce(t)  # nobody is stuck in a collective: the world is still usable
    return results, int(t.item())


@pytest.fixture(scope="module")
def seen(_gloo4_pool):
    # the session's four gloo ranks (tests/conftest.py), under a shorter time limit; a failed run ends them, so
    # the next test gets fresh ones
    limit, _gloo4_pool.timeout_s = _gloo4_pool.timeout_s, 120
    try:
        per_rank = _gloo4_pool.run(_matrix)
        assert all(usable == 4 for _, usable in per_rank)
    except BaseException:
        _gloo4_pool.close()
        raise
    finally:
        _gloo4_pool.timeout_s = limit
    return [results for results, _ in per_rank]


def test_the_matrix_has_at_least_60_kinds():
    assert len(BAD) >= 60


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input(seen, name):
    _, exc, words = BAD[name]
    outcomes = [results[name] for results in seen]
    assert len({(kind, message) for kind, message, _ in outcomes}) == 1, outcomes  # alike on every rank
    kind, message, seconds = outcomes[0]
    assert kind == exc.__name__, (kind, message)
    for w in words:
        assert w in message, (w, message)
    assert seconds < 10
