#!/usr/bin/env python
"""Train train_moe.py's model (4 experts) at any ep_size, save mid-run, or resume through ucp.

Launched with ``torchrun --nproc_per_node N tests/support/resume_moe.py --ep-size E ...``. Global
step ``s`` trains on the same global batch at any ep_size (train_moe's data), and the logged loss
of a step is the mean over ranks of their losses.

* ``--save-at K --save-dir D``: save with DeepSpeed after K steps and keep training: the losses of
  the later steps are those of the uninterrupted run.
* ``--ucp-load P``: resume from the ucp checkpoint P through ``ucp.deepspeed.initialize``;
  ``--experts-out F`` then has rank 0 write, right after loading, every rank's
  ``{"rank", "ep_rank", "num_local", "params": {local name: {fp32, exp_avg, exp_avg_sq, module}}}``
  for its expert parameters (fp32 masters and moments gathered over the expert-data-parallel group,
  ``module`` the module's own weight).
* ``--experts-by-local-id`` (negative control): ucp takes every rank for expert-parallel rank 0, so
  local expert i loads global expert i, as stock DeepSpeed does at a new ep_size. The strict check
  then refuses the checkpoint (no rank claims experts 2-3): rank 0 writes the error to
  ``--strict-error-out``, and the run loads again with ``strict=False`` and goes on.
* ``--ucp-save D``: with ``--save-at K``, also save with ``ucp.deepspeed.save`` into D after K steps
  (asynchronously, alongside DeepSpeed's own save), and again after the last step; ``--ucp-memory BASE``
  adds the host-memory tier every K steps (``resume_common.memory_tier``: 2 simulated nodes under BASE).
"""
import argparse
import os

import torch

from resume_common import memory_tier, resume_arguments, write_losses_and_close, write_stats
from train_moe import EXPERTS, MoEModel, _ep_rank, ds_config, train_step

CLIENT_STATE = {"client_marker": 13}


def dump_experts(engine, model, path: str) -> None:
    import torch.distributed as dist

    from gather import local_state

    experts = [(n, q) for n, q in model.named_parameters() if ".deepspeed_experts." in n]
    state = local_state(engine, experts)
    for name, q in experts:
        state[name]["module"] = q.detach().float().clone()
    entry = {"rank": dist.get_rank(), "ep_rank": _ep_rank(model), "num_local": model.moe.num_local_experts,
             "params": state}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, entry)
    if dist.get_rank() == 0:
        torch.save(gathered, path)


def main(argv=None):
    p = resume_arguments()
    p.add_argument("--ep-size", type=int, required=True)
    p.add_argument("--experts-out", default=None)
    p.add_argument("--experts-by-local-id", action="store_true")
    p.add_argument("--strict-error-out", default=None)
    p.add_argument("--ucp-save", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import ucp.deepspeed
    import ucp.deepspeed.engine.moe

    torch.use_deterministic_algorithms(True)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = MoEModel(args.ep_size, rank % args.ep_size)
    groups = split_params_into_different_moe_groups_for_optimizer([{"params": list(model.parameters()),
                                                                    "name": "all"}])
    config = ds_config(argparse.Namespace(stage=args.zero_stage, dtype="fp32"))
    if args.experts_by_local_id:
        ucp.deepspeed.engine.moe.expert_parallel_rank = lambda group_name: 0
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
        try:
            ucp.deepspeed.load(engine, args.ucp_load)
            raise RuntimeError("the strict check let experts loaded by local id through")
        except ucp.deepspeed.CheckpointMismatchError as e:
            if rank == 0:
                with open(args.strict_error_out, "w") as f:
                    f.write(str(e))
        ucp.deepspeed.load(engine, args.ucp_load, strict=False)
    elif args.ucp_load:
        config["ucp"] = {"load": args.ucp_load}
        engine, *_ = ucp.deepspeed.initialize(model=model, model_parameters=groups, config=config)
        if engine.ucp_load_stats.client_state.get("client_marker") != CLIENT_STATE["client_marker"]:
            raise RuntimeError("client state not restored by ucp")
        if args.ucp_stats_out:
            write_stats(engine, args.ucp_stats_out)
    elif args.ucp_memory:  # the memory tier saves through the config; ucp_save's own saves stay explicit
        config["ucp"] = {"save": {"dir": args.ucp_save, "every": 10**9,
                                  "memory": memory_tier(args.ucp_memory, args.save_at)}}
        engine, *_ = ucp.deepspeed.initialize(model=model, model_parameters=groups, config=config)
        engine.ucp_client_state = dict(CLIENT_STATE)
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    if args.experts_out:
        dump_experts(engine, model, args.experts_out)
    if _ep_rank(model) != rank % args.ep_size:
        raise RuntimeError(f"rank {rank}: DeepSpeed made EP rank {_ep_rank(model)}, expected {rank % args.ep_size}")
    if model.moe.num_local_experts * args.ep_size != EXPERTS:
        raise RuntimeError(f"{model.moe.num_local_experts} local experts at ep_size {args.ep_size}")
    losses = []
    for step in range(args.start_step, args.start_step + args.steps):
        if step == args.save_at:
            if args.ucp_save:  # asynchronous, overlapping DeepSpeed's own save of the same step
                ucp.deepspeed.save(engine, args.ucp_save, client_state=dict(CLIENT_STATE))
            engine.save_checkpoint(args.save_dir, client_state=dict(CLIENT_STATE))
        total = train_step(engine, step, rank, world).detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    if args.ucp_save:  # the last step too: another step's checkpoint, for negative controls
        ucp.deepspeed.save(engine, args.ucp_save, client_state=dict(CLIENT_STATE))
        ucp.deepspeed.wait(engine)
    write_losses_and_close(engine, losses, args.losses_out)
    return 0


if __name__ == "__main__":
    import ucp.deepspeed
    ucp.deepspeed.finish(main())
