"""One typed model of the index for writing and reading: what a writer builds is what a reader parses."""
import dataclasses
import json

import numpy as np
import pytest

from ucp.convert.split_policy import SplitPolicy
from ucp.convert.tensors import write_tensors
from ucp.errors import CorruptCheckpointError
from ucp.format.folder import INDEX_NAME, commit_index, read_index
from ucp.format.index import index_json, parse_index

OPTIMIZER = {"type": "AdamW", "states": ["exp_avg"], "param_groups": [{"hyperparams": {"lr": 0.1},
                                                                      "params": ["a.weight", "b.weight"]}]}


def _written(tmp_path, splits=None):
    rng = np.random.default_rng(0)
    tensors = {name: {"fp32": rng.standard_normal(shape, dtype=np.float32),
                      "exp_avg": rng.standard_normal(shape, dtype=np.float32)}
               for name, shape in (("a.weight", (4, 6)), ("b.weight", (6,)))}
    return write_tensors(tmp_path / "ckpt", tensors, optimizer=OPTIMIZER, step=5.0, splits=splits)


@pytest.mark.parametrize("splits", [None, SplitPolicy(2, ((r"a\.weight", 1), (r".*", 0)))], ids=["whole", "split"])
def test_the_json_a_writer_commits_parses_into_a_model_that_stores_it_again_unchanged(tmp_path, splits):
    folder = _written(tmp_path, splits)
    raw = json.loads((folder / INDEX_NAME).read_text())
    index = parse_index(raw, folder)
    assert index_json(index) == raw
    assert parse_index(index_json(index), folder) == index
    entry = index.params["a.weight"]
    assert entry.step == 5.0 and entry.group == 0 and entry.kind == "param" and entry.pattern["pattern"] == "unique"
    assert index.run.optimizer == OPTIMIZER and index.created_by.startswith("ucp ")
    assert index.global_split == (1 if splits is None else 2)
    assert entry.states["fp32"].splits == (None if splits is None else (1, 2))


def test_a_model_committed_again_is_read_back_equal(tmp_path):
    folder = _written(tmp_path)
    index = read_index(folder)
    edited = dataclasses.replace(index, aliases={"c.weight": "a.weight"},
                                 run=dataclasses.replace(index.run, client_state={"marker": 7}))
    commit_index(folder, edited)
    assert read_index(folder) == edited
    assert read_index(folder).entry("c.weight") == index.params["a.weight"]


def test_a_model_naming_a_missing_parameter_as_an_alias_is_refused_on_reading(tmp_path):
    folder = _written(tmp_path)
    index = read_index(folder)
    commit_index(folder, dataclasses.replace(index, aliases={"c.weight": "z.weight"}))
    with pytest.raises(CorruptCheckpointError, match=r"aliases\['c.weight'\] must name a stored parameter"):
        read_index(folder)


def test_what_the_checkpoint_does_not_hold_is_read_back_and_checked(tmp_path):
    from ucp.format.index import NotSaved

    folder = _written(tmp_path)
    index = read_index(folder)
    left_out = NotSaved("frozen", "exclude_frozen_parameters", ("emb.weight", "head.weight"))
    commit_index(folder, dataclasses.replace(index, run=dataclasses.replace(index.run, not_saved=left_out)))
    assert read_index(folder).run.not_saved == left_out
    assert str(left_out) == "frozen, not saved: exclude_frozen_parameters"
    for bad, where in [(NotSaved("buffer", "x"), r"not_saved.kind 'buffer'"),
                       (NotSaved("frozen", "x", ("a.weight",)), "not_saved.names must list names of parameters the "
                                                                  "checkpoint does not hold")]:
        commit_index(folder, dataclasses.replace(index, run=dataclasses.replace(index.run, not_saved=bad)))
        with pytest.raises(CorruptCheckpointError, match=where):
            read_index(folder)


@pytest.mark.parametrize("field, value, problem", [
    (("params", "a.weight", "step"), float("nan"), "step nan is not a step count"),
    (("params", "a.weight", "step"), -1, "step -1 is not a step count"),
    (("params", "a.weight", "step"), 1e308, r"step 1e\+308 is not a step count"),
    (("params", "a.weight", "step"), 2.5, "step 2.5 is not a step count"),
    (("params", "a.weight", "group"), 99, "group 99 is not one of the optimizer's 1 param groups"),
    (("optimizer", "param_groups", 0, "params"), ["a.weight", "zz"], r"params names 'zz', which is not a trainable"),
    (("optimizer", "param_groups"), [{"hyperparams": {}, "params": ["a.weight"]},
                                     {"hyperparams": {}, "params": ["b.weight"]}], "params names 'b.weight'"),
], ids=["nan-step", "negative-step", "huge-step", "fractional-step", "group-99", "unknown-name", "other-group"])
def test_hostile_steps_and_groups_are_refused(tmp_path, field, value, problem):
    """What the hook installs as optimizer steps and group hyper-parameters (#21): a step of NaN, -1 or 1e308
    was accepted, and so were a parameter's group index 99 and a group naming unknown parameters."""
    folder = _written(tmp_path)
    raw = json.loads((folder / INDEX_NAME).read_text())
    parse_index(raw, folder)  # negative control: the index as written
    parent = raw
    for key in field[:-1]:
        parent = parent[key]
    parent[field[-1]] = value
    with pytest.raises(CorruptCheckpointError, match=f"{INDEX_NAME}: .*{problem}"):
        parse_index(raw, folder)
