"""Which node copies in a memory folder a job may use (`ucp.deepspeed.memory.tier`; the tier's configuration is
`ucp.deepspeed.config.MemoryEvery`, the manifest of a copy `ucp.deepspeed.memory.manifest`).

A memory folder is trusted only when it is a folder of this user that no one else may write to: /dev/shm is
writable by all (sticky), so another user could otherwise plant a folder there, or copies in it, before the
job starts. The tier creates its folder private (0700); one of another user, or writable by group or others,
is refused in one line (`ConfigError`) on every rank, before any memory checkpoint is read or written.

A node copy is used only when it is a folder of the memory folder itself (symbolic links are never listed,
so nothing outside the folder is read or removed through one), committed, with a sound manifest, written by
this job (the manifest names the save folder), and its index records the step the manifest and the folder's
name say (`ucp.format.save_folder.indexed_step`). Any other is passed over with a warning naming it.
"""
from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

from ucp.deepspeed.config import MemoryEvery, overlap_problem
from ucp.deepspeed.memory.manifest import Manifest, read_manifest
from ucp.errors import ConfigError, UcpError
from ucp.format.folder import INDEX_NAME, locked_for_removal
from ucp.format.save_folder import (
    foreign_why,
    indexed_step,
    is_ucp_partial,
    pass_over,
    remove_ours,
    save_folder_problem,
    say_once,
    tag_step,
)
from ucp.storage.layer import list_folders

logger = logging.getLogger("ucp.save")


def node_key(folder: Path) -> str:
    """What the ranks of one node share: the host and its memory folder."""
    return f"{socket.gethostname()}:{folder}"


def untrusted(folder: Path) -> str | None:
    """Why this user must not use memory folder `folder` (module docstring), or None (also when it is missing)."""
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(info.st_mode):
        return f"{folder}: not a folder"
    if info.st_uid != os.geteuid():
        return f"{folder}: owned by another user (uid {info.st_uid}); choose a memory \"dir\" of this job's own"
    if info.st_mode & 0o022:
        return (f"{folder}: writable by other users (mode {stat.S_IMODE(info.st_mode):o}); chmod 700 it, or "
                "choose another memory \"dir\"")
    return None


def refuse_untrusted(problems: list[str | None]) -> None:
    """Every rank's `checked_folder` problem, gathered: one `ConfigError` on every rank when any node has one."""
    found = next((p for p in problems if p is not None), None)
    if found is not None:
        raise ConfigError(found)


def read_copies(folder: Path, job: str) -> dict[str, Manifest]:
    """The manifests of this job's usable committed memory checkpoints in `folder`, by tag (module docstring)."""
    out: dict[str, Manifest] = {}
    for name in list_folders(folder):
        tag = folder / name
        if not (tag / INDEX_NAME).is_file():
            continue
        try:
            manifest = read_manifest(tag)
            if manifest.job != job:
                say_once(tag, f"ucp: {tag} is another job's memory checkpoint (of {manifest.job}, not {job}); "
                              "passed over")
                continue
            step = indexed_step(tag)
            if manifest.step != step or manifest.tag != name:
                say_once(tag, f"ucp: {tag}: its manifest says {manifest.tag}, step {manifest.step}, its index step "
                              f"{step}; passed over as damaged, remove the folder")
                continue
        except UcpError as exc:
            logger.warning("ucp: %s", exc)
            continue
        out[name] = manifest
    return out


def remove_copies(folder: Path, job: str, gone: Callable[[int], bool]) -> None:
    """Remove this job's memory checkpoints whose step (as their index records it) is `gone`, and the partial
    ones (no index, ucp's partial-save marker) whose name's step is; never another job's, one passed over, one a
    reader holds (`ucp.format.folder.reading`), anything through a symbolic link, nor any folder that is not
    ucp's, whatever its name (`ucp.format.save_folder`: said once at warning level)."""
    ours = read_copies(folder, job)
    for name in list_folders(folder):
        tag = folder / name
        if name in ours:
            doomed = gone(ours[name].step)
        elif tag_step(tag) < 0 or os.path.lexists(tag / INDEX_NAME):
            doomed = False  # another job's, or passed over by `read_copies`
        elif is_ucp_partial(tag):  # a memory save of ucp's that never committed
            doomed = gone(tag_step(tag))
        else:
            pass_over(tag, foreign_why(tag))
            doomed = False
        if doomed:
            with locked_for_removal(tag) as free:
                if free:
                    remove_ours(tag)


def checked_folder(config: MemoryEvery, create: bool, start_step: int | None = None) -> tuple[Path, str | None]:
    """This node's memory folder (created private when `create`), and why this job may not use it (None when it
    may; the folder is then `dir` unexpanded): gathered from every rank, so that all refuse together
    (`refuse_untrusted`). With `start_step`, also what a save into it would have to write into that is not ucp's
    (`ucp.format.save_folder.save_folder_problem`)."""
    try:
        folder = config.path
        overlap = overlap_problem(folder, config.job)
        if overlap is not None:
            return Path(config.dir), overlap
        if create:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except (ConfigError, OSError) as exc:
        return Path(config.dir), str(exc)
    problem = untrusted(folder)
    if problem is None and start_step is not None:
        problem = save_folder_problem(folder, start_step, say=False)  # the leader says it (remove_copies)
    return folder, None if problem is None else f'"ucp": {{"save": {{"memory": ...}}}}: memory folder {problem}'
