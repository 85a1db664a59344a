"""`ucp.convert.tensors.write_tensors`: in-memory tensors into a ucp checkpoint, read back bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ucp
from ucp.convert.tensors import write_tensors
from ucp.errors import OutputExistsError, UcpError


def test_numpy_and_torch_tensors_read_back_equal_with_their_dtypes(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, generator=g)
    tensors = {"a.weight": {"fp32": w, "exp_avg": torch.randn(3, 5, generator=g)},
               "b.bias": {"fp32": np.arange(4, dtype=np.float32)},
               "c.weight": {"fp32": torch.randn(2, 2, generator=g).to(torch.bfloat16)}}
    optimizer = {"type": "AdamW", "states": ["exp_avg"], "param_groups": [{"hyperparams": {"lr": 0.1},
                                                                          "params": list(tensors)}]}
    ckpt = ucp.open_checkpoint(write_tensors(tmp_path / "out", tensors, optimizer=optimizer, step=3.0))
    assert ckpt.verify() == []
    assert torch.equal(ckpt.tensor("a.weight"), w)
    assert torch.equal(ckpt.tensor("a.weight", "exp_avg"), tensors["a.weight"]["exp_avg"])
    assert torch.equal(ckpt.tensor("b.bias"), torch.arange(4, dtype=torch.float32))
    assert ckpt.tensor("c.weight").dtype == torch.bfloat16
    assert torch.equal(ckpt.tensor("c.weight"), tensors["c.weight"]["fp32"])
    assert ckpt.optimizer["type"] == "AdamW" and ckpt.index.params["a.weight"].step == 3.0


def test_a_non_empty_output_and_a_missing_weight_are_refused(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("x")
    with pytest.raises(OutputExistsError, match="is not empty"):
        write_tensors(tmp_path / "taken", {"w": {"fp32": torch.zeros(2)}})
    assert (tmp_path / "taken" / "mine.txt").read_text() == "x"
    with pytest.raises(UcpError, match="w: no 'fp32' state"):
        write_tensors(tmp_path / "new", {"w": {"exp_avg": torch.zeros(2)}})
    with pytest.raises(UcpError, match="state 'exp_avg' has shape"):
        write_tensors(tmp_path / "new2", {"w": {"fp32": torch.zeros(2), "exp_avg": torch.zeros(3)}})
