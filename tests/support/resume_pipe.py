#!/usr/bin/env python
"""Train train_pipe.py's model at any number of pipeline stages, save mid-run, or resume through ucp.

Launched with ``torchrun --nproc_per_node N tests/support/resume_pipe.py --stages S ...`` (DP = N / S).
The layers are train_pipe.py's (tied embedding on the first and last stage); with one stage the
same PipelineModule holds them all, under the same names. Global step ``s`` trains on the same
global batch of GLOBAL_BATCH sequences at any layout (train_pipe.batches grows it with the DP
degree); a lower DP degree accumulates more micro-batches, so runs at any layout are comparable.

* ``--save-at K --save-dir D``: save with DeepSpeed after K steps and keep training: the losses of
  the later steps are those of the uninterrupted run.
* ``--ucp-save D``: with ``--save-at K``, also save with ucp into D every K steps, through the
  ``"ucp": {"save": {"dir": D, "every": K}}`` config (asynchronously; the save after K steps lands
  beside DeepSpeed's own); ``--ucp-memory BASE`` adds the host-memory tier at the same steps
  (``resume_common.memory_tier``: 2 simulated nodes under BASE).
* ``--ucp-load P``: resume from the ucp checkpoint P through ``ucp.deepspeed.initialize``.
* ``--reset-tied-on-last-stage`` (negative control): after loading, the last stage's copy of the
  tied embedding gets its initial value back, as a loader that fills only the first stage's copy
  would leave it.
* ``--ucp-expect-error OUT``: load each comma-separated ``--ucp-load`` path after
  ``deepspeed.initialize`` expecting a ucp error; rank 0 writes every rank's
  ``{path, error, untouched}`` to OUT.
"""
import argparse
import hashlib
import json
import os

import torch

from resume_common import memory_tier, resume_arguments, write_losses_and_close, write_stats
from train_pipe import DIM, MICRO_BATCH, SEQ, VOCAB, Block, TiedEmbedding, ds_config, loss_fn

TIED = "tied_modules.embed.weight"
GLOBAL_BATCH = 4 * MICRO_BATCH
CLIENT_STATE = {"client_marker": 11}


def build(stages: int):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    layers = [TiedLayerSpec("embed", TiedEmbedding), LayerSpec(Block, 1), LayerSpec(Block, 2),
              LayerSpec(torch.nn.LayerNorm, DIM), TiedLayerSpec("embed", TiedEmbedding)]
    return PipelineModule(layers, num_stages=stages, loss_fn=loss_fn, partition_method="uniform")


def batches(step: int, dp_rank: int, dp: int) -> list:
    """The micro-batches of global step `step` that data-parallel rank `dp_rank` of `dp` trains on."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    targets = (tokens * 2 + 1) % VOCAB
    rows = tokens.split(MICRO_BATCH), targets.split(MICRO_BATCH)
    per_rank = GLOBAL_BATCH // MICRO_BATCH // dp
    return list(zip(*rows))[dp_rank * per_rank:(dp_rank + 1) * per_rank]


def digest(engine) -> str:
    """A hash of every module tensor and every ZeRO partition and optimizer state this rank holds."""
    h = hashlib.sha256()
    opt = engine.optimizer
    tensors = list(engine.module.state_dict().values()) + list(getattr(opt, "single_partition_of_fp32_groups", []))
    for state in getattr(opt, "state", {}).values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def expect_errors(engine, paths: list[str], out: str) -> None:
    import torch.distributed as dist

    import ucp.deepspeed
    from ucp.errors import UcpError

    results = []
    for path in paths:
        before = digest(engine)
        try:
            ucp.deepspeed.load(engine, path)
            error = None
        except UcpError as exc:
            error = str(exc)
        results.append({"path": path, "error": error, "untouched": digest(engine) == before})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


def main(argv=None):
    p = resume_arguments()
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--ucp-expect-error", default=None)
    p.add_argument("--reset-tied-on-last-stage", action="store_true")
    p.add_argument("--ucp-save", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    import ucp.deepspeed

    torch.use_deterministic_algorithms(True)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build(args.stages)
    initial_tied = dict(model.named_parameters())[TIED].detach().clone()
    config = ds_config(argparse.Namespace(stage=args.zero_stage, dtype=args.dtype))
    config["gradient_accumulation_steps"] = GLOBAL_BATCH // MICRO_BATCH // (dist.get_world_size() // args.stages)
    params = list(model.parameters())
    if args.ucp_load and not args.ucp_expect_error:
        config["ucp"] = {"load": args.ucp_load}
        engine, *_ = ucp.deepspeed.initialize(model=model, model_parameters=params, config=config)
        if engine.ucp_load_stats.client_state.get("client_marker") != CLIENT_STATE["client_marker"]:
            raise RuntimeError("client state not restored by ucp")
        if args.ucp_stats_out:
            write_stats(engine, args.ucp_stats_out)
    elif args.ucp_save:
        config["ucp"] = {"save": {"dir": args.ucp_save, "every": args.save_at}}
        if args.ucp_memory:
            config["ucp"]["save"]["memory"] = memory_tier(args.ucp_memory, args.save_at)
        engine, *_ = ucp.deepspeed.initialize(model=model, model_parameters=params, config=config)
        engine.ucp_client_state = dict(CLIENT_STATE)
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    if args.ucp_expect_error:
        expect_errors(engine, args.ucp_load.split(","), args.ucp_expect_error)
        dist.destroy_process_group()
        return 0
    if args.reset_tied_on_last_stage and engine.is_last_stage():
        with torch.no_grad():
            for name, q in engine.module.named_parameters():
                if name == TIED:
                    q.copy_(initial_tied)
            engine.optimizer._restore_from_bit16_weights()
    dp, dp_rank = engine.grid.data_parallel_size, engine.grid.data_parallel_id
    losses = []
    for step in range(args.start_step, args.start_step + args.steps):
        if step == args.save_at:
            engine.save_checkpoint(args.save_dir, client_state=dict(CLIENT_STATE))
        losses.append(engine.train_batch(iter(batches(step, dp_rank, dp))).item())
    if args.ucp_save:
        ucp.deepspeed.wait(engine)
    write_losses_and_close(engine, losses, args.losses_out)
    return 0


if __name__ == "__main__":
    import ucp.deepspeed
    ucp.deepspeed.finish(main())
