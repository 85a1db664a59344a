"""A fragment of a planned state as a torch tensor, for tests that compare with torch references."""
from __future__ import annotations

import torch

from ucp.format.dtypes import to_torch
from ucp.plan.assemble import read_fragment
from ucp.plan.plan import Fragment


def torch_fragment(fragment: Fragment) -> torch.Tensor:
    """`ucp.plan.assemble.read_fragment` (a numpy array, bfloat16 as raw words) as a torch tensor of the piece's
    dtype."""
    return to_torch(read_fragment(fragment), fragment.piece.dtype)
