"""The tag folders of a save folder (`"ucp": {"save": {"dir": D}}`): one `global_step<N>` per save, and `latest`.

A tag folder is committed exactly when its index is (`ucp.format.folder`). "Newest" is by the step each index
records (`indexed_step`), never by the folder's name alone: a save names its folder `global_step<step>`, so a
committed folder whose name says another step (`global_step003`, or `global_step99999999999999999999` holding
step 2), or whose index cannot be read, is passed over: never loaded, never removed, left for a person to look
at. Two folders cannot then claim one step. Symbolic links are never listed (`storage.list_folders`), so nothing
outside the save folder is read or removed through one. `ucp.elastic.resume` and `ucp.elastic.retention` both
list a save folder through this module.
"""
from __future__ import annotations

import re

from ucp.errors import CorruptCheckpointError, UcpError
from ucp.format.fields import Fields
from ucp.format.folder import INDEX_NAME, index_max_bytes
from ucp.format.index import FORMAT_NAME, MAX_STEP
from ucp.storage.layer import is_file, list_folders, read_json
from ucp.storage.locations import Location

_STEP_TAG = re.compile(r"global_step(\d+)")


def indexed_step(tag: Location) -> int:
    """The step the committed index of tag folder `tag` records (`training.global_steps`), which must be the
    one its name says, written as a save writes it; else one `CorruptCheckpointError` naming the folder."""
    fix = "ucp passes over it (never loads or removes it): move it out of the folder, or restore it from a copy"
    index = tag / INDEX_NAME
    raw = read_json(index, index_max_bytes(), fix)
    if raw is None:
        raise CorruptCheckpointError(f"{index}: missing; {fix}")
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{index}: not a {FORMAT_NAME} index; {fix}")
    training = Fields("index", raw, index, fix).get("training", (dict,))
    step = Fields("index.training", training, index, fix).count("global_steps", limit=MAX_STEP)
    if tag.name != f"global_step{step}":
        raise CorruptCheckpointError(f"{tag}: its index records step {step}, not the step its name says (a save "
                                     f"names it global_step{step}); {fix}")
    return step


def committed_tags(save_dir: Location) -> tuple[list[Location], list[str]]:
    """The committed tag folders whose index records the step their name says, newest first; and why each other
    committed one is passed over."""
    sound: list[tuple[int, Location]] = []
    passed: list[str] = []
    for tag in step_tags(save_dir):
        if not is_file(tag / INDEX_NAME):
            continue
        try:
            sound.append((indexed_step(tag), tag))
        except UcpError as exc:
            passed.append(str(exc))
    return [tag for _, tag in sorted(sound, key=lambda st: -st[0])], passed


def step_tags(save_dir: Location) -> list[Location]:
    """Every folder of `save_dir` named `global_step<N>`, committed or not."""
    return [save_dir / name for name in list_folders(save_dir) if _STEP_TAG.fullmatch(name) is not None]


def tag_step(tag: Location) -> int:
    """The step a tag folder `global_step<N>` names; -1 for any other name."""
    match = _STEP_TAG.fullmatch(tag.name)
    return int(match.group(1)) if match is not None else -1
