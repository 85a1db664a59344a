"""Tensor-parallel engines (DeepSpeed AutoTP): the box of each full tensor this TP rank's module holds.

With `"tensor_parallel": {"autotp_size": T}` DeepSpeed replaces a model's linears and embeddings by
TP shards and keeps, on the module, the `universal_checkpoint_info` that `save_checkpoint` writes
(built at `deepspeed.initialize` by `deepspeed.module_inject.layers.collect_autotp_universal_checkpoint_info`).
Its `affine_map` places, per parameter and TP rank, a block of the full tensor. The map is read with
the converter's reader (`ucp.converters.deepspeed.declared.declared_blocks`), so the loader serves
exactly the maps the converter rebuilds: one unscaled block per rank, replicated or tiling dim 0 or 1.
A fused (several blocks on a rank) or scaled map is refused before anything is touched.

`with_tensor_parallel` takes a family adapter's tensors, which list the rank's shards, and makes
each a box of the full tensor: `shape` becomes the full shape, `box` the rank's block, and
`start`/`numel` (ZeRO's run of the flattened shard, or all of it) then count elements of that
box, as the loader expects. The box is shared by the ranks of the engine's data-parallel group (the
ranks of this TP rank), which becomes the tensor's `dp_group`. A tied head (`lm_head.weight`
aliasing `embed_tokens.weight`) is one parameter to DeepSpeed and to the map, so it is loaded once.

Padding: a shard longer than its block (a padded vocabulary: extra rows at the end of the last
rank's shard) has no values in a checkpoint, which holds the unpadded tensor. Its pad rows are
left as the engine holds them (as it initialised them, when loading right after
`deepspeed.initialize`); only the block's elements are loaded. Padding along a dim other than 0
would interleave pad and real elements in the flattened shard and is refused.
"""
from __future__ import annotations

from ucp.converters.deepspeed.declared import RankBlock, affine_params, declared_blocks
from ucp.deepspeed.engine.targets import Target, TargetTensor
from ucp.errors import UnsupportedLayoutError

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"  # deepspeed.checkpoint.constants


def tp_size(engine) -> int:
    """The engine's AutoTP degree (1 without tensor parallelism)."""
    return int(engine.autotp_size() or 1)


def with_tensor_parallel(target: Target) -> Target:
    """`target` with every tensor of an AutoTP engine described as its TP rank's box of the full tensor.

    An engine without tensor parallelism is returned as it is. Raises `UnsupportedLayoutError`,
    naming the parameter, for a layout the loader cannot serve; it only edits `target`'s records,
    never the engine.
    """
    size = tp_size(target.engine)
    if size == 1:
        return target
    from deepspeed.utils import groups

    rank = groups.get_tensor_model_parallel_rank()
    entries = _engine_map(target.engine)
    blocks = {t.name: rank_block(t.name, entries, rank, size) for t in target.tensors if t.kind != "buffer"}
    for t in target.tensors:
        if t.name in blocks:
            _check_shard(t, blocks[t.name][1])
    target.tensors = [to_box(t, *blocks[t.name], target.dp_group) if t.name in blocks else t for t in target.tensors]
    return target


def _engine_map(engine) -> dict[str, dict]:
    """The affine map DeepSpeed writes for `engine` at save time."""
    info = getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None)
    entries = affine_params(info, "the engine's AutoTP universal_checkpoint_info")
    if not entries:
        raise UnsupportedLayoutError("this AutoTP engine's module records no affine_map in its "
                                     "universal_checkpoint_info, so which part of each tensor a TP rank holds is "
                                     "unknown; ucp loads into AutoTP engines of DeepSpeed 0.19 or newer")
    return entries


def rank_block(name: str, entries: dict[str, dict], rank: int, size: int) -> tuple[tuple[int, ...], RankBlock]:
    """The full shape of `name` and the block TP rank `rank` (of `size`) holds, from the affine map `entries`."""
    try:
        declared = declared_blocks(name, entries)
    except UnsupportedLayoutError as e:
        raise UnsupportedLayoutError(f"{e}, so it cannot load into this AutoTP engine either; load into an engine "
                                     "without tensor parallelism") from None
    if declared is None:
        raise UnsupportedLayoutError(f"{name}: the engine's AutoTP affine_map does not describe it (DeepSpeed could "
                                     "not map its TP layout), so ucp cannot tell which part this TP rank holds; "
                                     "keep it out of AutoTP's partitioning or load without tensor parallelism")
    logical, blocks = declared
    if len(blocks) != size:
        raise UnsupportedLayoutError(f"{name}: the engine's affine_map places it on {len(blocks)} TP ranks, the "
                                     f"engine has autotp_size {size}")
    block = blocks[rank]
    sizes = [(hi - lo, n) for (lo, hi), n in zip(block.box, block.shard_shape)]
    if any(n < size for size, n in sizes):
        raise UnsupportedLayoutError(f"{name}: the engine's affine_map gives TP rank {rank} a block of "
                                     f"{[size for size, _ in sizes]} in a shard of {list(block.shard_shape)}; the map "
                                     "is inconsistent")
    padded = [d for d, (size, n) in enumerate(sizes) if n > size]
    if padded not in ([], [0]):
        raise UnsupportedLayoutError(f"{name}: TP rank {rank} pads its shard along dim {padded[-1]}; ucp loads "
                                     "shards padded along dim 0 (at the end) only")
    return logical, block


def _check_shard(t: TargetTensor, block: RankBlock) -> None:
    if t.shape != block.shard_shape:
        raise UnsupportedLayoutError(f"{t.name}: this TP rank's module holds shape {t.shape}, but the engine's "
                                     f"affine_map says {block.shard_shape}; the map does not describe this module")


def to_box(t: TargetTensor, logical: tuple[int, ...], block: RankBlock, dp_group) -> TargetTensor:
    """`t`, listed as the rank's shard, as `block`'s box of the full tensor of shape `logical`, shared by
    `dp_group` (the ranks of this TP rank) unless it already has a group of its own (pipeline, experts)."""
    boxed = t.as_box(logical, None if block.box == tuple((0, n) for n in logical) else block.box)
    return boxed if t.dp_group is not None else boxed.shared_by(dp_group)
