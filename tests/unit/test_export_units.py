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
        with staged_output(out) as staging:
            (staging / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    with staged_output(out) as staging:
        assert list(out.iterdir()) == []  # only the empty folder the writer holds locked
        (staging / "config.json").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "config.json").read_text() == "{}"


def test_a_staged_output_may_replace_an_empty_folder_but_nothing_else(tmp_path):
    (tmp_path / "empty").mkdir()
    with staged_output(tmp_path / "empty") as staging:
        (staging / "a").write_text("x")
    assert (tmp_path / "empty" / "a").read_text() == "x"
    (tmp_path / "file").write_text("mine")
    for taken in ("empty", "file"):
        with pytest.raises(OutputExistsError, match=f"{tmp_path / taken}: already exists"):
            with staged_output(tmp_path / taken):
                pass
    assert (tmp_path / "file").read_text() == "mine"
