"""`--format deepspeed`'s `zero/optimizer_state.pt` from a rank-0 optimizer file whose global state is not shaped
as DeepSpeed writes it: one CorruptCheckpointError naming the file, never an AttributeError (found by mypy)."""
from __future__ import annotations

import pytest
import torch

from ucp.convert.deepspeed_format import _save_optimizer_state
from ucp.errors import CorruptCheckpointError
from ucp.plan.plan import ConversionPlan

GROUPS = [{"lr": 0.1, "params": [0]}]


def plan_of(tmp_path, optimizer_state_dict: dict) -> ConversionPlan:
    rank0 = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": optimizer_state_dict}, rank0)
    return ConversionPlan(params=[], source={}, optimizer=None, source_files=[str(rank0)])


@pytest.mark.parametrize("zero3, state", [
    (True, {"optimizer_state_dict": {"state": [], "param_groups": GROUPS}}),  # state a list, not a dict
    (True, {"optimizer_state_dict": [{"state": {}}]}),
    (False, {"base_optimizer_state": [{"state": {}}]}),  # a list, as DeepSpeed's elastic_checkpoint saves it
    (False, {"base_optimizer_state": {"state": {}, "param_groups": {"lr": 0.1}}}),
])
def test_a_misshapen_global_state_is_one_clear_error(tmp_path, zero3, state):
    with pytest.raises(CorruptCheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt: optimizer state"):
        _save_optimizer_state(plan_of(tmp_path, state), tmp_path / "optimizer_state.pt", zero3)


@pytest.mark.parametrize("zero3, state", [
    (True, {"optimizer_state_dict": {"state": {0: {"step": 3}}, "param_groups": GROUPS}}),
    (False, {"base_optimizer_state": {"state": {}, "param_groups": GROUPS}}),
])
def test_a_well_shaped_global_state_is_written(tmp_path, zero3, state):  # the negative control
    _save_optimizer_state(plan_of(tmp_path, state), tmp_path / "optimizer_state.pt", zero3)
    saved = torch.load(tmp_path / "optimizer_state.pt", weights_only=True)
    groups = saved["optimizer_state_dict"]["param_groups"] if zero3 else saved["param_groups"]
    assert groups == GROUPS
