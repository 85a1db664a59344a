"""Issue #11: reading a checkpoint never runs code from it, in any command or format.

DeepSpeed's rank files are pickles. A crafted one (here: an object whose unpickling creates a marker
file) must pass through `ucp convert` (both formats), `ucp inspect`, `ucp verify` and
`ucp.open_checkpoint` without its payload running.
"""
from __future__ import annotations

import shutil

import pytest
import torch

import ucp
from support.checkpoints import TinySpec, read_tag, ucp_load_errors
from support.payload import plant
from ucp.cli.main import main

SPEC = TinySpec(stage=1)


@pytest.fixture
def crafted(tiny_checkpoint, tmp_path):
    """A copy of a real ZeRO-1 checkpoint with a payload in every rank file: each optimizer file's loss
    scaler, and a client key of the model-states file."""
    source = tmp_path / "src"
    shutil.copytree(tiny_checkpoint(SPEC), source)
    tag = source / read_tag(source)
    marker = tmp_path / "payload-ran"
    for rank in range(SPEC.world_size):
        plant(tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", marker, "optimizer_state_dict", "loss_scaler")
    plant(tag / "mp_rank_00_model_states.pt", marker, "payload")
    return source, marker


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_payload_runs_under_torch_load(crafted):
    # Negative control: the crafted files do run their payload when unpickled as the old code did.
    source, marker = crafted
    optim = source / read_tag(source) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.load(optim, map_location="cpu", weights_only=False)
    assert marker.exists()


def test_no_command_runs_the_payload(crafted, tmp_path, capsys):
    source, marker = crafted
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", "--input", str(source), "--output", str(out), "--quiet",
                           "--workers", "1")
    assert code == 0, err
    assert run_cli(capsys, "verify", str(out))[0] == 0
    assert str(marker) in ucp.open_checkpoint(out).client_state["payload"]  # recorded as data, never called

    tag = read_tag(source)
    code, _, err = run_cli(capsys, "convert", "--input", str(source), "--output", str(tmp_path / "uc" / tag),
                           "--format", "deepspeed", "--quiet", "--workers", "1")
    # The loss scaler is rebuilt for DeepSpeed's own classes only: a one-line error naming the file.
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert str(source / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt") in lines[0]
    assert "loss_scaler" in lines[0] and "posix.system" in lines[0]

    for argv in (["inspect", str(source)], ["inspect", str(source), "--json"], ["inspect", str(out)],
                 ["verify", str(source)]):
        assert run_cli(capsys, *argv)[0] == 0
    ckpt = ucp.open_checkpoint(source)
    assert torch.equal(ckpt.tensor("emb.weight"), ucp.open_checkpoint(out).tensor("emb.weight"))
    assert not marker.exists()


def test_the_hook_reading_a_crafted_deepspeed_checkpoint_runs_no_payload(crafted, ckpt_root):
    """ucp.deepspeed.load of the DeepSpeed checkpoint itself (zero-conversion) on 2 ranks."""
    source, marker = crafted
    [result] = ucp_load_errors([source], SPEC, ckpt_root)
    assert result["errors"] == [None, None]  # loaded: the payload is inert data (fp32 training has no loss scaler)
    assert not marker.exists()
