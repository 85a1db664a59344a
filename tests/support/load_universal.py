#!/usr/bin/env python
"""Load universal checkpoints with stock DeepSpeed and record what each engine ends up with.

Launched with ``torchrun --nproc_per_node N tests/support/load_universal.py --model tiny|llama|pipe|moe --tp T
--runs JSON``: every run ({stage, dtype, load_dir, tag, out; ``tie`` for the tiny model, ``tied`` for the
Llama, ``topology`` for the pipeline, ``ep_size`` for MoE}) builds a fresh engine of that model
(train_tiny.py's tiny model, train_llama_tp.py's Llama under AutoTP ``T`` (T = 1: a plain data-parallel
engine), train_pipe.py's 2-stage pipeline, or train_moe.py's MoE model), loads ``load_dir``/``tag`` through
``engine.load_checkpoint`` with ``{"checkpoint": {"load_universal": true}}`` (DeepSpeed's own
loader, no ucp code), and writes to ``out`` every rank's fp32 master and Adam moments of each
trainable parameter (its TP shard, gathered over DP: support/gather.py), the optimizer's steps and
hyper-parameters, and the engine's global step. Several loads share one launch.
"""
import argparse

import torch

from multi_run import run_all


def build(run: dict, args: argparse.Namespace):
    """The model, its optimizer parameters and the DeepSpeed config of `run`, loading universally."""
    if args.model == "tiny":
        from train_tiny import TinyModel
        from train_tiny import ds_config as tiny_config

        model = TinyModel(run.get("tie", ""))
        options = argparse.Namespace(optimizer="AdamW", lr=1e-2, stage=run["stage"], dtype=run["dtype"],
                                     load_universal=True)
        return model, model.param_groups(), tiny_config(options, torch.distributed.get_world_size())
    if args.model == "pipe":
        from train_pipe import build as build_pipe
        from train_pipe import ds_config as pipe_config

        options = argparse.Namespace(stage=run["stage"], dtype=run["dtype"], topology=run.get("topology", False))
        model = build_pipe(options, torch.distributed.get_world_size())
        return model, list(model.parameters()), {**pipe_config(options), "checkpoint": {"load_universal": True}}
    if args.model == "moe":
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        from train_moe import MoEModel
        from train_moe import ds_config as moe_config

        ep_size = run["ep_size"]
        model = MoEModel(ep_size, torch.distributed.get_rank() % ep_size)
        groups = split_params_into_different_moe_groups_for_optimizer([{"params": list(model.parameters()),
                                                                        "name": "all"}])
        options = argparse.Namespace(stage=run["stage"], dtype=run["dtype"])
        return model, groups, {**moe_config(options), "checkpoint": {"load_universal": True}}
    from train_llama_tp import build_model
    from train_llama_tp import ds_config as llama_config

    model = build_model(run.get("tied", False))
    config = llama_config(argparse.Namespace(stage=run["stage"], dtype=run["dtype"], tp=args.tp))
    return model, model.parameters(), {**config, "checkpoint": {"load_universal": True}}


def optimizer_steps(engine) -> list:
    """The `step` of every torch optimizer state the engine holds (one per flat group or sub-group)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return [state["step"].clone() if torch.is_tensor(state["step"]) else state["step"]
            for state in inner.state.values() if "step" in state]


def load_one(run: dict, args: argparse.Namespace) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups

    from gather import dump_states, local_state

    model, parameters, config = build(run, args)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=parameters, config=config)
    path, _ = engine.load_checkpoint(run["load_dir"], tag=run["tag"])
    if path is None:
        raise RuntimeError(f"load_checkpoint({run['load_dir']!r}, tag={run['tag']!r}) loaded nothing")
    tp = args.tp if args.model == "llama" else 1
    ranks = {"tp_rank": groups.get_tensor_model_parallel_rank() if tp > 1 else 0, "dp_rank": dist.get_rank() // tp}
    if args.model == "pipe":
        ranks = {"tp_rank": 0, "dp_rank": engine.grid.data_parallel_id, "stage": engine.stage_id}
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    dump_states(run["out"], {**ranks, "params": local_state(engine, model.named_parameters()),
                             "steps": optimizer_steps(engine), "param_groups": hyper},
                {"global_steps": engine.global_steps})
    dist.barrier()
    engine.destroy()


if __name__ == "__main__":
    def arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", choices=["tiny", "llama", "pipe", "moe"], required=True)
        p.add_argument("--tp", type=int, default=1)

    import ucp.deepspeed  # only for finish(): leave without the gloo exit abort (docs/RELIABILITY.md)
    ucp.deepspeed.finish(run_all(load_one, "{stage, dtype, load_dir, tag, out, tie, tied, topology, ep_size}",
                                 add_arguments=arguments))
