"""sf.show: a DTensor's layout as a grid of blocks and the ranks holding each, and every rank's piece."""

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardfn as sf
from shardfn.runtime import simulated_world


def test_a_2d_layout_shows_its_blocks_and_pieces(capsys):
    with simulated_world(4):
        mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
        text = sf.show(distribute_tensor(torch.randn(6, 10), mesh, [Shard(1), Replicate()]))
    assert capsys.readouterr().out.strip() == text
    lines = text.splitlines()
    assert lines[0] == "DTensor (6, 10) float32 on mesh dp=2 x tp=2, placements (S(1), R)"
    assert "0:5" in lines[2] and "5:10" in lines[2]
    assert lines[3].split() == ["0:6", "[0,1]", "[2,3]"]  # replicated over tp: two ranks hold each block
    assert lines[-1].split() == ["3", "(1,", "1)", "(0,", "5)", "(6,", "5)"]


def test_uneven_and_empty_pieces_are_shown():
    with simulated_world(4):
        text = sf.show(distribute_tensor(torch.randn(6), DeviceMesh("cpu", torch.arange(4)), [Shard(0)]))
    assert text.splitlines()[-1].split() == ["3", "(3,)", "(6,)", "(0,)", "(empty)"]
    assert sf.show(torch.randn(3)) == "tensor (3,) float32: a plain tensor, whole wherever it is"
