"""ucp's fp16 code paths on every CPU, without a DeepSpeed fp16 run.

DeepSpeed trains fp16 on CPU only where oneDNN has fp16 kernels (see support/fp16.py), so the suite's
fp16 runs skip elsewhere. What ucp does differently for fp16 is covered here on any CPU:

* convert: the module state in fp16 (frozen parameters), the fp16 config, and the dynamic loss
  scaler pickled in every optimizer file. The checkpoint is a real bf16 ZeRO-1 checkpoint rewritten
  the way DeepSpeed's fp16 engine writes the same files (module tensors in fp16, `fp16` config,
  a real `DynamicLossScaler` in the optimizer state); its fp32 masters and moments are unchanged.
* hook and async save: the loss-scaler record read from, and restored into, DeepSpeed's own
  `DynamicLossScaler`.
"""
from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

import ucp
from support.checkpoints import FROZEN_PARAM_SHAPES, TRAINABLE_PARAM_SHAPES, TinySpec, read_tag
from ucp.convert import convert
from ucp.format import loss_scale

BF16_SOURCE = TinySpec(stage=1, dtype="bf16", world_size=3)
SCALER_STATE = {"cur_scale": 512.0, "cur_iter": 7, "last_overflow_iter": 3, "cur_hysteresis": 2}


def dynamic_scaler(**state):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(init_scale=2 ** 8, scale_window=100, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)
    for key, value in state.items():
        setattr(scaler, key, value)
    return scaler


def fp32_masters(tag_dir: Path) -> dict[str, torch.Tensor]:
    """Each trainable parameter's fp32 master, flat, joined from the ZeRO-1/2 rank files' partitions in rank order."""
    pieces: dict[str, list[torch.Tensor]] = {}
    for path in sorted(tag_dir.glob("*optim_states.pt")):
        osd = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        for flat, mapping in zip(osd["single_partition_of_fp32_groups"], osd["param_slice_mappings"]):
            for name, address in mapping.items():
                pieces.setdefault(name, []).append(flat.narrow(0, address.start, address.numel))
    return {name: torch.cat(parts) for name, parts in pieces.items()}


def as_fp16_checkpoint(save_dir: Path, out: Path) -> Path:
    """`save_dir` (bf16 ZeRO-1/2) rewritten as DeepSpeed's fp16 engine writes the same training state: its module
    holds the fp32 masters cast to fp16 (frozen parameters, which have none, their bf16 values in fp16)."""
    tag = read_tag(save_dir)
    (out / tag).mkdir(parents=True)
    (out / "latest").write_text(tag)
    masters = fp32_masters(save_dir / tag)
    for path in sorted((save_dir / tag).iterdir()):
        state = torch.load(path, map_location="cpu", weights_only=False)  # the suite's own training run
        if path.name.endswith("model_states.pt"):
            state["module"] = {k: masters[k].reshape(v.shape).half() if k in masters else
                               v.half() if v.dtype == torch.bfloat16 else v for k, v in state["module"].items()}
            state["ds_config"] = {**state["ds_config"], "bf16": {"enabled": False},
                                  "fp16": {"enabled": True, "initial_scale_power": 8}}
        else:
            osd = state["optimizer_state_dict"]
            osd.update(loss_scaler=dynamic_scaler(**SCALER_STATE), dynamic_loss_scale=True, overflow=False)
        torch.save(state, out / tag / path.name.removeprefix("bf16_"))
    return out


@pytest.fixture(scope="module")
def converted_pair(tiny_checkpoint, tmp_path_factory):
    """(the bf16 source converted, its fp16 rewrite converted, the fp16 rewrite's save dir)."""
    root = tmp_path_factory.mktemp("fp16")
    source = tiny_checkpoint(BF16_SOURCE)
    fp16_dir = as_fp16_checkpoint(source, root / "fp16")
    convert(source, root / "bf16-ucp", workers=2, progress=False)
    convert(fp16_dir, root / "fp16-ucp", workers=2, progress=False)
    return ucp.open_checkpoint(root / "bf16-ucp"), ucp.open_checkpoint(root / "fp16-ucp"), fp16_dir


def test_convert_records_fp16_precision_and_loss_scale(converted_pair):
    _, fp16, _ = converted_pair
    assert fp16.source["precision"] == "fp16"
    assert fp16.training["loss_scaler"] == SCALER_STATE


def test_convert_keeps_fp32_masters_and_moments_of_an_fp16_run(converted_pair):
    bf16, fp16, _ = converted_pair
    for name in TRAINABLE_PARAM_SHAPES:
        for state in ("fp32", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fp16.tensor(name, state), bf16.tensor(name, state)), (name, state)


def test_convert_keeps_fp16_frozen_parameters_in_fp16(converted_pair):
    bf16, fp16, fp16_dir = converted_pair
    for name in FROZEN_PARAM_SHAPES:
        got = fp16.tensor(name, "fp32")
        assert fp16.index.params[name].model_dtype == "float16"
        assert torch.equal(got.float(), bf16.tensor(name, "fp32").half().float()), name
    # The planned (zero-conversion) reader agrees with the converted checkpoint.
    planned = ucp.open_checkpoint(fp16_dir)
    for name in fp16.names:
        for state in fp16.states(name):
            assert torch.equal(planned.tensor(name, state), fp16.tensor(name, state)), (name, state)


def test_hook_restores_the_loss_scale_into_deepspeeds_scaler(converted_pair):
    from ucp.deepspeed.loading.load import _restore_loss_scale

    _, fp16, _ = converted_pair
    scaler = dynamic_scaler()
    engine = types.SimpleNamespace(optimizer=types.SimpleNamespace(loss_scaler=scaler))
    _restore_loss_scale(fp16, engine)
    assert {k: getattr(scaler, k) for k in SCALER_STATE} == SCALER_STATE


def test_async_save_record_round_trips_through_deepspeeds_scaler():
    saved = loss_scale.record_live(dynamic_scaler(**SCALER_STATE))
    assert saved == SCALER_STATE
    fresh = dynamic_scaler()
    loss_scale.restore(saved, fresh)
    assert loss_scale.record_live(fresh) == SCALER_STATE
    # Another run's scale differs: the record is not a constant.
    assert loss_scale.record_live(dynamic_scaler()) != SCALER_STATE


def test_loss_scaler_of_an_optimizer_wrapper():
    scaler = dynamic_scaler()
    assert loss_scale.live_scaler(types.SimpleNamespace(loss_scaler=scaler)) is scaler
    assert loss_scale.live_scaler(types.SimpleNamespace()) is None
