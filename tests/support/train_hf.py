"""Train a tiny tied transformers model with the Hugging Face Trainer + DeepSpeed on CPU (torchrun, gloo).

    torchrun --nproc_per_node N train_hf.py --model llama|gpt2|llama-lora --stage S --output-dir OUT
        --max-steps T [--save-steps K] [--resume PATH|last] [--stock] [--ucp-options JSON]
        --losses-out FILE

Every run trains on the same data in the same order for any N: the global batch is fixed
(GLOBAL_BATCH = N x per-device batch) and the sampler is the Trainer's own, seeded. The LR schedule
is the Trainer's linear decay over `--max-steps`, owned by the DeepSpeed engine (the config has an
"optimizer"). `--resume` resumes through `ucp.transformers.train` (`--stock`: `trainer.train`).
`--losses-out` gets {"losses": [global loss of each step run here], "first_step": N+1, "epoch": ...}.
`llama-lora` is the tied Llama with PEFT LoRA adapters on its attention projections: the base weights
are frozen (built from the same seed in every run, as a user loads them from the base model), and the
Trainer saves DeepSpeed's checkpoint without them (`exclude_frozen_parameters`).
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

GLOBAL_BATCH = 4
SEQ_LEN = 8
VOCAB = 64
SAMPLES = 64


LORA_TARGETS = "q_proj,v_proj"
LORA_LR = 1e-1  # adapters start at zero (LoRA's B): a rate that moves the loss well past the tests' tolerance


def tiny_model(kind: str, lora_targets: str = LORA_TARGETS):
    import transformers

    torch.manual_seed(0)
    if kind == "llama-lora":
        import peft

        base = tiny_model("llama")
        return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                         target_modules=lora_targets.split(",")))
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                          tie_word_embeddings=True)
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


class TokenData(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ_LEN), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def ds_config(stage: int) -> dict:
    return {
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                   "weight_decay": "auto", "torch_adam": True}},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto",
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["llama", "gpt2", "llama-lora"], required=True)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--stock", action="store_true")
    p.add_argument("--ucp-options", default=None)
    p.add_argument("--lora-targets", default=LORA_TARGETS, help="llama-lora: the modules LoRA adapts")
    p.add_argument("--no-cpu-recipe", action="store_true",
                   help="leave out the recipe that makes the Trainer see torchrun's world on CPU, as users forget it")
    p.add_argument("--losses-out", required=True)
    args = p.parse_args()

    import accelerate
    import transformers

    import ucp.transformers

    if not args.no_cpu_recipe:
        accelerate.PartialState(backend="gloo")  # the Trainer on CPU sees torchrun's world only this way
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = ds_config(args.stage)
    if args.ucp_options:
        config["ucp"] = json.loads(args.ucp_options)
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=GLOBAL_BATCH // world,
        learning_rate=LORA_LR if args.model == "llama-lora" else 1e-2, weight_decay=0.01, lr_scheduler_type="linear",
        warmup_steps=1, seed=0,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        logging_steps=1, report_to=[], deepspeed=config, dataloader_drop_last=True,
        accelerator_config={"use_configured_state": not args.no_cpu_recipe}, disable_tqdm=True)

    class RecordingTrainer(transformers.Trainer):
        """A Trainer subclass, as users (and TRL) write them: records each micro-batch's loss."""

        losses: list[float] = []

        def training_step(self, *a, **k):
            loss = super().training_step(*a, **k)
            self.losses.append(loss.item())
            return loss

    trainer = RecordingTrainer(model=tiny_model(args.model, args.lora_targets), args=training_args,
                               train_dataset=TokenData())
    if args.resume is None:
        trainer.train()
    else:
        resume = True if args.resume == "last" else args.resume
        if args.stock:
            trainer.train(resume_from_checkpoint=resume)
        else:
            ucp.transformers.train(trainer, resume_from_checkpoint=resume)
    # Each rank's loss is its share of the global mean (the Trainer scales by the number of processes
    # when averaging tokens across devices): the global loss of a step is the mean over ranks.
    local = torch.tensor(trainer.losses, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(local)
        local /= dist.get_world_size()
    if int(os.environ.get("RANK", "0")) == 0:
        first = trainer.state.global_step - len(trainer.losses) + 1
        with open(args.losses_out, "w") as f:
            json.dump({"losses": local.tolist(), "first_step": first, "global_step": trainer.state.global_step,
                       "epoch": trainer.state.epoch}, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    import ucp.deepspeed
    ucp.deepspeed.finish(main())
