"""The Hugging Face Trainer's checkpoint folders, and the small files it keeps beside the weights.

The Trainer saves `output_dir/checkpoint-N/`, each a DeepSpeed save directory (`latest`,
`global_stepN/`) plus its own files: `config.json`, `generation_config.json`, `trainer_state.json`,
tokenizer files, and pickles (`rng_state_*.pth`, `scheduler.pt`, `training_args.bin`). The last
checkpoint is picked exactly as transformers' `get_last_checkpoint` does, so ucp and
`Trainer.train(resume_from_checkpoint=True)` agree on it. Of the side files, small JSON, text and
tokenizer files travel into the ucp checkpoint; pickles never do, since loading one runs code.
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ucp.format.folder import LATEST_NAME, is_ucp_file

# transformers.trainer_utils: PREFIX_CHECKPOINT_DIR and _re_checkpoint.
CHECKPOINT_RE = re.compile(r"^checkpoint\-(\d+)$")
# JSON (configs, trainer_state, tokenizer), text (merges.txt, vocab.txt), SentencePiece models
# (tokenizer.model) and chat templates: what `from_pretrained` reads beside the weights.
EXTRA_SUFFIXES = (".json", ".txt", ".model", ".jinja")
# Large enough for the biggest tokenizer.json in use (Gemma's, 33 MiB), small next to any weights.
EXTRA_MAX_BYTES = 64 << 20
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle")
PICKLE_REASON = "pickles, which run code when loaded"
# The Trainer's scheduler.pt and Accelerate's scheduler[_N].bin: a scheduler kept outside the DeepSpeed engine.
SCHEDULER_FILE = re.compile(r"^scheduler(_\d+)?\.(pt|bin)$")
SCHEDULER_IN_INDEX = f"{PICKLE_REASON}; the engine's LR scheduler state is in the index"
SCHEDULER_NOT_IN_INDEX = (f"{PICKLE_REASON}; they hold an LR scheduler's state, which the index does not (the engine "
                          "ran no scheduler): resume from this folder to restore it")
# A link may reach any file on the machine (a key, /etc/passwd): never copied into a checkpoint or an export.
LINK_REASON = "symbolic links, which ucp never follows out of the save folder: copy the file itself there"


def checkpoint_folders(output_dir: str | os.PathLike) -> list[Path]:
    """The `checkpoint-N` folders of a Trainer `output_dir`, by increasing N (directories only)."""
    root = Path(output_dir)
    found = [(int(m.group(1)), root / n) for n in os.listdir(root)
             if (m := CHECKPOINT_RE.search(n)) and (root / n).is_dir()]
    return [path for _, path in sorted(found)]


def last_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The `checkpoint-N` folder of largest N, or None: transformers' `get_last_checkpoint`."""
    folders = checkpoint_folders(output_dir)
    return folders[-1] if folders else None


def folder_names(folders: list[Path]) -> str:
    return ", ".join(f.name for f in folders) or "none"


@dataclass(frozen=True)
class SideFiles:
    """The files of a save directory beside its tag folders: those carried into the ucp checkpoint
    (name -> path) and those left behind worth a word (name -> why). Other files (DeepSpeed's
    `zero_to_fp32.py`, the Trainer's `model.safetensors`) are neither."""

    carried: dict[str, Path] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)


def side_files(save_dir: str | os.PathLike, scheduler_in_index: bool) -> SideFiles:
    """Sort the plain files of `save_dir` into carried and left behind; `scheduler_in_index` says whether the
    checkpoint holds the engine's LR scheduler state, which decides what a scheduler file left behind costs.

    Only a DeepSpeed save directory (one holding `latest`) has side files: a tag folder given on its
    own may sit anywhere, e.g. in a home directory whose files are none of the checkpoint's.
    """
    root = Path(save_dir)
    out = SideFiles()
    if not (root / LATEST_NAME).is_file():
        return out
    for name in sorted(os.listdir(root)):
        path = root / name
        mode = os.lstat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            continue  # folders, and FIFOs or devices, which are never opened
        if name.endswith(PICKLE_SUFFIXES):
            scheduler = SCHEDULER_IN_INDEX if scheduler_in_index else SCHEDULER_NOT_IN_INDEX
            out.left[name] = scheduler if SCHEDULER_FILE.match(name) else PICKLE_REASON
        elif not name.endswith(EXTRA_SUFFIXES) or name.endswith(".index.json"):
            continue  # weights and their shard indexes come from the DeepSpeed files
        elif stat.S_ISLNK(mode):
            out.left[name] = LINK_REASON
        elif is_ucp_file(name):
            out.left[name] = "its name is reserved for ucp's own files"
        elif path.stat().st_size > EXTRA_MAX_BYTES:
            out.left[name] = f"over the {EXTRA_MAX_BYTES >> 20} MiB cap on files carried along"
        else:
            out.carried[name] = path
    return out


def left_out_summary(left: dict[str, str]) -> str:
    """One line: the files left behind, grouped by reason."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in sorted(left.items()):
        by_reason.setdefault(reason, []).append(name)
    return "; ".join(f"{', '.join(names)} ({reason})" for reason, names in by_reason.items())
