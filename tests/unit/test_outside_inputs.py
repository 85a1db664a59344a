"""What the outside checks of issue #43 found in the files and config values ucp reads but does not own (parts 3
and 5): each case one exact line (no traceback, no hang, no loop sized by a claimed number), and layouts that
cannot be right refused for the true reason. No training: layouts, indexes' sources and configs as values."""
from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest

import ucp.accelerate.state_folders as state_folders
from ucp.checkpoint import source_world_size
from ucp.deepspeed.engine.placement import as_layout
from ucp.elastic.hf_trainer import TRAINER_KEYS
from ucp.elastic.layout_choice import (
    choose_layout,
    cost_model_replicas,
    cost_model_step_time,
    heads_problem,
    heterogeneous_choice,
)
from ucp.elastic.ranks import _cost_model_inputs, layout
from ucp.elastic.shares import ElasticBatch, ElasticSection, zero_stage
from ucp.errors import ConfigError, CorruptCheckpointError
from ucp.hmp.layout import Layout, LayoutError
from ucp.hmp.model_shapes import ModelConfig, ModelConfigError, load_model_config

GOOD = {"num_layers": 2, "replicas": [{"micro_batches": 1, "stages": [{"layers": [0, 2], "ranks": [0]}]}]}
FIX = "pass a path to the JSON that `Layout.to_json()` or `ucp plan --json` writes"
MODEL = "examples/models/llama2-7b.json"  # 32 attention heads, 32 KV heads


# -- part 3: layout files ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("content, line", [
    (json.dumps(GOOD)[:30].encode(), f"not JSON (Expecting value at line 1 column 31); {FIX}"),
    (b'{"num_layers": 2, "x\xe9": 1}', f"not UTF-8 text (byte 20); {FIX}"),
    (json.dumps(GOOD).replace('"num_layers": 2', '"num_layers": 1e400').encode(),
     f"not JSON ucp takes (1e400 is too large a number); {FIX}"),
    (json.dumps(GOOD).replace('"num_layers": 2', '"num_layers": NaN').encode(),
     f"not JSON ucp takes (NaN is no JSON number); {FIX}"),
    (b"[" * 100_000 + b"]" * 100_000, f"JSON nested too deeply; {FIX}"),
    (json.dumps({**GOOD, "workload": "x"}).encode(),
     "the layout: unknown key 'workload'; known: num_layers, replicas, zero_stage"),
    (json.dumps({"model": "m", "workload": "x", "plans": [{"layout": GOOD}]}).encode(),
     'the layout is `ucp plan --json`\'s output, which lists plans: give one plan\'s "layout" (e.g. '
     'plans[0]["layout"])'),
    (json.dumps(GOOD).replace('"num_layers": 2', '"num_layers": 2.5').encode(),
     '"num_layers": 2.5 must be an integer from 1 to 1048576'),
    (json.dumps(GOOD).replace('"micro_batches": 1', '"micro_batches": "1"').encode(),
     'replica 0 "micro_batches": "1" must be an integer from 0 to 1073741824'),
    (json.dumps(GOOD).replace('"ranks": [0]', '"ranks": 0').encode(),
     'replica 0 stage 0 "ranks": 0 is not a list; expected {\'num_layers\': L, \'replicas\': [{\'micro_batches\': M, '
     "'stages': [{'layers': [a, b], 'ranks': [...]}]}]}, as `Layout.to_json()` or `ucp plan --json` writes"),
    (b"[1]", "the layout: a JSON list, not an object; expected {'num_layers': L, 'replicas': [{'micro_batches': M, "
             "'stages': [{'layers': [a, b], 'ranks': [...]}]}]}, as `Layout.to_json()` or `ucp plan --json` writes"),
])
def test_a_layout_file_that_is_not_a_layout_is_one_line(tmp_path, content, line):
    path = tmp_path / "layout.json"
    path.write_bytes(content)
    with pytest.raises(LayoutError) as e:
        as_layout(path)
    assert str(e.value) == f"{path}: {line}"


def test_a_layout_file_reads_back(tmp_path):
    """Control: the same reader takes `Layout.to_json()`'s file."""
    (tmp_path / "layout.json").write_text(json.dumps(GOOD))
    assert as_layout(tmp_path / "layout.json") == Layout.from_json(GOOD)


