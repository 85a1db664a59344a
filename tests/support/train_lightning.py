"""A tiny Lightning + DeepSpeed job on CPU (gloo), run under torchrun by tests/integration/test_lightning.py.

    torchrun --nproc_per_node W train_lightning.py --out DIR --stage S --epochs E [--ckpt-path P] [--stock]

The global batch is fixed (`--global-batch`, cut into W equal DataLoader batches) and Lightning's own
DistributedSampler (seed 0) orders the data, so every optimizer step sees the same samples at any W that divides it.
Rank 0 appends one JSON line per optimizer step to `DIR/losses.jsonl`: the step, epoch, the loss averaged over all
ranks (the global batch's mean), the learning rate. `ModelCheckpoint(dirpath=DIR/ckpt, every epoch, save_last)`
saves; `--die-at-save N` kills rank W-1 (SIGKILL) in the middle of the N-th save, after its first file.
`--stock` uses Lightning's own DeepSpeedStrategy with only its CUDA-only checks bypassed (the negative control).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05):
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LossLog(Callback):
    """Rank 0 writes each step's loss, averaged over the ranks (equal shares: the global batch's mean)."""

    def __init__(self, path: Path):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"].detach().clone().to(torch.float64)
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        if trainer.is_global_zero:
            lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "epoch": trainer.current_epoch,
                                    "batch_idx": batch_idx, "loss": loss.item(), "lr": lr,
                                    "world": trainer.world_size}) + "\n")


class Started(Callback):
    """Rank 0 records the loop state the fit starts from (after any resume)."""

    def __init__(self, path: Path):
        self.path = path

    def on_train_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            loop = trainer.fit_loop.epoch_loop
            self.path.write_text(json.dumps({"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                                             "batches_seen": loop.batch_progress.total.completed,
                                             "lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0],
                                             "best_model_path": trainer.checkpoint_callback.best_model_path}))


def die_in_save(n: int) -> None:
    """SIGKILL the last rank in the middle of the n-th checkpoint save, after its first file is written."""
    saves, stock = [0], torch.save

    def save(obj, f, *args, **kwargs):
        stock(obj, f, *args, **kwargs)
        if isinstance(f, (str, os.PathLike)) and "optim_states" in os.fspath(f):
            saves[0] += 1
            if saves[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save


def stock_strategy(stage: int):
    """Lightning's own DeepSpeedStrategy with only its CUDA-only checks bypassed (REFERENCE: Lightning on CPU)."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CpuDeepSpeed(DeepSpeedStrategy):
        def setup_environment(self):
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
            DDPStrategy.setup_environment(self)

    return CpuDeepSpeed(stage=stage)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=6)
    p.add_argument("--samples", type=int, default=24)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--die-at-save", type=int, default=0)
    p.add_argument("--stock", action="store_true")
    p.add_argument("--every-steps", type=int, default=0, help="also save into DIR/steps every N optimizer steps")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    a.out.mkdir(parents=True, exist_ok=True)
    if a.die_at_save and int(os.environ.get("RANK", "0")) == world - 1:
        die_in_save(a.die_at_save)
    L.seed_everything(0, workers=True)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(a.samples, 8, generator=g), torch.randn(a.samples, 1, generator=g))
    import ucp.lightning

    loader = DataLoader(data, batch_size=ucp.lightning.per_process_batch(a.global_batch, world), shuffle=True)
    steps = [ModelCheckpoint(dirpath=a.out / "steps", every_n_train_steps=a.every_steps, save_top_k=-1)
             ] if a.every_steps else []

    strategy = stock_strategy(a.stage) if a.stock else ucp.lightning.DeepSpeedStrategy(stage=a.stage)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=a.epochs,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[LossLog(a.out / "losses.jsonl"), Started(a.out / "started.json"),
                                   ModelCheckpoint(dirpath=a.out / "ckpt", every_n_epochs=1, save_top_k=-1,
                                                   save_last=True), *steps])
    trainer.fit(Regression(hidden=a.hidden), train_dataloaders=loader, ckpt_path=a.ckpt_path)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)  # outputs are written: skip finalization, where gloo's threads can abort (REFERENCE, exit aborts)


if __name__ == "__main__":
    main()
