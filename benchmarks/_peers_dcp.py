#!/usr/bin/env python
"""One worker of benchmarks/peers.py's reference: PyTorch DCP's async save on the job's FSDP2 equivalent. Every rank
runs this file under torchrun (`--tools dcp --phase save`, the other arguments as for `_peers_llama.py`).

The same Llama, data and AdamW as the DeepSpeed job, each decoder layer and then the whole model wrapped by
`torch.distributed.fsdp.fully_shard` on a CPU device mesh (FSDP2 shards parameters, gradients and optimizer state:
ZeRO-3, where the DeepSpeed job is ZeRO-1; same global batch). A save is the pattern of DCP's async-save recipe:
`get_state_dict(model, optimizer)`, then `dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS,
async_stager=DefaultStager(...))` after waiting for the previous save's future. Staging is asked for in pinned
memory, into shared memory for the save process; DCP ignores the pinning where CUDA is not available, with a
warning, which is recorded (`"why"`). DCP's FileSystemWriter fsyncs every file (`sync_files=True`), so its future
is the durable time. Peak RSS is the training rank's (the staged copy lives there), not DCP's save process's.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers_llama import Job, StartMarks, append, folder_bytes, measure_saves, parse  # noqa: E402
from _train_llama import MODELS, SEED, SEQ_LEN  # noqa: E402


def stager():
    """DCP's DefaultStager: pinned, into shared memory for the save process; synchronous and with blocking copies,
    since StagingOptions documents its asynchronous staging and non-blocking copies as needing CUDA."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=True, use_async_staging=False,
                                        use_non_blocking_copy=False))


class DcpJob(Job):
    """`Job`'s interface (what measure_saves drives) on an FSDP2 model saved by DCP's process-based async save."""

    def __init__(self, args: argparse.Namespace):
        self.marks = StartMarks()
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaConfig, LlamaForCausalLM

        self.marks.mark("imported")
        self.args = args
        self.dlrover = False
        dist.init_process_group("gloo")
        self.marks.mark("rendezvous")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(LlamaConfig(**MODELS[args.model]))
        self.n_params = sum(p.numel() for p in model.parameters())
        mesh = init_device_mesh("cpu", (self.world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.marks.mark("model")
        self.started = time.time()
        self.marks.mark("engine")
        g = torch.Generator().manual_seed(SEED + self.rank)
        self.ids = torch.randint(0, MODELS[args.model]["vocab_size"], (1, SEQ_LEN), generator=g)
        self.save_began = 0.0
        self.skipped = 0
        self.steps = 0
        self.pending: Future | None = None
        self.stager = None
        self.pinned_refused: str | None = None

    def step(self) -> float:
        began = time.perf_counter()
        logits = self.model(input_ids=self.ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 self.ids[:, 1:].reshape(-1))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps += 1
        return time.perf_counter() - began

    def folder(self, tool: str) -> Path:
        return Path(self.args.save_dir) / tool / f"step{self.steps}"

    def save(self, tool: str) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.save_began = began = time.perf_counter()
        if self.pending is not None:  # the recipe: one save in flight at a time
            self.pending.result()
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        if self.stager is None:  # pinned staging: DCP drops it, with a warning, where CUDA is not available
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.stager = stager()
            self.pinned_refused = next((str(w.message) for w in caught if "pin_memory" in str(w.message)), None)
        self.pending = dcp.async_save(state, checkpoint_id=str(self.folder(tool)), async_stager=self.stager,
                                      async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        return time.perf_counter() - began

    def durable(self, tool: str) -> float:
        return self.committed(tool)

    def committed(self, tool: str) -> float:
        if self.pending is not None:
            self.pending.result()
        return time.perf_counter() - self.save_began

    def saved_bytes(self, tool: str) -> int:
        """The last save's folder (every rank's files: one folder on the shared disk)."""
        return folder_bytes(self.folder(tool))


def main() -> None:
    args = parse()
    if args.tools != ["dcp"] or args.phase != "save":
        raise SystemExit("_peers_dcp.py: only --tools dcp --phase save (DCP is the save-stall reference)")
    job = DcpJob(args)
    for _ in range(2):
        job.step()
    record = measure_saves(job, "dcp")
    if job.rank == 0:
        record["staging"] = "shared memory, " + ("pinned" if job.pinned_refused is None else "not pinned")
        if job.pinned_refused:
            record["pinned_refused"] = job.pinned_refused
        append(args.records, record)
    job.committed("dcp")
    job.stager.close()
    job.barrier()


if __name__ == "__main__":
    main()