def test_a_layout_named_by_a_fifo_or_a_folder_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # nobody writes it: a read would block forever
    for path in (tmp_path / "fifo", tmp_path):
        start = time.monotonic()
        with pytest.raises(LayoutError) as e:
            as_layout(path)
        assert str(e.value) == f"{path}: not a regular file (a FIFO, a device or a folder); {FIX}"
        assert time.monotonic() - start < 5


def test_a_layout_file_over_the_bound_is_refused_unread(tmp_path):
    path = tmp_path / "layout.json"
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse
    with pytest.raises(LayoutError) as e:
        as_layout(path)
    assert str(e.value) == f"{path}: 1073741824 bytes, more than the 16777216 such a file may hold; {FIX}"


def test_a_60000_rank_layout_is_checked_in_linear_time():
    """Its duplicate check counted each rank's occurrences in the whole list: 3.6e9 steps."""
    n = 60_000
    replicas = [{"micro_batches": 1, "stages": [{"layers": [0, 1], "ranks": [i if i < n - 1 else 0]}]}
                for i in range(n)]
    start = time.monotonic()
    with pytest.raises(LayoutError) as e:
        Layout.from_json({"num_layers": 1, "replicas": replicas})
    assert str(e.value) == "ranks must be 0..59999, each in exactly one stage; rank 0 appears twice"
    assert time.monotonic() - start < 20  # ~2 s on a loaded 2-core machine
    replicas[-1]["stages"][0]["ranks"] = [n - 1]  # control: the same layout without the duplicate is one
    assert Layout.from_json({"num_layers": 1, "replicas": replicas}).world_size == n


# -- part 3: numbers an index claims ------------------------------------------------------------------------

@pytest.mark.parametrize("value, shown", [(None, "null"), (float("inf"), "Infinity"), ([2], "a JSON list"),
                                          (10 ** 12, "1000000000000"), ("2", '"2"'), (True, "true"), (0, "0")])
def test_an_index_source_degree_that_is_no_number_of_ranks_is_one_line(value, shown):
    with pytest.raises(CorruptCheckpointError) as e:
        source_world_size({"dp": value}, "/run/checkpoint_3")
    assert str(e.value) == (f'/run/checkpoint_3: the index\'s "source": {{"dp": {shown}}} is no number of ranks (an '
                            "int from 1 to 16777216); the index is damaged, convert or save the checkpoint again")
    assert source_world_size({"dp": 2, "tp": 3}, "/run/checkpoint_3") == 6  # control


def test_accelerate_checks_the_rng_files_there_are_not_one_per_claimed_rank(tmp_path, monkeypatch):
    """An index that claims 10**6 ranks (within the bound) in a folder of 2 RNG files: the search for the first
    missing one ends after the files there, not after a million stat calls; 10**12 is refused by the bound."""
    for i in range(2):
        (tmp_path / f"random_states_{i}.pkl").write_bytes(b"")
    claims = {"dp": 10 ** 6}
    monkeypatch.setattr(state_folders, "opened_state", lambda folder: (SimpleNamespace(source=claims), None))
    stats = []
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda *a, **k: stats.append(a) or real(*a, **k))
    assert state_folders.incomplete(tmp_path) == "it has no random_states_2.pkl, which save_state writes last"
    assert len(stats) < 10
    claims["dp"] = 10 ** 12
    assert state_folders.incomplete(tmp_path) == (
        f'its DeepSpeed state does not open ({tmp_path}: the index\'s "source": {{"dp": 1000000000000}} is no number '
        "of ranks (an int from 1 to 16777216); the index is damaged, convert or save the checkpoint again)")
    claims["dp"] = 2  # control: the files there are the files claimed
    assert state_folders.incomplete(tmp_path) is None


# -- part 3 and 5: the "elastic" section and its cost model ------------------------------------------------------

SECTION = {"global_batch": 8, "micro_batch": 2, "tensor_parallel": 2}


