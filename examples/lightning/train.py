"""Lightning + DeepSpeed that resumes at any number of processes: the README's "Lightning" section.

    torchrun --nproc_per_node 2 examples/lightning/train.py --out runs/demo --epochs 2   # saves every epoch
    torchrun --nproc_per_node 3 examples/lightning/train.py --out runs/demo --epochs 4   # continues on 3, ZeRO-3

On a machine without GPUs it runs on DeepSpeed's CPU accelerator over gloo (`DS_ACCELERATOR=cpu` is set for you).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import ucp.lightning


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 10, 0.5), "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--stage", type=int, default=None, help="ZeRO stage (default: 2 on 1-2 processes, 3 above)")
    p.add_argument("--global-batch", type=int, default=12, help="samples per optimizer step at any world size")
    a = p.parse_args()
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    stage = a.stage if a.stage is not None else (2 if world <= 2 else 3)
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    loader = DataLoader(data, batch_size=ucp.lightning.per_process_batch(a.global_batch, world), shuffle=True)
    cuda = torch.cuda.is_available()
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=local, num_nodes=world // local,
                        max_epochs=a.epochs,
                        strategy=ucp.lightning.DeepSpeedStrategy(stage=stage),  # the one changed line
                        callbacks=[ModelCheckpoint(dirpath=a.out / "checkpoints", save_last=True)],
                        default_root_dir=a.out, enable_progress_bar=False)
    trainer.fit(Regression(), train_dataloaders=loader, ckpt_path="auto")  # fresh start, or the newest checkpoint


if __name__ == "__main__":
    main()
