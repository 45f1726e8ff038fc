# Copyright 2024 Zilin Zhu. MIT License: see LICENSE in this directory.
# From https://github.com/zhuzilin/ring-flash-attention/blob/899628238f2f/test/utils.py
# adapted to run on CPU against dtensor_ring (tests/test_rfa_suite.py runs it): formatted
# with ruff (layout, import order); every other change is marked "dtensor_ring:".
import random

import torch
import torch.distributed as dist


def set_seed(rank, seed=42):
    seed = rank + seed
    random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


# dtensor_ring: every log call's (msg, max |a|); tests/test_rfa_suite.py checks the "diff" ones
# (upstream only prints them, for a person to read).
RECORDED = []


def log(msg, a, rank0_only=False):
    RECORDED.append((msg, a.abs().max().item()))  # dtensor_ring
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    if rank0_only:
        if rank == 0:
            print(
                f"{msg}: max {a.abs().max().item():.3g}, mean {a.abs().mean().item():.3g}",
                flush=True,
            )
        return

    for i in range(world_size):
        if i == rank:
            if rank == 0:
                print(f"{msg}:")
            print(
                f"[{rank}] max {a.abs().max().item():.3g}, mean {a.abs().mean().item():.3g}",
                flush=True,
            )
        dist.barrier()
