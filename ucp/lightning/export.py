"""`ucp export --to lightning`: one fp32 Lightning checkpoint file from a Lightning DeepSpeed checkpoint folder saved at
any world size and ZeRO stage (or any checkpoint ucp reads), as Lightning's
`convert_zero_checkpoint_to_fp32_state_dict` writes it: the client state Lightning saved beside DeepSpeed's files
(epoch, global step, loops, callbacks, LR schedulers, hyper-parameters) with `state_dict` holding every weight and
buffer in full (the client state unpickled from rank 0's model-states file, as Lightning's function does), so that
`LightningModule.load_from_checkpoint(file)` and `torch.load` read it without DeepSpeed.

Each tensor is read whole from the ranks' partitions, one at a time; the file is written under a temporary name
and renamed once complete, and an existing file is never replaced.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ucp.checkpoint import open_checkpoint
from ucp.errors import OutputExistsError
from ucp.format.folder import LATEST_NAME
from ucp.lightning.folders import lightning_state
from ucp.plan.plan import BUFFER, BUFFER_STATE, WEIGHT_STATE

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what DeepSpeed keeps in its model-states file beside Lightning's client state (the keys Lightning drops)
DEEPSPEED_KEYS = ("module", "optimizer", "lr_scheduler", "csr_tensor_module_names", "skipped_steps", "global_steps",
                  "dp_world_size", "mp_world_size")
FORWARD_PREFIX = "_forward_module."  # Lightning < 2.1 saved its wrapper's prefix


@dataclass(frozen=True)
class LightningExport:
    output: Path
    tensors: int
    bytes: int


def to_lightning(input: str | os.PathLike[str], output: str | os.PathLike[str], *, dtype: str = "float32",
                 tag: str | None = None) -> LightningExport:
    """Write the Lightning checkpoint file `output` from the checkpoint at `input` (module docstring)."""
    target = Path(output)
    if target.exists() and not (target.is_dir() and not any(target.iterdir())):
        raise OutputExistsError(f"{target}: exists; give a new file name (ucp export never replaces a file)")
    ckpt = open_checkpoint(input, tag)
    state_dict: dict[str, torch.Tensor] = {}
    size = 0
    for name in ckpt.names:
        buffer = ckpt.info(name).kind == BUFFER
        tensor = ckpt.tensor(name, BUFFER_STATE if buffer else WEIGHT_STATE)
        if tensor.is_floating_point():
            tensor = tensor.to(DTYPES[dtype])
        key = name[len(FORWARD_PREFIX):] if name.startswith(FORWARD_PREFIX) else name
        state_dict[key] = tensor
        size += tensor.numel() * tensor.element_size()
    keys = [k for k in ckpt.client_state if k not in DEEPSPEED_KEYS]
    lightning = Path(input)
    client = lightning_state(lightning, keys) if (lightning / LATEST_NAME).is_file() else {
        k: ckpt.client_state[k] for k in keys}
    if target.is_dir():
        target.rmdir()  # an empty folder given as the output: the file takes its name
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    torch.save({**client, "state_dict": state_dict}, partial)
    partial.rename(target)
    return LightningExport(target, len(state_dict), size)
