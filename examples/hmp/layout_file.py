"""`--layout FILE`: the layout to train on, from `Layout.to_json()`'s JSON or from `ucp plan --json`'s output.

A layout's `micro_batches` are each replica's samples per step (micro-batches of one sample, as `ucp plan`
plans them unless its workload says otherwise). What the example cannot honour is refused in one line.
The layout's `zero_stage` (optimizer states sharded across replicas) is set to 0: the example's ranks keep
their optimizer states whole (`--zero` shards nothing across replicas, each rank is its own data-parallel
group), which changes memory, not the step.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ucp.errors import ConfigError, UcpError
from ucp.hmp.layout import Layout


def read_layout(path: str, plan_index: int, num_layers: int, seq_len: int) -> tuple[Layout, tuple[int, ...]]:
    """The layout in `path` (a plan's: plan `plan_index` of `ucp plan --json`) and each replica's samples per step."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--layout {path}: cannot read it as JSON ({exc})") from None
    micro_batch = 1
    if isinstance(data, dict) and "plans" in data:
        plans = data["plans"]
        if not isinstance(plans, list) or not 0 <= plan_index < len(plans):
            count = len(plans) if isinstance(plans, list) else 0
            raise ConfigError(f"--plan-index {plan_index}: {path} holds {count} plans (0..{count - 1})")
        workload = data.get("workload", {})
        if workload.get("seq_len", seq_len) != seq_len:
            raise ConfigError(f"--layout {path}: the plan is for sequences of {workload['seq_len']} tokens, the "
                              f"example trains {seq_len}; run ucp plan with --seq-len {seq_len}")
        micro_batch = int(workload.get("micro_batch_size", 1))
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
