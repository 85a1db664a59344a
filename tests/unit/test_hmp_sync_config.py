"""The `"hmp"` key of the `"ucp"` config section (ucp.deepspeed.engine.hmp_sync): its batch, the engine's batch keys,
and one-line refusals of what does not go with it. The sync itself is run by tests/integration/test_hmp_train.py."""
from __future__ import annotations

import pytest

from ucp.deepspeed.config import read_section, ucp_options
from ucp.deepspeed.engine.hmp_sync import hmp_batch, replica_batch_keys
from ucp.deepspeed.hook import _elastic_hmp
from ucp.elastic.layout_choice import Choice, RankLayout
from ucp.elastic.shares import ElasticSection
from ucp.errors import ConfigError
from ucp.hmp.layout import Layout, ParamSpec, Replica, Stage

LAYOUT = Layout(2, (Replica((Stage((0, 2), (0, 1)),), 1), Replica((Stage((0, 2), (2,)),), 1)))  # TP 2 + TP 1


def test_the_section_is_a_known_key():
    assert ucp_options({"ucp": {"layout": LAYOUT.to_json(), "hmp": {"global_batch": 8, "micro_batch": 5}}})["hmp"]


def test_batch_keys_are_one_replica_s():
    batch = hmp_batch({"global_batch": 8, "micro_batch": 2, "shares": [5, 3]}, LAYOUT)
    assert (batch.world, batch.accumulation, batch.micro_sizes(0), batch.micro_sizes(1)) == (2, 3, [2, 2, 1], [1, 1, 1])
    # loss weights k * R * A / B: a replica's gradient is R / B times its samples' sum, whatever its share
    assert [batch.loss_weight(k) for k in (2, 1)] == [1.5, 0.75]
    keys = replica_batch_keys({"train_batch_size": 16, "gradient_accumulation_steps": 7, "bf16": {}}, batch)
    assert keys == {"bf16": {}, "train_batch_size": 6, "train_micro_batch_size_per_gpu": 2,
                    "gradient_accumulation_steps": 3}
    # Without shares, the global batch is cut as evenly as it goes.
    assert hmp_batch({"global_batch": 9, "micro_batch": 5}, LAYOUT).micro_sizes(0) == [5]


@pytest.mark.parametrize("section, message", [
    ({"global_batch": 8}, 'needs "global_batch" and "micro_batch"'),
    ({"global_batch": 8, "micro_batch": 5, "share": [5, 3]}, "unknown key 'share'"),
    ({"global_batch": 8, "micro_batch": 5, "shares": "5,3"}, "must be a list of sample counts"),
    ({"global_batch": 8, "micro_batch": 5, "shares": [5, 2]}, "need one positive share per rank (2) summing to"),
])
def test_bad_sections_are_refused_in_one_line(section, message):
    with pytest.raises(ConfigError) as caught:
        hmp_batch(section, LAYOUT)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("options, message", [
    ({"hmp": {"global_batch": 8, "micro_batch": 5}}, 'trains on an explicit layout: add "layout"'),
    ({"hmp": {"global_batch": 8, "micro_batch": 5}, "layout": LAYOUT.to_json(),
      "elastic": {"global_batch": 8, "micro_batch": 5}}, 'give "elastic": {..., "heterogeneous": true} without'),
])
def test_what_does_not_go_with_hmp_is_refused(options, message):
    with pytest.raises(ConfigError) as caught:
        read_section({"ucp": options})
    assert message in str(caught.value)
    # Control: the same section with its layout and nothing else is taken, and so is a save to disk and memory.
    section = read_section({"ucp": {"hmp": options["hmp"], "layout": LAYOUT.to_json()}})
    assert section.hmp is not None and section.hmp.global_batch == 8 and section.layout == LAYOUT
    assert section.load_options == {"layout": LAYOUT}   # the load takes the layout read once
    section = read_section({"ucp": {"hmp": options["hmp"], "layout": LAYOUT.to_json(),
                                    "save": {"dir": "/x", "every": 1, "keep": 2, "memory": {"every": 1}}}})
    assert section.hmp is not None and section.hmp.global_batch == 8 and section.memory_tier


def test_an_elastic_heterogeneous_start_gets_the_layout_and_hmp_batch():
    """`"elastic": {..., "heterogeneous": true}`: the hook trains this start's layout through the `"hmp"` path."""
    place = RankLayout.of(Choice(2, 1, 2, 3, (2, 1), (5, 3), True), 2)
    model = type("M", (), {"ucp_param_table": [ParamSpec("fc", (4, 2), 0, 0), ParamSpec("head", (4, 2), 0, 2)]})()
    elastic = {"global_batch": 8, "micro_batch": 8, "tensor_parallel": 2, "heterogeneous": True}
    layout, batch = _elastic_hmp(ElasticSection.from_config(elastic), place, model)
    assert (batch.global_batch, batch.micro_batch, batch.world, batch.shares) == (8, 8, 2, (5, 3))
    assert layout == Layout(2, (Replica((Stage((0, 2), (0, 1)),), 5), Replica((Stage((0, 2), (2,)),), 3)))
    with pytest.raises(ConfigError, match='leave out "layout"'):
        read_section({"ucp": {"elastic": elastic, "layout": LAYOUT.to_json()}})
    memory = {"dir": "/x", "every": 1, "memory": {"every": 1}}  # the memory tier goes with it, as with "hmp"
    assert read_section({"ucp": {"elastic": elastic, "save": memory, "load": "auto"}}).memory_tier
    with pytest.raises(ConfigError, match="ucp_param_table"):
        _elastic_hmp(ElasticSection.from_config(elastic), place, object())
