#!/usr/bin/env python
"""Train a ~112M-parameter Llama (random init, no downloads) for one step with DeepSpeed ZeRO-1 fp32 on CPU
(or another stage, precision and size: --stage, --dtype, --model 359m) and save the checkpoint. Launched by
benchmarks/convert.py as

    torchrun --nproc_per_node 2 benchmarks/_train_llama.py SAVE_DIR [--stage 2 --dtype bf16]

with DS_ACCELERATOR=cpu, OMP_NUM_THREADS=1. Every rank runs this file.
"""
import argparse
import json

import torch

# Llama shapes: GQA (12 query heads, 4 KV heads, head dim 64), untied embeddings, 10 layers -> 112.1M params.
MODEL = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=10,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
# A larger one of the same family, for benchmarks/load.py --model 359m (memory flat in model size): hidden 1024,
# 16 query heads / 4 KV heads of 64, FFN 2816, 26 layers -> 358.7M params.
MODELS = {"112m": MODEL, "359m": dict(MODEL, hidden_size=1024, intermediate_size=2816, num_hidden_layers=26,
                                       num_attention_heads=16, num_key_value_heads=4),
          # A smaller one for quick runs (benchmarks/peers.py --quick): vocab 8000, hidden 512, 8 query heads / 4 KV
          # heads of 64, FFN 1376, 4 layers -> 19.8M params.
          "20m": dict(MODEL, vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4)}
SEQ_LEN = 64
MICRO_BATCH = 1
SEED = 1234
TAG = "global_step1"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("save_dir")
    parser.add_argument("--info-out", help="where rank 0 writes a JSON description of the run")
    parser.add_argument("--stage", type=int, default=1, help="ZeRO stage (benchmarks/load.py uses 3)")
    parser.add_argument("--model", choices=sorted(MODELS), default="112m", help="the Llama's size (MODELS)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="training precision (bf16: DeepSpeed's bf16 optimizer / ZeRO bf16, fp32 masters)")
    args = parser.parse_args()

    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(SEED)
    config = MODELS[args.model]
    model = LlamaForCausalLM(LlamaConfig(**config))
    n_params = sum(p.numel() for p in model.parameters())

    ds_config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }
    if args.dtype == "bf16":
        ds_config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    g = torch.Generator().manual_seed(SEED + rank)
    ids = torch.randint(0, config["vocab_size"], (MICRO_BATCH, SEQ_LEN), generator=g)
    logits = engine(input_ids=ids).logits.float()  # bf16 logits: the loss in fp32, as on CPU it must be
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.save_dir, tag=TAG)
    torch.distributed.barrier()
    loss = loss.item()
    if rank == 0 and args.info_out:
        with open(args.info_out, "w") as f:
            json.dump({"params": n_params, "config": config, "seq_len": SEQ_LEN, "tag": TAG,
                       "world_size": torch.distributed.get_world_size(), "zero_stage": args.stage, "dtype": args.dtype,
                       "loss": loss}, f, indent=2)
    if rank == 0:
        print(f"saved {n_params / 1e6:.1f}M-parameter Llama to {args.save_dir}/{TAG}, loss {loss:.4f}")


if __name__ == "__main__":
    main()
