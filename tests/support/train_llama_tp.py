#!/usr/bin/env python
"""Train a tiny Hugging Face Llama with DeepSpeed AutoTP on CPU and save checkpoints.

Launched with ``torchrun --nproc_per_node N tests/support/train_llama_tp.py --tp T --runs JSON``
(N = T × DP; T = 1 is a plain data-parallel engine); ``--runs`` trains several configurations
({stage, dtype, tied, save_dir, dump_state, and optionally frozen: parameter names, llama:
LlamaConfig overrides, and the resume options below}) one after another in one launch. The
model is built from a ``LlamaConfig`` (no download) with grouped-query attention (4 heads, 2
key/value heads) and an odd vocabulary (37), which AutoTP splits unevenly (19 + 18 rows). ``tied`` ties ``lm_head`` to
``embed_tokens``; DeepSpeed then splits the shared weight by vocabulary and installs its own
vocabulary-parallel loss.

DeepSpeed itself records ``universal_checkpoint_info`` (v0.4, with ``affine_map``) for AutoTP.
A run's ``dump_state`` path gets every rank's gathered fp32 state (its TP shard of each
parameter, gathered over data parallelism; see support/gather.py) with its TP and DP rank.

For loss continuity across layouts a run may also set ``global_batch`` (rows per step, split over
the DP ranks; default 2 per DP rank), ``steps``, ``save_after`` (save after that many steps and
go on training, instead of saving at the end), ``losses_out`` (per-step global losses, JSON),
``start_step`` (the first step's batch), ``ucp_save`` (a folder: ``ucp.deepspeed.save``
asynchronously at ``save_after``, alongside DeepSpeed's own save, and again after the last step),
and resume through the ucp hook: ``ucp_load`` (a ucp checkpoint), ``ucp_bypass``, ``ucp_stats_out``
(every rank's load statistics with its TP and DP rank), ``dump_loaded`` (like ``dump_state``, right
after loading, plus the frozen parameters' shards as ``fp32``) and ``ucp_swap_row_blocks``
(negative control: every row-parallel weight loads the other TP rank's block). ``ucp_fuse`` (a
parameter name) and ``error_out`` instead make that parameter's affine map fused, try the load and
record its error and whether the engine was left untouched.
"""
import argparse
import json

import torch

from multi_run import run_all, save_and_close

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, SEQ = 37, 16, 24, 2, 4, 2, 6
MICRO_BATCH, ACCUMULATION = 2, 1
INIT_SEED = 99
CLIENT_STATE = {"client_marker": 17}


