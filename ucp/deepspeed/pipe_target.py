"""Pipeline-parallel engines (`deepspeed.pipe.PipelineModule`): each stage holds only its own layers.

A stage's module names its layers as the whole model does (`<layer index>.<param>`, and
`tied_modules.<key>.<param>` for a TiedLayerSpec), which are the names the pipeline converter
writes, so a stage loads its own layers at any number of stages. A tied module lives on every
stage that uses it; each copy loads the same atomic tensor, so the copies agree as DeepSpeed keeps
them. A stage's ZeRO partitions and replicated tensors are shared by the stage's data-parallel
group only, and no stage alone knows the whole model: the strict check uses every stage's names.
"""
from __future__ import annotations


def is_pipeline(engine) -> bool:
    return bool(getattr(engine, "pipeline_parallelism", False))


def use_stage_groups(target) -> None:
    """Every tensor of this stage is shared by the stage's data-parallel group (the ranks of the same stage)."""
    group = target.engine.grid.get_data_parallel_group()
    for t in target.tensors:
        t.dp_group = group
