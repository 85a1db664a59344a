"""The memory tier's plans (`ucp.elastic.memory_plan`) and its config section (`ucp.deepspeed.memory.files`)."""
from __future__ import annotations

import pytest

from ucp.deepspeed.config import MemoryEvery, SaveOptions
from ucp.elastic.memory_plan import BASE, Fill, NodeCopy, choose, fills, held_by, nodes_of, peer_pairs
from ucp.errors import ConfigError


def test_nodes_are_the_ranks_that_share_a_key_in_order_of_their_lowest_rank():
    assert nodes_of(["b", "b", "a", "a"]) == [[0, 1], [2, 3]]
    assert nodes_of(["a", "b", "a", "b"]) == [[0, 2], [1, 3]]


def test_each_rank_sends_to_its_place_on_the_next_nodes():
    nodes = [[0, 1], [2, 3], [4, 5]]
    assert peer_pairs(nodes, 1) == [(0, 2), (1, 3), (2, 4), (3, 5), (4, 0), (5, 1)]
    assert sorted(peer_pairs(nodes, 2)) == sorted(peer_pairs(nodes, 1) + [(0, 4), (1, 5), (2, 0), (3, 1), (4, 2),
                                                                          (5, 3)])
    assert peer_pairs(nodes, 5) == peer_pairs(nodes, 2)   # at most every other node once
    assert peer_pairs([[0, 1]], 1) == [] and peer_pairs(nodes, 0) == []
    assert peer_pairs([[0, 1, 2], [3]], 1) == [(0, 3), (1, 3), (2, 3), (3, 0)]  # uneven nodes
    assert held_by([2, 3], peer_pairs(nodes, 1)) == [0, 1, 2, 3]
    # A rank that saves no pieces (an HMP replica that does not write) is held by every node.
    assert held_by([2, 3], peer_pairs(nodes, 1), idle=[5]) == [0, 1, 2, 3, 5]


def copy(tag: str, holds: set[int], fingerprint: str = "f", ranks: int = 4) -> NodeCopy:
    return NodeCopy(tag, int(tag.removeprefix("global_step")), fingerprint, ranks, frozenset(holds))


def test_the_newest_complete_save_wins_and_newer_incomplete_ones_are_named():
    node0 = {"global_step6": copy("global_step6", {0, 1}), "global_step5": copy("global_step5", {0, 1, 2, 3})}
    node1 = {"global_step6": copy("global_step6", {0, 1})}
    choice = choose([node0, node1], newer_than=4)
    assert (choice.tag, [(lost.tag, lost.missing) for lost in choice.lost]) == ("global_step5",
                                                                               [("global_step6", (2, 3))])
    assert choose([node0, node1], newer_than=5).tag is None            # the disk tier is as new
    both = choose([{"global_step6": copy("global_step6", {0, 1})}, {"global_step6": copy("global_step6", {2, 3})}], 4)
    assert both.tag == "global_step6" and both.lost == ()


def test_copies_of_different_saves_of_one_tag_never_complete_each_other():
    # Negative control: the same tag, written by two different runs (fingerprints differ).
    choice = choose([{"global_step6": copy("global_step6", {0, 1}, "a")},
                     {"global_step6": copy("global_step6", {2, 3}, "b")}], 0)
    assert choice.tag is None and len(choice.lost) == 2


def test_each_node_fetches_what_it_lacks_from_the_first_node_that_holds_it():
    held = [copy("global_step6", {0, 1}), None, copy("global_step6", {2, 3})]
    assert fills(held, 4) == [Fill(2, 0, 2), Fill(2, 0, 3), Fill(0, 1, BASE), Fill(0, 1, 0), Fill(0, 1, 1),
                              Fill(2, 1, 2), Fill(2, 1, 3), Fill(0, 2, 0), Fill(0, 2, 1)]
    assert fills([copy("global_step6", {0, 1, 2, 3})], 4) == []


def test_the_memory_section_is_checked():
    save = SaveOptions.from_config({"dir": "/ckpt", "every": 4, "memory": {"every": 1}})
    assert save.memory is not None and (save.memory.every, save.memory.replicas) == (1, 1)
    assert save.memory.dir.startswith("/dev/shm/ucp-")  # the default: one folder per save folder (job)
    assert SaveOptions.from_config({"dir": "/ckpt", "every": 4}).memory is None
    for bad, says in [({"every": 0}, '"every": 0'), ({"every": 1, "replicas": -1}, '"replicas": -1'),
                      ({"every": 1, "replica": 1}, "unknown key 'replica'"), ([1], "must be an object"),
                      ({"every": 1, "dir": 3}, '"dir": 3'), ({"every": 1, "dir": "s3://b/m"}, "s3://"),
                      # the working directory, whose global_step* folders the tier's pruning removed (#32)
                      ({"every": 1, "dir": ""}, "must be an absolute path"),
                      ({"every": 1, "dir": "shm/job"}, "must be an absolute path")]:
        with pytest.raises(ConfigError, match=None) as raised:
            SaveOptions.from_config({"dir": "/ckpt", "every": 4, "memory": bad})
        assert says in str(raised.value), (bad, str(raised.value))


def test_the_memory_folder_expands_variables_on_each_node(monkeypatch, tmp_path):
    monkeypatch.setenv("UCP_NODE", "n7")
    assert MemoryEvery(1, 1, f"{tmp_path}/$UCP_NODE", "/ckpt").path == tmp_path / "n7"
    monkeypatch.delenv("UCP_NODE")  # expands to a relative path: refused, never the working directory
    with pytest.raises(ConfigError, match="expands to '\\$UCP_NODE' on this node, not an absolute path"):
        MemoryEvery(1, 1, "$UCP_NODE", "/ckpt").path
