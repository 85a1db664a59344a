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
    ([], "must be an object"),
])
def test_bad_sections_are_one_clear_error(section, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        ucp_options({"ucp": section})


def test_good_section_splits_into_load_options():
    options = ucp_options({"train_batch_size": 2, "ucp": {"load": "/ckpt", "strict": False, "bypass": True}})
    assert load_options(options) == {"strict": False, "bypass": True}
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
