"""Loads into a Megatron-style `mpu`, in a `PipelineModule` or not: the boxes of the full tensors TP shards are.

The inverse of a save's plan (`ucp.deepspeed.saving.mpu`), from the same reading of the module's
`universal_checkpoint_info` pattern lists (`tp_layout`, the converter's reader) and the same cut (`pieces`): a
column- or row-parallel shard is one box; a fused QKV (GQA) or SwiGLU gate/up shard is a block of each
sub-parameter, one after another (`TargetTensor.pieces`); a vocabulary-parallel shard is its rows of the
unpadded vocabulary, its padding rows in no box (they keep what the engine holds, as under AutoTP); a
replicated tensor, and one the model declares "to average" (the checkpoint holds the mean of the saved TP
copies), is the whole tensor on every TP rank. Each tensor's full shape and pattern come from the shards of
every TP rank of its stage (`shard_shapes`, one gather over the TP group), as `ucp convert` joins them; an
engine without a pipeline is one stage.

A pipeline (or an mpu) whose module declares no pattern lists, at TP 1, is left as it is (`ucp.deepspeed.engine.targets`
already names its tensors as the whole model does). At TP 1 with pattern lists the module's shapes are the
full ones except for vocabulary padding, which this cuts.
"""
from __future__ import annotations

import torch.distributed as dist

from ucp.converters.deepspeed.lists import declares_lists
from ucp.deepspeed.engine.autotp import UNIVERSAL_CHECKPOINT_INFO
from ucp.deepspeed.engine.targets import Target
from ucp.deepspeed.saving.layout import has_mpu, mpu_tp_group, mpu_tp_rank, mpu_tp_size
from ucp.deepspeed.saving.mpu import Shape, pieces, tp_layout

ShardShapes = dict[str, list[Shape]]  # name -> its shard's shape on each TP rank, in TP rank order


def serves(target: Target) -> bool:
    """Whether `with_mpu` places `target`'s tensors: a Megatron-style mpu at TP > 1 (in a pipeline or not), or, at
    TP 1, a pipeline or an mpu whose module declares pattern lists."""
    engine = target.engine
    if mpu_tp_size(engine) > 1:
        return True
    megatron = getattr(engine, "pipeline_parallelism", False) or has_mpu(engine)
    return megatron and declares_lists(getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None))


def tp_rank(engine) -> int:
    """This rank's place in its TP group (the pipeline grid's slice, or the mpu's TP group)."""
    return mpu_tp_rank(engine)


def shard_shapes(target: Target) -> ShardShapes:
    """Each tensor's shard shape on every rank of this rank's TP group (a collective over the group; the ranks of
    one TP group are one pipeline stage, which holds the same tensors on each)."""
    mine = {t.name: tuple(t.shape) for t in target.tensors}
    tp = mpu_tp_size(target.engine)
    if tp == 1:
        return {name: [shape] for name, shape in mine.items()}
    every: list[dict[str, Shape]] = [{} for _ in range(tp)]
    dist.all_gather_object(every, mine, group=mpu_tp_group(target.engine))
    return {name: [tuple(shapes[name]) for shapes in every] for name in mine}


def with_mpu(target: Target, shapes: ShardShapes) -> Target:
    """`target` with each tensor, listed as this TP rank's shard, as the boxes of the full tensor it holds.

    Raises a `UcpError` naming the tensor for a layout the module's lists do not describe or contradict; it only
    edits `target`'s records, never the engine."""
    engine = target.engine
    info = getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None)
    rank = tp_rank(engine)
    placed = []
    for t in target.tensors:
        full, hints = tp_layout(t.name, shapes[t.name], info, t.kind == "param")
        placed.append(t.as_pieces(full, pieces(t.name, full, hints, shapes[t.name], rank)))
    target.tensors = placed
    return target
