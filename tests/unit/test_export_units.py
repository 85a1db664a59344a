"""The pure parts of `ucp export`: shard sizes, shard packing, and the staged commit of an output folder."""
from __future__ import annotations

import pytest

from ucp.errors import ExportError, OutputExistsError
from ucp.export.hf import ExportTensor, assign_shards, shard_name
from ucp.export.staging import parse_size, staged_output
from ucp.format.safetensors_stream import TensorSlot


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30),
                                        ("4kb", 4000), ("1.5GB", 15 * 10**8), ("123", 123), (77, 77)])
def test_parse_size_reads_transformers_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "0", "5 parsecs"])
def test_parse_size_refuses_what_is_not_a_size(text):
    with pytest.raises(ExportError, match="--max-shard-size"):
        parse_size(text)


def tensors(*numels: int) -> list[ExportTensor]:
    return [ExportTensor(f"t{i}", "fp32", TensorSlot(f"t{i}", "float32", (n,))) for i, n in enumerate(numels)]


def test_shards_keep_order_and_stay_under_the_limit_unless_one_tensor_is_larger():
    shards = assign_shards(tensors(10, 10, 10, 40, 5), max_bytes=80)  # float32: 40, 40, 40, 160, 20 bytes
    assert [[t.name for t in s] for s in shards] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert [[t.name for t in s] for s in assign_shards(tensors(10, 10), max_bytes=10**9)] == [["t0", "t1"]]


def test_shard_names_follow_transformers():
    assert shard_name(0, 1) == "model.safetensors"
    assert [shard_name(i, 2) for i in range(2)] == ["model-00001-of-00002.safetensors",
                                                     "model-00002-of-00002.safetensors"]


def test_a_staged_output_appears_only_when_complete(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with staged_output(out, "config.json") as staging:
            (staging / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    with staged_output(out, "config.json") as staging:
        assert list(out.iterdir()) == []  # only the empty folder the writer holds locked
        (staging / "config.json").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "config.json").read_text() == "{}"


def test_a_staged_output_may_replace_an_empty_folder_but_nothing_else(tmp_path):
    (tmp_path / "empty").mkdir()
    with staged_output(tmp_path / "empty", "config.json") as staging:
        (staging / "a").write_text("x")
    assert (tmp_path / "empty" / "a").read_text() == "x"
    (tmp_path / "file").write_text("mine")
    for taken in ("empty", "file"):
        with pytest.raises(OutputExistsError, match=f"{tmp_path / taken}: already exists"):
            with staged_output(tmp_path / taken, "config.json"):
                pass
    assert (tmp_path / "file").read_text() == "mine"


# ---- the param groups of a DCP export, keyed for torch's optimizer (ucp.export.optimizer) ----------------------

FUSED_ADAM_GROUP = {"lr": 0.01, "bias_correction": True, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                    "step": 0}  # what DeepSpeed's FusedAdam keeps in a param group


def fused_adam(config_type: str = "AdamW", **params) -> dict:
    """The index's optimizer record of a DeepSpeed run of its own Adam with `params` in the config."""
    from ucp.format.optimizer import optimizer_record

    groups = [{"hyperparams": {**FUSED_ADAM_GROUP, **params.pop("group", {})}, "params": ["w"]}]
    return optimizer_record({"type": config_type, "params": params}, groups, ["exp_avg", "exp_avg_sq"])


@pytest.mark.parametrize("cls", ["AdamW", "Adam"])
def test_deepspeed_adam_groups_take_every_key_of_torchs_class(cls):
    import torch

    from ucp.export.optimizer import export_groups

    optimizer = fused_adam("AdamW")
    (group,) = export_groups(optimizer, f"torch.optim.{cls}", "ckpt")
    torch_keys = getattr(torch.optim, cls)([torch.nn.Parameter(torch.zeros(1))]).param_groups[0].keys()
    assert torch_keys <= group.keys()
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.01, [0.9, 0.95], 1e-8, 0.1)
    assert (group["decoupled_weight_decay"], group["amsgrad"], group["maximize"]) == (True, False, False)
    assert group["params"] == ["w"]


@pytest.mark.parametrize("record, key", [
    (dict(config_type="Adam", adam_w_mode=False), "adam_w_mode"),
    (dict(group={"bias_correction": False}), "bias_correction"),
])
def test_torch_adamw_is_refused_where_its_update_differs(record, key):
    from ucp.export.optimizer import export_groups

    with pytest.raises(ExportError, match=key):
        export_groups(fused_adam(**record), "torch.optim.AdamW", "ckpt")


def test_l2_adam_without_weight_decay_is_adamw():
    from ucp.export.optimizer import export_groups

    (group,) = export_groups(fused_adam("Adam", adam_w_mode=False, group={"weight_decay": 0.0}), "torch.optim.AdamW",
                             "ckpt")
    assert group["weight_decay"] == 0.0


@pytest.mark.parametrize("keys, kind", [
    ({"decoupled_weight_decay": True}, "AdamW"), ({"decoupled_weight_decay": False}, "Adam"), ({}, "unknown")])
def test_a_client_torch_optimizer_is_named_by_its_param_group_keys(keys, kind):
    from ucp.format.optimizer import optimizer_record

    hyper = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
             "maximize": False, **keys}
    record = optimizer_record(None, [{"hyperparams": hyper, "params": ["w"]}], ["exp_avg", "exp_avg_sq"])
    assert record["type"] == kind
    assert record.get("adam_w_mode") == keys.get("decoupled_weight_decay")


GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 16, "n_head": 2, "n_layer": 2,
        "vocab_size": 32, "n_positions": 16}


@pytest.mark.parametrize("change, problem", [
    ({"architectures": ["pipeline"]}, "'pipeline' is not a model class of transformers"),
    ({"architectures": [5]}, "'architectures' must be a list of model class names"),
    ({"architectures": ["AutoModel"]}, "'AutoModel' is not a model class"),
    ({"n_embd": -1}, "GPT2LMHeadModel cannot be built from it"),
    ({"n_layer": 10 ** 7}, "n_layer=10000000 is not a count of layers"),
    ({"text_config": {"num_local_experts": 10 ** 6}}, "num_local_experts=1000000 is not a count of experts"),
], ids=["pipeline", "not-a-name", "auto-class", "negative-width", "ten-million-layers", "nested-experts"])
def test_a_hostile_model_config_is_one_error_in_bounded_time(tmp_path, change, problem):
    """What `ucp export` builds on the meta device to learn the architecture's keys (#21): these values gave
    tracebacks, and 10**7 layers built for hours."""
    import time
    from pathlib import Path

    from ucp.errors import UcpError
    from ucp.export.model_config import ModelConfig, model_keys

    path = Path(tmp_path / "config.json")
    assert model_keys(ModelConfig(path, GPT2)).architecture == "GPT2LMHeadModel"  # negative control
    start = time.monotonic()
    with pytest.raises(UcpError, match=f"{path}: .*{problem}.*--config"):
        model_keys(ModelConfig(path, {**GPT2, **change}))
    assert time.monotonic() - start < 30
