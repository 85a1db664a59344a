"""Which tensors `ucp convert --splits K` stores split-major, and along which dim (docs/FORMAT.md, "Splits")."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ucp.errors import UcpError
from ucp.plan.plan import ConversionPlan

# Megatron-style partition dims of Hugging Face Llama / Qwen2 / Mistral parameter names: column-parallel
# and vocab-parallel weights (and their biases) along dim 0, row-parallel weights along dim 1. First match wins;
# anything unmatched (norms, row-parallel biases, buffers) is stored whole.
HF_DECODER_RULES: tuple[tuple[str, int | None], ...] = (
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", 0),
    (r"(o_proj|down_proj)\.weight$", 1),
    (r"(embed_tokens|lm_head)\.weight$", 0),
)


class SplitRuleError(UcpError):
    """A split rule is malformed or asks for a dim a tensor does not have."""


@dataclass(frozen=True)
class SplitPolicy:
    """How `ucp convert --splits K` cuts tensors: `global_split` splits along the dim the first matching rule names."""

    global_split: int
    rules: tuple[tuple[str, int | None], ...] = HF_DECODER_RULES

    def __post_init__(self) -> None:
        if self.global_split < 1:
            raise SplitRuleError(f"--splits {self.global_split}: the split count must be at least 1")
        for pattern, _ in self.rules:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise SplitRuleError(f"split rule '{pattern}': not a regular expression ({exc})") from None

    def dim_for(self, name: str, shape: Sequence[int]) -> int | None:
        for pattern, dim in self.rules:
            if re.search(pattern, name):
                if dim is not None and not 0 <= dim < len(shape):
                    raise SplitRuleError(f"{name}: split rule '{pattern}' names dim {dim}, the tensor has shape "
                                         f"{list(shape)}; fix the rule")
                return dim
        return None


def load_split_rules(path: str | os.PathLike) -> tuple[tuple[str, int | None], ...]:
    """Rules from a JSON object {"regex": dim or null, ...}, tried in file order."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise SplitRuleError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise SplitRuleError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not all(v is None or isinstance(v, int) for v in data.values()):
        raise SplitRuleError(f'{path}: expected an object of regex to dim (or null), e.g. {{"l2\\\\.weight$": 1}}')
    return tuple(data.items())


def apply_split_policy(plan: ConversionPlan, policy: SplitPolicy) -> ConversionPlan:
    """The plan with each parameter's `splits` (dim, count) set where the policy cuts it."""
    params = []
    for p in plan.params:
        dim = policy.dim_for(p.name, p.shape) if policy.global_split > 1 else None
        params.append(dataclasses.replace(p, splits=(dim, policy.global_split)) if dim is not None else p)
    return dataclasses.replace(plan, params=params)
