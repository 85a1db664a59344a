"""A DCP checkpoint's contents, leaf by leaf, read back by DCP's own converter (`dcp_to_torch_save`): what two
exports are compared by, wherever they were written."""
from __future__ import annotations

from pathlib import Path

import torch


def leaves(tree: object, at: str = "") -> dict[str, object]:
    """The leaves of nested dicts and lists, by path."""
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in leaves(value, f"{at}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in leaves(value, f"{at}/{i}").items()}
    return {at: tree}


def dcp_leaves(folder: Path, scratch: Path) -> dict[str, object]:
    """The DCP checkpoint in local `folder`, converted to one torch file in `scratch` and flattened."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = scratch / f"{folder.name}.pt"
    dcp_to_torch_save(folder, whole)
    return leaves(torch.load(whole, weights_only=False))


def assert_same_leaves(got: dict[str, object], want: dict[str, object]) -> None:
    """The same paths, tensors `torch.equal` and other leaves equal."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        same = torch.equal(got[key], value) if torch.is_tensor(value) else got[key] == value
        assert same, key
