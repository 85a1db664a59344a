"""`--layout FILE`: the layout to train on, from `Layout.to_json()`'s JSON or from `ucp plan --json`'s output.

A layout's `micro_batches` are each replica's samples per step (micro-batches of one sample, as `ucp plan`
plans them unless its workload says otherwise). What the example cannot honour is refused in one line.
The layout's `zero_stage` (optimizer states sharded across replicas) is set to 0: the example's ranks keep
their optimizer states whole (`--zero` shards nothing across replicas, each rank is its own data-parallel
group), which changes memory, not the step.
"""
from __future__ import annotations

import dataclasses

from ucp.errors import ConfigError, UcpError
from ucp.hmp.layout import Layout
from ucp.storage.json_file import read_json_file, shown


def read_layout(path: str, plan_index: int, num_layers: int, seq_len: int) -> tuple[Layout, tuple[int, ...]]:
    """The layout in `path` (a plan's: plan `plan_index` of `ucp plan --json`) and each replica's samples per step.
    The file is read as a regular file of bounded size (a FIFO does not block) and every value is checked."""
    data = read_json_file(path, ConfigError, "pass the JSON of Layout.to_json() or of ucp plan --json")
    micro_batch = 1
    if isinstance(data, dict) and "plans" in data:
        plans = data["plans"]
        if not isinstance(plans, list) or not 0 <= plan_index < len(plans):
            count = len(plans) if isinstance(plans, list) else 0
            raise ConfigError(f"--plan-index {plan_index}: {path} holds {count} plans (0..{count - 1})")
        workload = data.get("workload", {})
        if not isinstance(workload, dict):
            raise ConfigError(f'--layout {path}: "workload" is {shown(workload)}, not the object ucp plan --json '
                              "writes")
        for key in ("seq_len", "micro_batch_size"):
            value = workload.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 24:
                raise ConfigError(f'--layout {path}: "workload": {{"{key}": {shown(value)}}} must be an integer from '
                                  f"1 to {1 << 24}")
        if workload.get("seq_len", seq_len) != seq_len:
            raise ConfigError(f"--layout {path}: the plan is for sequences of {workload['seq_len']} tokens, the "
                              f"example trains {seq_len}; run ucp plan with --seq-len {seq_len}")
        micro_batch = workload.get("micro_batch_size", 1)
        data = plans[plan_index].get("layout") if isinstance(plans[plan_index], dict) else None
    try:
        layout = Layout.from_json(data)
    except UcpError as exc:
        raise ConfigError(f"--layout {path}: {exc}") from None
    if layout.num_layers != num_layers:
        raise ConfigError(f"--layout {path}: the layout has {layout.num_layers} layers, the model {num_layers}; "
                          f"pass --layers {layout.num_layers}")
    layout = dataclasses.replace(layout, zero_stage=0)
    return layout, tuple(r.micro_batches * micro_batch for r in layout.replicas)
