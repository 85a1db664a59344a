"""Which `accelerator.save_state` folder of a save folder a restart resumes from, unattended (`checkpoint="auto"`).

A save folder holds one `save_state` folder per save, named with its number last (`checkpoint_N`, as Accelerate's
`ProjectConfiguration(automatic_checkpoint_naming=True)` names them under `project_dir/checkpoints`). `save_state`
writes the engine's DeepSpeed checkpoint, then Accelerate's own files, and last each process's
`random_states_<rank>.pkl`. A folder is complete when its DeepSpeed state opens with every rank's files and every
process that saved it left its RNG file; "newest" is the highest number.

Newer incomplete folders are moved out of the save folder, to `<save folder>.damaged/`, once a restart resumes
from an older one: Accelerate's automatic naming refuses to write into a folder that exists, and its
`total_limit` rotation counts every folder of the save folder, keeping the highest numbers.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ucp.checkpoint import source_world_size
from ucp.elastic.trainer_folders import first_complete, opened_state
from ucp.errors import CorruptCheckpointError

NUMBERED = re.compile(r"(\d+)$")
RNG_FILE = "random_states_{}.pkl"


def incomplete(folder: Path) -> str | None:
    """Why `folder` cannot be resumed from, or None."""
    ckpt, problem = opened_state(folder)
    if ckpt is None:
        return problem
    try:  # the source's degrees are read, not computed: a bad one is a state that does not open
        saved = source_world_size(ckpt.source, folder)
    except CorruptCheckpointError as exc:
        return f"its DeepSpeed state does not open ({exc})"
    # The RNG files present bound the search, not the number of ranks the index claims.
    present = {n for n in os.listdir(folder) if n.startswith("random_states_") and (folder / n).is_file()}
    missing = next((i for i in range(saved) if RNG_FILE.format(i) not in present), None)
    if missing is not None:
        return f"it has no {RNG_FILE.format(missing)}, which save_state writes last"
    return None


def newest_complete(save_dir: str | os.PathLike[str]) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete `save_state` folder of `save_dir` (None: none is, or there is none), and each newer
    folder passed over with why."""
    root = Path(save_dir)
    if not root.is_dir():
        return None, []
    numbered = sorted((int(m.group(1)), root / n) for n in os.listdir(root)
                      if (m := NUMBERED.search(n)) and (root / n).is_dir() and not (root / n).is_symlink())
    return first_complete((folder for _, folder in reversed(numbered)), incomplete)


def set_aside(folders: list[Path]) -> list[Path]:
    """Move each folder to `<its save folder>.damaged/<name>` (`<name>.K` when taken); the new paths."""
    moved = []
    for folder in folders:
        place = folder.parent.with_name(folder.parent.name + ".damaged")
        place.mkdir(exist_ok=True)
        target, n = place / folder.name, 1
        while target.exists():
            target, n = place / f"{folder.name}.{n}", n + 1
        folder.rename(target)
        moved.append(target)
    return moved
