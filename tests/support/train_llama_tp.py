#!/usr/bin/env python
"""Train a tiny Hugging Face Llama with DeepSpeed AutoTP on CPU and save checkpoints.

Launched with ``torchrun --nproc_per_node N tests/support/train_llama_tp.py --tp T --runs JSON``
(N = T × DP); ``--runs`` trains several configurations ({stage, dtype, tied, save_dir,
dump_state, and optionally frozen: parameter names, llama: LlamaConfig overrides}) one after
another in one launch. The
model is built from a ``LlamaConfig`` (no download) with grouped-query attention (4 heads, 2
key/value heads) and an odd vocabulary (37), which AutoTP splits unevenly (19 + 18 rows). ``tied`` ties ``lm_head`` to
``embed_tokens``; DeepSpeed then splits the shared weight by vocabulary and installs its own
vocabulary-parallel loss.

DeepSpeed itself records ``universal_checkpoint_info`` (v0.4, with ``affine_map``) for AutoTP.
A run's ``dump_state`` path gets every rank's gathered fp32 state (its TP shard of each
parameter, gathered over data parallelism; see support/gather.py) with its TP and DP rank.
"""
import argparse
import sys

import torch
from multi_run import run_all, save_and_close

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, SEQ = 37, 16, 24, 2, 4, 2, 6
MICRO_BATCH, ACCUMULATION = 2, 1
INIT_SEED = 99


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
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
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

    from gather import dump_states, local_state

    world = dist.get_world_size()
    opts = argparse.Namespace(stage=run.get("stage", 1), dtype=run.get("dtype", "fp32"), tp=args.tp)
    model = build_model(run.get("tied", False), run.get("llama"))
    for name in run.get("frozen", []):
        model.get_parameter(name).requires_grad_(False)
    vocab = model.config.vocab_size
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(opts))
    tp_rank = groups.get_tensor_model_parallel_rank() if args.tp > 1 else 0
    dp, dp_rank = world // args.tp, dist.get_rank() // args.tp
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, vocab, (MICRO_BATCH * dp, SEQ), generator=g)
        rows = tokens[dp_rank * MICRO_BATCH:(dp_rank + 1) * MICRO_BATCH]
        # The model computes the loss: with a tied, vocabulary-parallel head DeepSpeed installs its own.
        loss = engine(input_ids=rows, labels=rows).loss
        engine.backward(loss)
        engine.step()
    if run.get("dump_state"):
        dump_states(run["dump_state"], {"tp_rank": tp_rank, "dp_rank": dp_rank,
                                        "params": local_state(engine, model.named_parameters())},
                    {"global_steps": engine.global_steps})
    save_and_close(engine, run, {"client_marker": 17})


if __name__ == "__main__":
    sys.exit(run_all(train_one, "{stage, dtype, tied, save_dir, dump_state, frozen, llama}",
                     add_arguments=lambda p: p.add_argument("--tp", type=int, default=2)))
