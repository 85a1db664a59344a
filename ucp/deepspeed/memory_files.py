"""The host-memory tier's configuration, and which node copies in a memory folder a job may use
(`ucp.deepspeed.memory_tier`; the manifest of a copy: `ucp.deepspeed.memory_manifest`).

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

import hashlib
import logging
import os
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ucp.deepspeed.memory_manifest import Manifest, read_manifest
from ucp.errors import ConfigError, UcpError, UnsupportedStorageError
from ucp.format.folder import INDEX_NAME, local_path, locked_for_removal
from ucp.format.locations import url_scheme
from ucp.format.ownership import (
    foreign_why,
    is_ucp_partial,
    pass_over,
    remove_ours,
    save_folder_problem,
    say_once,
)
from ucp.format.save_folder import indexed_step, tag_step
from ucp.format.storage import list_folders

logger = logging.getLogger("ucp.save")


@dataclass(frozen=True)
class MemoryEvery:
    """The `"memory"` section of `"ucp": {"save": ...}`: a memory save after every `every`-th step, each node
    keeping copies of `replicas` other nodes' pieces, in `dir` (expanded on each node); `job` is the identity
    of the disk save folder (its absolute path, or its URL), recorded in every manifest."""

    every: int
    replicas: int
    dir: str
    job: str

    @classmethod
    def from_config(cls, options: object, save_dir: str) -> MemoryEvery:
        example = '{"every": 50, "replicas": 1}'
        if not isinstance(options, dict):
            raise ConfigError(f'"ucp": {{"save": {{"memory": {options!r}}}}}: must be an object such as {example}')
        unknown = set(options) - {"every", "replicas", "dir"}
        if unknown:
            raise ConfigError(f'"ucp": {{"save": {{"memory": ...}}}}: unknown key {sorted(unknown)[0]!r}; known: '
                              '"every", "replicas", "dir"')
        every, replicas = options.get("every"), options.get("replicas", 1)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f'"ucp": {{"save": {{"memory": {{"every": {every!r}}}}}}}: must be a positive number '
                              f"of optimizer steps, e.g. {example}")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ConfigError(f'"ucp": {{"save": {{"memory": {{"replicas": {replicas!r}}}}}}}: must be the number of '
                              "other nodes that keep a copy of each node's pieces, 0 or more (1 survives the loss "
                              "of any one node)")
        job = save_dir if url_scheme(save_dir) else os.path.realpath(save_dir)  # s3://...: the same on every node
        folder = options.get("dir")
        if folder is None:
            folder = f"/dev/shm/ucp-{hashlib.sha256(job.encode()).hexdigest()[:12]}"
        try:
            if not isinstance(folder, (str, os.PathLike)):
                raise TypeError(folder)
            local_path(folder)
        except (TypeError, UnsupportedStorageError):
            raise ConfigError(f'"ucp": {{"save": {{"memory": {{"dir": {folder!r}}}}}}}: must be a local folder in '
                              'host memory, e.g. "/dev/shm/ucp-myjob"') from None
        if not os.fspath(folder).startswith(("/", "$")):  # "", "shm/x", "~": the working or home directory
            raise ConfigError(f'"ucp": {{"save": {{"memory": {{"dir": {os.fspath(folder)!r}}}}}}}: must be an '
                              'absolute path of a folder of its own, e.g. "/dev/shm/ucp-myjob" ("~" is not '
                              'expanded; "$VARS" are)')
        return cls(every, replicas, os.fspath(folder), job)

    @property
    def path(self) -> Path:
        """This node's memory folder; one that expands to a relative path (an unset `$VAR`) is refused."""
        expanded = os.path.expandvars(self.dir)
        if not os.path.isabs(expanded):
            raise ConfigError(f'"ucp": {{"save": {{"memory": {{"dir": {self.dir!r}}}}}}}: expands to {expanded!r} '
                              "on this node, not an absolute path; set the variables it names")
        return Path(expanded).resolve()


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
    ucp's, whatever its name (`ucp.format.ownership`: said once at warning level)."""
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
    (`ucp.format.ownership.save_folder_problem`)."""
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

def overlap_problem(folder: Path, job: str) -> str | None:
    """Why memory folder `folder` may not be used beside save folder `job`: the same folder, inside it or holding
    it (each tier removes its own checkpoints by the same names), or None."""
    if url_scheme(job):
        return None
    mem, disk = os.path.realpath(folder), os.path.realpath(job)
    if mem == disk or mem.startswith(disk.rstrip("/") + "/") or disk.startswith(mem.rstrip("/") + "/"):
        return (f'"ucp": {{"save": {{"memory": {{"dir": ...}}}}}}: {folder} is the save "dir" {job}, inside it or '
                'holds it; the memory tier needs a folder of its own, e.g. "/dev/shm/ucp-myjob"')
    return None