@pytest.mark.parametrize("key, value, line", [
    ("seq_len", 1e300, "an integer above 0 and at most 16777216: tokens per sample, e.g. 4096"),
    ("seq_len", 0.5, "an integer above 0 and at most 16777216: tokens per sample, e.g. 4096"),
    ("seq_len", 0, "an integer above 0 and at most 16777216: tokens per sample, e.g. 4096"),
    ("gpu_memory", 1e300, "a number above 0 and at most 1048576: GiB per rank, e.g. 80"),
    ("gpu_memory", float("nan"), "a number above 0 and at most 1048576: GiB per rank, e.g. 80"),
])
def test_absurd_cost_model_inputs_are_one_line(key, value, line):
    with pytest.raises(ConfigError) as e:
        ElasticSection.from_config({**SECTION, key: value})
    assert str(e.value) == f'"ucp": {{"elastic": {{"{key}": {json.dumps(value)}}}}}: must be {line}'


def test_a_zero_stage_that_is_no_stage_is_one_line():
    for stage, shown in (("x", '"x"'), (4, "4"), (None, "null")):
        with pytest.raises(ConfigError) as e:
            zero_stage({"zero_optimization": {"stage": stage}})
        assert str(e.value) == (f'"zero_optimization": {{"stage": {shown}}}: must be 0, 1, 2 or 3 (the ZeRO stage '
                                "DeepSpeed partitions by, which ucp's layouts and cost model plan for)")
    assert zero_stage({"zero_optimization": {"stage": 2}}) == 2   # control
    section = ElasticSection.from_config({**SECTION, "model": MODEL})
    assert _cost_model_inputs(section, 2, None)[-1] == 2


def test_layout_of_something_else_than_a_config_is_one_line():
    with pytest.raises(ConfigError) as e:
        layout([1])
    assert str(e.value) == ('ucp.elastic.layout(config): config is a list, not the DeepSpeed config dict with its '
                            '"ucp": {"elastic": ...} section')


# -- part 5: layouts that cannot be right --------------------------------------------------------------------

def test_heterogeneous_refuses_tp_sizes_that_do_not_split_the_heads():
    """"heterogeneous": true with llama2-7b's shape took TP 3 (replicas 3 + 3 on 6 ranks) for its 32 heads, which
    the homogeneous rule refuses. Negative control: without the heads rule the same call still picks it."""
    model = load_model_config(MODEL)
    inputs = (model, 80.0, 64, 1, 2048, 1)
    step_time, plan = cost_model_step_time(*inputs), cost_model_replicas(*inputs, (3,), (1,))
    assert heterogeneous_choice(6, (3,), (1,), 64, 1, step_time, plan).replicas == (3, 3)
    with pytest.raises(ConfigError) as e:
        heterogeneous_choice(6, (3,), (1,), 64, 1, step_time, plan, heads_problem(model))
    assert str(e.value) == ('"ucp": {"elastic": {"tensor_parallel": [3]}}: no size splits the model: T=3 does not '
                            "divide the model's 32 attention heads and 32 KV heads; allow a size that divides the "
                            "heads")
    inputs = (model, 80.0, 64, 4, 2048, 1)
    allowed = heterogeneous_choice(6, (3, 2), (1,), 64, 4, cost_model_step_time(*inputs),
                                   cost_model_replicas(*inputs, (3, 2), (1,)), heads_problem(model))
    assert 3 not in allowed.replicas and allowed.training == 6


def test_a_refusal_gives_the_true_reason():
    """T=3 was refused as not fitting the ranks' memory (80 GiB holds a 7B at T=3): the heads are why."""
    step_time = cost_model_step_time(load_model_config(MODEL), 80.0, 64, 1, 2048, 1)
    with pytest.raises(ConfigError) as e:
        choose_layout(6, (3,), (1,), 64, 1, step_time)
    assert str(e.value) == ('"ucp": {"elastic": ...}: no layout of tensor_parallel [3] x pipeline_parallel [1] can '
                            "train on 6 ranks (T=3 x P=1 x D=2 does not divide the model's 32 attention heads and 32 "
                            "KV heads); allow smaller sizes, or change the batch or the ranks")


def test_a_batch_error_advises_a_micro_batch_that_works():
    """Shares 8 and 2 at micro_batch 2: 4 micro-batches, but one replica has 2 samples. It advised micro_batch 2
    or more, the value already set."""
    with pytest.raises(ConfigError) as e:
        ElasticBatch(10, 2, 2, (8, 2))
    assert str(e.value) == ('"ucp": {"elastic": {"global_batch": 10, "micro_batch": 2}} on 2 ranks: ranks take from 2 '
                            "to 8 samples, but every rank must run 4 micro-batches of at least one sample; use "
                            "micro_batch 4 or more")
    assert ElasticBatch(10, 4, 2, (8, 2)).accumulation == 2  # control: the advice works


