"""Export a ucp or DeepSpeed checkpoint for other tools: `to_hf` writes a transformers-ready folder
(`save_pretrained` layout), `to_dcp` a `torch.distributed.checkpoint` folder of model and optimizer
state keyed by FQN. Both stream tensor by tensor and commit by renaming a finished folder.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ucp.export.dcp import DcpExport
    from ucp.export.hf import HfExport

__all__ = ["to_dcp", "to_hf"]


def to_hf(input: str | os.PathLike[str], output: str | os.PathLike[str], **options: Any) -> HfExport:
    """See `ucp.export.hf.to_hf`."""
    from ucp.export.hf import to_hf as _to_hf

    return _to_hf(input, output, **options)


def to_dcp(input: str | os.PathLike[str], output: str | os.PathLike[str], **options: Any) -> DcpExport:
    """See `ucp.export.dcp.to_dcp`."""
    from ucp.export.dcp import to_dcp as _to_dcp

    return _to_dcp(input, output, **options)
