"""The block plan the fused MoE kernels read: token-expert assignments sorted by expert, padded per expert to
whole blocks of BLOCK_M rows. Plain torch, no host synchronisation (so it can live inside a CUDA graph): the grid is
sized by an upper bound and blocks past the end carry the expert id E, which the kernels skip.

For top_k_index [T, K] over E experts:
- sorted_ids [max_blocks * BLOCK_M] int32: assignment index t*K + k for each padded row, -1 for padding;
- block_expert [max_blocks] int32: the expert of each block (E when the block is unused);
with max_blocks = ceil(T*K / BLOCK_M) + E, which bounds sum_e ceil(count_e / BLOCK_M).
"""

import torch


def moe_blocks(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = top_k_index.reshape(-1)
    n = flat.numel()
    dev = flat.device
    # a scatter-add, not bincount (which syncs with the host on CUDA)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)  # [E]: one past each expert's last block
    max_blocks = (n + block_m - 1) // block_m + num_experts
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=dev), right=True).to(torch.int32)
    order = torch.sort(flat, stable=True).indices  # assignments grouped by expert, in assignment order
    expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # [E]: where each expert starts in `order`
    rank = torch.arange(n, device=dev) - first[expert]
    dest = (block_end - blocks)[expert] * block_m + rank
    sorted_ids = torch.full((max_blocks * block_m,), -1, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    return sorted_ids, block_expert
