"""Which Lightning DeepSpeed checkpoint folder a run resumes from, and how a save commits: pure file-system work.

Lightning's `DeepSpeedStrategy` saves `<name>.ckpt/` as a folder: DeepSpeed's `checkpoint/` (every rank's files)
and `latest` (naming `checkpoint`, written by rank 0 once every rank's files are written). A Lightning checkpoint
that is a file (`torch.save` of a dict: another strategy, or `convert_zero_checkpoint_to_fp32_state_dict`'s output)
holds no DeepSpeed state (`deepspeed_folder` refuses it, naming the fix).

`ucp.lightning.DeepSpeedStrategy` commits its saves: DeepSpeed writes into `<name>.ckpt.ucp-partial/`, which
rank 0 renames to `<name>.ckpt` once every rank has written (the previous `<name>.ckpt`, as `save_last` rewrites
`last.ckpt`, is replaced only then). A save cut short leaves the `.ucp-partial` folder and the previous
checkpoint untouched. `newest_complete` ("auto") takes the newest folder whose DeepSpeed state opens with every
rank's files, by the time its `latest` was written, so a folder that stock Lightning was writing in place when it
was killed is passed over too.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from ucp.elastic.trainer_folders import first_complete, opened_state
from ucp.errors import CheckpointNotFoundError
from ucp.format.folder import LATEST_NAME

PARTIAL = ".ucp-partial"  # a save being written (or cut short)
REPLACED = ".ucp-replaced"  # the checkpoint a committed save replaces, for the moment of the swap
SUFFIX = ".ckpt"
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO 0-2, ZeRO-3


def deepspeed_folder(path: str | os.PathLike[str]) -> Path:
    """`path` when it is a DeepSpeed checkpoint folder as Lightning writes it; else `CheckpointNotFoundError` in one
    line naming what it is and the fix."""
    place = Path(path)
    if place.is_file():
        raise CheckpointNotFoundError(
            f"{place}: a Lightning checkpoint file, not a DeepSpeed checkpoint folder (<name>.ckpt/ holding "
            f"checkpoint/ and {LATEST_NAME}), so it holds no optimizer partitions to reshard; resume from the folder "
            "DeepSpeedStrategy saved, or load its weights only with DeepSpeedStrategy(load_full_weights=True, "
            "stage=3)")
    if not place.is_dir():
        raise CheckpointNotFoundError(f"{place}: no such checkpoint folder")
    if not (place / LATEST_NAME).is_file():
        partial = "; it is a save cut short" if place.name.endswith(PARTIAL) else ""
        raise CheckpointNotFoundError(
            f"{place}: not a DeepSpeed checkpoint folder (no {LATEST_NAME} file naming its checkpoint/){partial}; "
            'pass a <name>.ckpt folder that DeepSpeedStrategy saved, or ckpt_path="auto"')
    return place


def lightning_state(folder: Path, keys: list[str]) -> dict[str, Any]:
    """The values of `keys` (Lightning's client state: loops, callbacks, LR schedulers, hyper-parameters) as
    Lightning saved them in rank 0's DeepSpeed model-states file, unpickled as Lightning's own DeepSpeedStrategy
    unpickles that file (`weights_only=False`: it holds Lightning's objects); tensors are mapped, not read."""
    import torch

    tag = (folder / LATEST_NAME).read_text().strip()
    for name in MODEL_STATES:
        if (folder / tag / name).is_file():
            saved = torch.load(folder / tag / name, map_location="cpu", mmap=True, weights_only=False)
            return {k: saved[k] for k in keys if k in saved}
    raise CheckpointNotFoundError(f"{folder / tag}: holds neither {' nor '.join(MODEL_STATES)}; pass a folder "
                                  "DeepSpeedStrategy saved")


def incomplete(folder: Path) -> str | None:
    """Why `folder` cannot be resumed from (no `latest`, a DeepSpeed state that does not open with every rank's
    files), or None."""
    if not (folder / LATEST_NAME).is_file():
        return f"it has no '{LATEST_NAME}' file, which DeepSpeed writes last"
    return opened_state(folder)[1]


def candidates(dirs: list[Path]) -> list[Path]:
    """The `<name>.ckpt` folders of `dirs`, newest first by their `latest` file's time (a folder without one
    last), each once."""
    found: dict[Path, float] = {}
    for root in dirs:
        if not root.is_dir():
            continue
        for entry in root.iterdir():
            if entry.name.endswith(SUFFIX) and entry.is_dir() and not entry.is_symlink():
                latest = entry / LATEST_NAME
                found[entry.resolve()] = latest.stat().st_mtime if latest.is_file() else float("-inf")
    return sorted(found, key=lambda p: (found[p], p.name), reverse=True)


def cut_short(dirs: list[Path]) -> list[Path]:
    """The saves of `dirs` that were cut short (`<name>.ckpt.ucp-partial` folders)."""
    return sorted(e for root in dirs if root.is_dir() for e in root.iterdir() if e.name.endswith(SUFFIX + PARTIAL))


def newest_complete(dirs: list[Path]) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint folder of `dirs` (None: none is, or there is none), and each newer folder
    passed over with why."""
    return first_complete(candidates(dirs), incomplete)


def partial_path(filepath: str | os.PathLike[str]) -> Path:
    """Where a save of `filepath` is written before it commits."""
    return Path(f"{os.fspath(filepath)}{PARTIAL}")


def commit(filepath: str | os.PathLike[str]) -> None:
    """Rename the written `partial_path(filepath)` to `filepath`, replacing a previous checkpoint there only now
    (rank 0, after every rank has written)."""
    target, written = Path(filepath), partial_path(filepath)
    old = Path(f"{os.fspath(filepath)}{REPLACED}")
    if old.exists():
        shutil.rmtree(old)
    if target.is_dir() and not target.is_symlink():
        target.rename(old)
    elif target.exists() or target.is_symlink():
        target.unlink()
    written.rename(target)
    if old.exists():
        shutil.rmtree(old)
