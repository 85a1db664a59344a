"""The "ucp" section of a DeepSpeed config is checked before DeepSpeed runs, and the caller's config stays as given."""
from __future__ import annotations

import copy
import types

import pytest
import torch

import ucp.deepspeed
from ucp.deepspeed.config import load_options, ucp_options, without_ucp
from ucp.errors import ConfigError


@pytest.mark.parametrize("section,message", [
    ({"lod": "/ckpt"}, 'unknown key "lod"; did you mean "load"?'),
    ({"strict": "yes"}, '"strict": \'yes\'}: must be bool'),
    ({"load": 3}, "must be the path of a checkpoint"),
    ({"layout": 5}, "must be dict or str or PathLike"),
    ({"check_keep_bytes": -1}, '"check_keep_bytes": -1}: must be a number of bytes, 0 or more'),
    ({"check_keep_bytes": True}, "must be a number of bytes"),
    ({"check_keep_bytes": 1.5}, "must be int"),
    ([], "must be an object"),
])
def test_bad_sections_are_one_clear_error(section, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        ucp_options({"ucp": section})


def test_good_section_splits_into_load_options():
    options = ucp_options({"train_batch_size": 2, "ucp": {"load": "/ckpt", "strict": False, "bypass": True,
                                                          "check_keep_bytes": 0}})
    assert load_options(options) == {"strict": False, "bypass": True, "check_keep_bytes": 0}
    assert without_ucp({"train_batch_size": 2, "ucp": {}}) == {"train_batch_size": 2}
    assert ucp_options({"train_batch_size": 2}) == {}


def test_initialize_refuses_a_typo_before_deepspeed_runs(monkeypatch):
    import deepspeed

    def must_not_run(*args, **kwargs):
        raise AssertionError("deepspeed.initialize ran before the ucp section was checked")

    monkeypatch.setattr(deepspeed, "initialize", must_not_run)
    config = {"train_batch_size": 2, "ucp": {"laod": "/ckpt"}}
    given = copy.deepcopy(config)
    with pytest.raises(ConfigError, match='did you mean "load"'):
        ucp.deepspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert config == given


def test_initialize_leaves_the_callers_config_and_args_as_given(monkeypatch):
    import deepspeed

    seen = {}

    def fake_initialize(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        return ("engine", None, None, None)

    monkeypatch.setattr(deepspeed, "initialize", fake_initialize)
    config = {"train_batch_size": 2, "ucp": {"bypass": True}}
    cli_args = types.SimpleNamespace(deepspeed_config={"train_batch_size": 2, "ucp": {}})
    ucp.deepspeed.initialize(cli_args, model=torch.nn.Linear(2, 2), config=config)
    assert config == {"train_batch_size": 2, "ucp": {"bypass": True}}          # the caller's dict untouched
    assert "ucp" not in seen["kwargs"]["config"]                                # DeepSpeed never sees the section
    assert cli_args.deepspeed_config == {"train_batch_size": 2, "ucp": {}}      # nor the caller's args


def test_elastic_sets_deepspeeds_batch_keys_for_this_world_size(monkeypatch):
    """"elastic" replaces the batch keys DeepSpeed checks (micro x accumulation x world) before it runs."""
    import deepspeed

    seen = {}

    def stop(*args, **kwargs):
        seen.update(kwargs["config"])
        raise RuntimeError("stop here")

    monkeypatch.setattr(deepspeed, "initialize", stop)
    monkeypatch.setenv("WORLD_SIZE", "3")
    config = {"train_batch_size": 12, "ucp": {"elastic": {"global_batch": 10, "micro_batch": 2}}}
    with pytest.raises(RuntimeError, match="stop here"):
        ucp.deepspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert (seen["train_batch_size"], seen["train_micro_batch_size_per_gpu"], seen["gradient_accumulation_steps"]) == \
        (12, 2, 2)  # shares 4, 3, 3 in 2 micro-batches of at most 2, on 3 ranks


@pytest.mark.parametrize("section,message", [
    ({"load": "auto"}, '"load": "auto"} resumes from the save folder: add "save"'),
    ({"save": {"dir": "/c", "every": 1, "keep": 0}}, '"keep": 0}}: must be a positive number of checkpoints'),
    ({"save": {"dir": "/c", "every": 1, "kept": 2}}, "unknown key 'kept'"),
    ({"elastic": {"global_batch": 10}}, 'needs "global_batch"'),
])
def test_auto_keep_and_elastic_mistakes_are_one_clear_error(monkeypatch, section, message):
    import deepspeed

    monkeypatch.setattr(deepspeed, "initialize", lambda *a, **k: pytest.fail("DeepSpeed ran"))
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        ucp.deepspeed.initialize(model=torch.nn.Linear(2, 2), config={"ucp": section})
