#!/usr/bin/env python
"""Train a tiny, tied Hugging Face causal LM with bare `deepspeed.initialize` on CPU, for the export tests.

Launched with ``torchrun --nproc_per_node 2 tests/support/train_hf_model.py --runs JSON --steps S``
(see support/multi_run.py). Each run ({model: "llama"|"gpt2", stage, dtype: "fp32"|"bf16", save_dir,
dump_state, after, optimizer: the DeepSpeed config's section, default OPTIMIZER})
builds its model from a config (no download; tied input and output embeddings, no dropout), trains
S steps, saves with ``engine.save_checkpoint(save_dir)`` and writes ``config.json`` beside the tag
folder with ``model.config.save_pretrained(save_dir)``, as the Hugging Face Trainer lays out
``checkpoint-N/``. It then trains ``after`` more steps, the uninterrupted run a resumed job must
continue.

``dump_state`` (rank 0) gets ``{"params": {name: {"fp32", "exp_avg", "exp_avg_sq"}}`` (the live
fp32 masters and Adam moments at save time, gathered over DP), ``"logits"`` (the live model's
logits on ``probe_ids()`` at save time, as fp32), ``"losses"`` (the S steps) and ``"losses_after"``.

Data: global step s trains on ``batch(s, vocab)``, GLOBAL_BATCH rows; DP rank r of dp takes rows
``[r * GLOBAL_BATCH / dp, (r + 1) * GLOBAL_BATCH / dp)``. A step's logged loss is the mean over
ranks of each rank's mean loss (which is what DeepSpeed's averaged gradients differentiate).
"""
from __future__ import annotations

import argparse

import torch

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, GLOBAL_BATCH = 37, 16, 2, 4, 8, 4
INIT_SEED = 5
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                         "torch_adam": True}}


def build_config(model: str):
    """The tiny tied config of `model` ("llama" or "gpt2")."""
    from transformers import GPT2Config, LlamaConfig

    if model == "llama":
        return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=24, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64,
                           tie_word_embeddings=True, attn_implementation="eager", architectures=["LlamaForCausalLM"])
    if model == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                          attn_implementation="eager", architectures=["GPT2LMHeadModel"])
    raise ValueError(f"unknown model {model!r}")


def build_model(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(INIT_SEED)
    return AutoModelForCausalLM.from_config(config)


def batch(step: int, vocab: int) -> torch.Tensor:
    """The global batch of step `step`: GLOBAL_BATCH rows of SEQ token ids."""
    return torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def rows(step: int, vocab: int, rank: int, world: int) -> torch.Tensor:
    per = GLOBAL_BATCH // world
    return batch(step, vocab)[rank * per:(rank + 1) * per]


def probe_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(10**6))


def train_steps(engine, vocab: int, start: int, count: int) -> list[float]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(start, start + count):
        ids = rows(step, vocab, rank, world)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def train_one(run: dict, args: argparse.Namespace) -> None:
    import deepspeed
    import torch.distributed as dist

    from gather import local_state

    config = build_config(run["model"])
    model = build_model(config)
    ds_config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
                 "gradient_accumulation_steps": 1, "optimizer": run.get("optimizer", OPTIMIZER),
                 "zero_optimization": {"stage": run["stage"]}, "steps_per_print": 10**9,
                 "gradient_clipping": 0.0}  # DeepSpeed clips at 1.0 unless told; the FSDP2 resume does not clip
    if run.get("dtype", "fp32") == "bf16":
        ds_config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    losses = train_steps(engine, config.vocab_size, 0, args.steps)
    params = local_state(engine, model.named_parameters())
    with torch.no_grad():
        logits = engine(input_ids=probe_ids(config.vocab_size)).logits.float().clone()
    engine.save_checkpoint(run["save_dir"])
    if dist.get_rank() == 0:
        model.config.save_pretrained(run["save_dir"])
    losses_after = train_steps(engine, config.vocab_size, args.steps, run.get("after", 0))
    if dist.get_rank() == 0:
        torch.save({"params": params, "logits": logits, "losses": losses, "losses_after": losses_after},
                   run["dump_state"])
    dist.barrier()
    engine.destroy()


def load_dcp(model, optimizer, folder) -> None:
    """Load a DCP checkpoint into `model` and `optimizer` the way an FSDP2 (or single-process) job does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


if __name__ == "__main__":
    import ucp.deepspeed
    from multi_run import run_all

    ucp.deepspeed.finish(run_all(train_one, "{model: llama|gpt2, stage, dtype: fp32|bf16, save_dir, dump_state, "
                                             "after, optimizer}"))
