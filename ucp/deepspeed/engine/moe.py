"""Native DeepSpeed MoE (`deepspeed.moe.layer.MoE`): experts under their global ids and expert groups.

An MoE layer's `Experts` module holds this rank's `num_local_experts` experts as
`deepspeed_experts.<local id>`; local expert i is global expert `ep_rank * num_local + i`, where
`ep_rank` is this rank's rank in the layer's expert-parallel group. DeepSpeed builds that group (data
before expert parallelism or not), so asking it covers both orders. The atomic checkpoint names
experts by global id. Expert parameters sit in their own optimizer param groups, partitioned over
the expert-data-parallel group (the ranks that hold the same experts); ZeRO-1/2's `_hp_mapping`
already addresses that partition, so only the names and the tensors' groups change here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class LocalExpertTensor:
    """One expert parameter (or buffer) on this rank: its global name and the ranks holding the same expert."""

    global_name: str
    dp_group: object  # the expert-data-parallel process group


def expert_parallel_rank(group_name: str) -> int:
    """This rank's place in the expert-parallel group `group_name`, which fixes its experts' global ids."""
    from deepspeed.utils import groups

    return dist.get_rank(group=groups._get_expert_parallel_group(group_name))


def local_expert_tensors(module) -> dict[str, LocalExpertTensor]:
    """Every expert parameter and buffer of `module` by its local name (the engine's), or {} without MoE."""
    from deepspeed.moe.experts import Experts
    from deepspeed.utils import groups

    out = {}
    for prefix, experts in module.named_modules():
        if not isinstance(experts, Experts):
            continue
        group_name = next(experts.parameters()).group_name
        first = expert_parallel_rank(group_name) * experts.num_local_experts
        dp_group = groups._get_expert_data_parallel_group(group_name)
        base = f"{prefix}.deepspeed_experts" if prefix else "deepspeed_experts"
        for local, expert in enumerate(experts.deepspeed_experts):
            for name in dict(expert.named_parameters()) | dict(expert.named_buffers()):
                out[f"{base}.{local}.{name}"] = LocalExpertTensor(f"{base}.{first + local}.{name}", dp_group)
    return out


def checkpoint_name(experts: dict[str, LocalExpertTensor], name: str) -> str:
    """`name` as the checkpoint has it: an expert's under its global id, any other unchanged."""
    return experts[name].global_name if name in experts else name


def expert_groups(experts: dict[str, LocalExpertTensor]) -> dict[str, object]:
    """Each expert tensor's global name -> its expert-data-parallel group, the ranks that share it."""
    return {e.global_name: e.dp_group for e in experts.values()}
