"""Where a DeepSpeed checkpoint's rank files are: the tag folder of a save directory (through
`latest`, or a Hugging Face Trainer's last `checkpoint-N`), and the rank files inside it."""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ucp.converters.trainer_folders import CHECKPOINT_RE, checkpoint_folders, folder_names
from ucp.errors import CheckpointNotFoundError
from ucp.format.folder import LATEST_NAME, check_tag, read_latest

logger = logging.getLogger("ucp.input")

OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


@dataclass(frozen=True)
class TagDir:
    save_dir: Path
    tag: str

    @property
    def path(self) -> Path:
        return self.save_dir / self.tag


def resolve_tag(input_dir: str | os.PathLike, tag: str | None = None) -> TagDir:
    """The tag folder `engine.save_checkpoint` wrote: `input_dir/<tag or latest>`, or `input_dir` itself.

    A Hugging Face Trainer `output_dir` (`checkpoint-N` folders, no `latest`) stands for its last
    `checkpoint-N`, picked as transformers' `get_last_checkpoint` picks it (logged), and a
    `checkpoint-N` tag for that folder; each is a save directory with its own `latest`.
    """
    root = Path(input_dir)
    if tag is not None:
        check_tag(tag)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root}: no such directory; pass the directory given to "
                                      "engine.save_checkpoint, or one of its tag folders")
    if tag is None and any(root.glob("*model_states.pt")):
        return TagDir(root.parent, root.name)
    folders = checkpoint_folders(root)
    if tag is not None and folders and CHECKPOINT_RE.search(tag):
        if not (root / tag).is_dir():
            raise CheckpointNotFoundError(f"{root / tag}: no such checkpoint folder; pass --tag with one of "
                                          f"{folder_names(folders)}")
        return _trainer_checkpoint(root / tag, folders)
    if tag is None:
        tag = read_latest(root)
        if folders and tag is None:
            logger.info("%s: using %s, the last of %s", root, folders[-1].name, folder_names(folders))
            return _trainer_checkpoint(folders[-1], folders)
        if tag is None:
            raise CheckpointNotFoundError(f"{root}: no 'latest' file, no model-states files and no checkpoint-N "
                                          f"folders here; pass --tag (tags present: {_tags(root) or 'none'})")
    if not (root / tag).is_dir():
        trainer = f"; checkpoint folders present: {folder_names(folders)}" if folders else ""
        raise CheckpointNotFoundError(f"{root / tag}: tag '{tag}' does not exist; "
                                      f"tags present: {_tags(root) or 'none'}{trainer}")
    return TagDir(root, tag)


def _trainer_checkpoint(folder: Path, folders: list[Path]) -> TagDir:
    """The DeepSpeed checkpoint inside a Trainer's `checkpoint-N` folder, through its `latest`."""
    tag = read_latest(folder)
    if tag is None:
        raise CheckpointNotFoundError(f"{folder}: no 'latest' file, so no finished DeepSpeed checkpoint; pass --tag "
                                      f"with another of {folder_names(folders)}")
    if not (folder / tag).is_dir():
        raise CheckpointNotFoundError(f"{folder / tag}: named by {folder / LATEST_NAME} but missing; pass --tag with "
                                      f"another of {folder_names(folders)}")
    return TagDir(folder, tag)


def _tags(root: Path) -> str:
    return ", ".join(sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*model_states.pt"))))


def model_files(folder: Path, names: list[str]) -> dict[int, Path]:
    """mp rank -> its `mp_rank_{MM}_model_states.pt`."""
    return {int(m.group(1)): folder / n for n in names if (m := MODEL_FILE.match(n))}


def optim_files(folder: Path, names: list[str]) -> dict[tuple[int, int], Path]:
    """(dp rank, mp rank) -> its optimizer-states file."""
    return {(int(m.group(2)), int(m.group(3))): folder / n for n in names if (m := OPTIM_FILE.match(n))}
