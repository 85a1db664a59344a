"""Train a tiny tied Llama with the Hugging Face Trainer + DeepSpeed on CPU, and resume it anywhere with ucp.

    # 2 processes, ZeRO-2: trains 6 steps, saves out/checkpoint-3 and out/checkpoint-6
    torchrun --nproc_per_node 2 examples/hf_trainer/train.py --stage 2 --max-steps 6

    # 1 process, ZeRO-3: resumes from the last checkpoint-N, straight from the Trainer's folder
    torchrun --nproc_per_node 1 examples/hf_trainer/train.py --stage 3 --max-steps 9 --resume

The one line that differs from a stock Trainer script is `ucp.transformers.train(trainer, ...)`
in place of `trainer.train(...)`. The rest is the recipe that makes the Trainer use DeepSpeed on
CPU processes (gloo); on GPUs, drop the two lines marked "CPU only".
"""
import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")          # CPU only
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"         # CPU only: the Trainer sees torchrun's world

import accelerate  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import ucp.deepspeed  # noqa: E402
import ucp.transformers  # noqa: E402


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16, vocab: int = 128):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage of this run")
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--output-dir", default="out")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint-N in --output-dir")
    args = p.parse_args()

    accelerate.PartialState(backend="gloo")               # CPU only
    world = int(os.environ.get("WORLD_SIZE", "1"))
    deepspeed_config = {
        "zero_optimization": {"stage": args.stage},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto",
    }
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, save_steps=3, logging_steps=1, report_to=[],
        per_device_train_batch_size=4 // world,          # the same global batch at any world size
        learning_rate=1e-3, deepspeed=deepspeed_config, disable_tqdm=True,
        accelerator_config={"use_configured_state": True})  # CPU only
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    trainer = transformers.Trainer(model=transformers.LlamaForCausalLM(config), args=training_args,
                                   train_dataset=RandomTokens())
    ucp.transformers.train(trainer, resume_from_checkpoint=True if args.resume else None)


if __name__ == "__main__":
    main()
    # Last: wait for saves, tear down gloo and exit 0. Without it, a gloo thread still busy as the interpreter
    # finalizes can abort the process after all its work is done (docs/RELIABILITY.md, "Exit aborts").
    ucp.deepspeed.finish()