def build_model(tied: bool, overrides: dict | None = None):
    """The tiny Llama, or a larger one with `overrides` of LlamaConfig fields (benchmarks/convert_autotp.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                  tie_word_embeddings=tied, attn_implementation="eager")
    config = LlamaConfig(**{**fields, **(overrides or {})})
    torch.manual_seed(INIT_SEED)
    return LlamaForCausalLM(config)


def ds_config(args):
    cfg = {
        # No train_batch_size: with AutoTP DeepSpeed would derive 0 accumulation steps from it.
        "train_micro_batch_size_per_gpu": getattr(args, "micro_batch", MICRO_BATCH),
        "gradient_accumulation_steps": ACCUMULATION,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    if args.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": args.tp}
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train_one(run: dict, args: argparse.Namespace) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups

    import ucp.deepspeed

    world = dist.get_world_size()
    dp, dp_rank = world // args.tp, dist.get_rank() // args.tp
    micro = run.get("global_batch", MICRO_BATCH * dp) // dp
    opts = argparse.Namespace(stage=run.get("stage", 1), dtype=run.get("dtype", "fp32"), tp=args.tp, micro_batch=micro)
    model = build_model(run.get("tied", False), run.get("llama"))
    for name in run.get("frozen", []):
        model.get_parameter(name).requires_grad_(False)
    vocab = model.config.vocab_size
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(opts))
    tp_rank = groups.get_tensor_model_parallel_rank() if args.tp > 1 else 0
    ranks = {"tp_rank": tp_rank, "dp_rank": dp_rank}
    if run.get("ucp_fuse"):
        expect_refusal(engine, run)
    elif run.get("ucp_load"):
        ucp_load(engine, run, ranks, model)
    steps, save_after = run.get("steps", args.steps), run.get("save_after")
    start = run.get("start_step", 0)
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, vocab, (micro * dp, SEQ), generator=g)
        rows = tokens[dp_rank * micro:(dp_rank + 1) * micro]
        # The model computes the loss: with a tied, vocabulary-parallel head DeepSpeed installs its own.
        loss = engine(input_ids=rows, labels=rows).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)  # each DP rank's loss, once per TP rank
        losses.append(total.item() / world)
        if step + 1 - start == save_after:
            dump(engine, run, ranks, model)
            if run.get("ucp_save"):  # asynchronous, overlapping DeepSpeed's own save of the same step
                ucp.deepspeed.save(engine, run["ucp_save"], client_state=CLIENT_STATE)
            engine.save_checkpoint(run["save_dir"], client_state=CLIENT_STATE)
    if run.get("ucp_save"):  # the last step too: another step's checkpoint, for negative controls
        ucp.deepspeed.save(engine, run["ucp_save"], client_state=CLIENT_STATE)
        ucp.deepspeed.wait(engine)
    if run.get("losses_out") and dist.get_rank() == 0:
        with open(run["losses_out"], "w") as f:
            json.dump(losses, f)
    if save_after is None and run.get("save_dir"):
        dump(engine, run, ranks, model)
        save_and_close(engine, run, CLIENT_STATE)
    else:
        dist.barrier()
        engine.destroy()


def dump(engine, run: dict, ranks: dict, model) -> None:
    from gather import dump_states, local_state

    if run.get("dump_state"):
        dump_states(run["dump_state"], {**ranks, "params": local_state(engine, model.named_parameters())},
                    {"global_steps": engine.global_steps})


def ucp_load(engine, run: dict, ranks: dict, model) -> None:
    import deepspeed
    import torch.distributed as dist

    import ucp.deepspeed
    from gather import dump_states, local_state

    if run.get("ucp_swap_row_blocks"):
        swap_row_parallel_blocks()
    ucp.deepspeed.load(engine, run["ucp_load"], bypass=run.get("ucp_bypass", True))
    if engine.ucp_load_stats.client_state.get("client_marker") != CLIENT_STATE["client_marker"]:
        raise RuntimeError("client_state not restored by ucp")
    if run.get("dump_loaded"):
        # ZeRO-3 keeps each parameter partitioned (shape [0]) until a forward pass gathers it.
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            frozen = {name: {"fp32": p.detach().float().clone()} for name, p in model.named_parameters()
                      if not p.requires_grad}
            params = {**local_state(engine, model.named_parameters()), **frozen}
        dump_states(run["dump_loaded"], {**ranks, "params": params})
    stats = [None] * dist.get_world_size()
    dist.all_gather_object(stats, {**ranks, **{k: v for k, v in vars(engine.ucp_load_stats).items()
                                               if k != "client_state"}})
    if run.get("ucp_stats_out") and dist.get_rank() == 0:
        with open(run["ucp_stats_out"], "w") as f:
            json.dump(stats, f)


def expect_refusal(engine, run: dict) -> None:
    """Load with `run["ucp_fuse"]`'s affine-map entry fused (rank 1's block on rank 0 too), then put the map back."""
    import copy
    import re

    import torch.distributed as dist

    import ucp.deepspeed
    from train_tiny import engine_digest
    from ucp.errors import UcpError

    live = engine.module.universal_checkpoint_info
    fused = copy.deepcopy(live)
    ranks = fused["affine_map"]["params"][rf"^{re.escape(run['ucp_fuse'])}$"]["ranks"]
    ranks[0]["pieces"].append(ranks[1]["pieces"][0])
    engine.module.universal_checkpoint_info = fused
    before = engine_digest(engine)
    try:
        ucp.deepspeed.load(engine, run["ucp_load"])
        error = None
    except UcpError as exc:
        error = str(exc)
    finally:
        engine.module.universal_checkpoint_info = live
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, {"error": error, "untouched": engine_digest(engine) == before})
    if dist.get_rank() == 0:
        with open(run["error_out"], "w") as f:
            json.dump(results, f)


def swap_row_parallel_blocks() -> None:
    """Negative control: the loader gives each TP rank the other's block of every row-parallel weight.

    (Swapping every split parameter would only permute attention heads and MLP units consistently,
    which computes the same function: only a tensor comparison could tell.)"""
    import ucp.deepspeed.engine.autotp as tp_target

    declared_blocks = tp_target.declared_blocks

    def swapped(name, entries):
        logical, blocks = declared_blocks(name, entries)
        if len(logical) == 2 and blocks[0].box[1] != (0, logical[1]):
            blocks = blocks[::-1]
        return logical, blocks

    tp_target.declared_blocks = swapped


if __name__ == "__main__":
    import ucp.deepspeed
    ucp.deepspeed.finish(run_all(train_one, "{stage, dtype, tied, save_dir, dump_state, frozen, llama, resume options}",
                                    add_arguments=lambda p: p.add_argument("--tp", type=int, default=2)))
