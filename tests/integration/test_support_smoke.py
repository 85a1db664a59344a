"""Self-test of the checkpoint harness in tests/support (real DeepSpeed on CPU, ~1 min)."""

import math

import pytest
import torch

from support.checkpoints import (
    BUFFER_SHAPES,
    FROZEN_PARAM_SHAPES,
    TRAINABLE_PARAM_SHAPES,
    TinySpec,
    load_ds_universal,
    read_tag,
    resume_losses,
    trained_losses,
    trained_state,
    uninterrupted_losses,
)

SPEC = TinySpec(stage=2, dtype="fp32", world_size=2, optimizer="AdamW", steps=3)
# Relative tolerance for losses of a resumed run vs an uninterrupted one. For this fp32 ZeRO-2 case
# the losses came out bit-identical (DP2 -> universal -> DP3); 1e-6 leaves room for the fp32
# reduction-order noise (~1e-7 relative, seen e.g. when resuming at DP1 or with Adam at DP3) that
# a different DP degree can introduce. bf16 across DP degrees needs ~1e-4 (bf16 gradient reduction).
LOSS_RTOL = 1e-6


@pytest.mark.slow
def test_ds_universal_roundtrip_and_stock_resume(tiny_checkpoint, ds_universal, ckpt_root):
    save_dir = tiny_checkpoint(SPEC)
    assert read_tag(save_dir) == "global_step3"
    tag_files = sorted(p.name for p in (save_dir / "global_step3").iterdir())
    assert tag_files == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]

    out = ds_universal(SPEC)
    assert (out.parent / "latest_universal").read_text().strip() == out.name
    uc = load_ds_universal(out)

    # Every trainable parameter, full shape, all four states; universal equals the live engine's state.
    ref = trained_state(SPEC, ckpt_root)
    assert ref["global_steps"] == SPEC.steps
    for name, shape in TRAINABLE_PARAM_SHAPES.items():
        assert set(uc[name]) == {"fp32", "exp_avg", "exp_avg_sq", "step"}, name
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert tuple(uc[name][key].shape) == shape, (name, key)
            assert uc[name][key].dtype == torch.float32
            torch.testing.assert_close(uc[name][key], ref["params"][name][key], rtol=0, atol=0)
        assert uc[name]["step"].item() == SPEC.steps
    # Frozen params and buffers: DeepSpeed copies their module value into fp32.pt only.
    for name, shape in {**FROZEN_PARAM_SHAPES, **BUFFER_SHAPES}.items():
        assert set(uc[name]) == {"fp32"}, name
        assert tuple(uc[name]["fp32"].shape) == shape
    assert set(uc) == set(TRAINABLE_PARAM_SHAPES) | set(FROZEN_PARAM_SHAPES) | set(BUFFER_SHAPES)

    # Stock DeepSpeed resume from the universal checkpoint at another DP degree (3 ranks).
    resumed = resume_losses(out.parent, out.name, TinySpec(stage=2, world_size=3), steps=2, start_step=3,
                            root=ckpt_root)
    straight = uninterrupted_losses(SPEC, total_steps=5, root=ckpt_root)
    assert len(straight) == 5 and len(resumed) == 2
    # The first 3 steps of the uninterrupted run are those of the saving run (same code, same DP).
    assert straight[:3] == trained_losses(SPEC, ckpt_root)
    for got, want in zip(resumed, straight[3:]):
        assert math.isclose(got, want, rel_tol=LOSS_RTOL, abs_tol=0), (resumed, straight)