@pytest.mark.parametrize("key, value, line", [
    ("tie_word_embeddings", "false", 'tie_word_embeddings="false" must be true or false (a JSON boolean, not a string '
                                     "or a number)"),
    ("tie_word_embeddings", 0, "tie_word_embeddings=0 must be true or false (a JSON boolean, not a string or a "
                               "number)"),
    ("attention_bias", "no", 'attention_bias="no" must be true or false (a JSON boolean, not a string or a number)'),
    ("num_hidden_layers", 2.5, "num_hidden_layers=2.5 must be an integer; is it the model's config.json?"),
    ("num_attention_heads", 1e400, "num_attention_heads=Infinity must be an integer; is it the model's config.json?"),
    ("hidden_size", "4096", 'hidden_size="4096" must be an integer; is it the model\'s config.json?'),
])
def test_model_config_values_are_typed(key, value, line):
    config = json.loads(open(MODEL).read())
    with pytest.raises(ModelConfigError) as e:
        ModelConfig.from_hf({**config, key: value}, "llama2-7b")
    assert str(e.value) == f"llama2-7b: {line}"
    assert ModelConfig.from_hf({**config, "tie_word_embeddings": True}, "m").tie_embeddings  # control
    assert not ModelConfig.from_hf({**config, "tie_word_embeddings": False}, "m").tie_embeddings


@pytest.mark.parametrize("key", ["tensor_parallel", "pipeline_parallel", "heterogeneous", "expert_parallel", "model",
                                 "gpu_memory", "seq_len"])
def test_the_trainer_takes_only_the_elastic_keys_it_honours(key):
    with pytest.raises(ConfigError) as e:
        ElasticBatch.from_config({"global_batch": 8, "micro_batch": 2, key: 2}, 2, TRAINER_KEYS,
                                 "the Hugging Face Trainer")
    assert str(e.value) == (f'"ucp": {{"elastic": {{"{key}": ...}}}}: the Hugging Face Trainer trains data-parallel '
                            f'only and takes "global_batch" and "micro_batch"; leave out "{key}"')
    assert ElasticBatch.from_config({"global_batch": 8, "micro_batch": 2}, 2, TRAINER_KEYS, "the Trainer").world == 2


# -- part 3: the HMP example's --layout (a layout or a `ucp plan --json` file) -----------------------------------

def _read_layout():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "hmp" / "layout_file.py"
    spec = importlib.util.spec_from_file_location("hmp_layout_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.read_layout


@pytest.mark.parametrize("content, line", [
    (json.dumps({"workload": "x", "plans": [{"layout": GOOD}]}),
     '"workload" is "x", not the object ucp plan --json writes'),
    (json.dumps({"workload": {"seq_len": 1e300}, "plans": [{"layout": GOOD}]}),
     '"workload": {"seq_len": 1e+300} must be an integer from 1 to 16777216'),
    (json.dumps({"workload": {"micro_batch_size": [1]}, "plans": [{"layout": GOOD}]}),
     '"workload": {"micro_batch_size": a JSON list} must be an integer from 1 to 16777216'),
    (json.dumps(GOOD)[:30], "@not JSON (Expecting value at line 1 column 31); pass the JSON of Layout.to_json() or "
                            "of ucp plan --json"),  # @: the reader's line, naming the file alone
])
def test_the_hmp_examples_layout_file_is_one_line(tmp_path, content, line):
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as e:
        _read_layout()(str(path), 0, 2, 8)
    assert str(e.value) == (f"{path}: {line[1:]}" if line.startswith("@") else f"--layout {path}: {line}")
    path.write_text(json.dumps({"workload": {"seq_len": 8}, "plans": [{"layout": GOOD}]}))  # control
    assert _read_layout()(str(path), 0, 2, 8)[1] == (1,)


def test_the_hmp_examples_layout_may_not_be_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ConfigError) as e:
        _read_layout()(str(tmp_path / "fifo"), 0, 2, 8)
    assert str(e.value) == (f"{tmp_path / 'fifo'}: not a regular file (a FIFO, a device or a folder); pass the JSON "
                            "of Layout.to_json() or of ucp plan --json")
