"""Resume or start, unattended: which checkpoints of a save folder `"load": "auto"` tries, and what it sets aside.

`"load": "auto"` tries the committed tag folders newest first (`candidates`; listed by
`ucp.format.save_folder`, which says what "committed" and "newest" mean and which folders it passes over) and
sets aside the newer ones that failed (`set_aside`). What `"keep"` removes after each save is
`ucp.elastic.retention`.

The save folder may be a prefix of an object store (`s3://bucket/prefix`): the same rules run over
`ucp.storage.layer` (list, read, copy, delete). There is no rename there: a checkpoint set aside is copied to
`<tag>.damaged/` and deleted.
"""
from __future__ import annotations

import logging

from ucp.format.folder import INDEX_NAME, commit_latest
from ucp.format.save_folder import committed_tags
from ucp.storage.layer import list_folders, list_names, move_tree
from ucp.storage.locations import Location

logger = logging.getLogger("ucp.elastic")


def candidates(save_dir: Location) -> list[Location]:
    """The committed checkpoints of `save_dir`, newest (highest step its index records) first; those passed over
    are named in a warning each (`ucp.format.save_folder`). A save killed between its index and `latest` leaves
    `latest` one behind: the newest committed is still the newest."""
    sound, passed = committed_tags(save_dir)
    for problem in passed:
        logger.warning("ucp: %s", problem)
    return sound


def set_aside(failed: list[Location], loaded: Location) -> list[Location]:
    """After a fallback to `loaded`: rename the newer checkpoints that failed their checks to `<tag>.damaged`
    (kept for a person to look at, never tried or removed again), so that training can save those steps anew,
    and point `latest` at `loaded`. Returns the new names."""
    moved: list[Location] = []
    for tag in failed:
        parent = tag.parent
        taken = set(list_names(parent)) | set(list_folders(parent))
        target_name, n = tag.name + ".damaged", 1
        while target_name in taken:
            target_name, n = f"{tag.name}.damaged{n}", n + 1
        move_tree(tag, parent / target_name, last=INDEX_NAME)
        moved.append(parent / target_name)
    commit_latest(loaded.parent, loaded.name)
    return moved
