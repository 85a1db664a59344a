"""The hook's two read sources agree: a DeepSpeed checkpoint read through its plan gives, for any run or
box a rank wants, exactly what the converted checkpoint gives, from exactly the bytes that hold it
(ZeRO partitions), or from the whole state read once for the group (AutoTP shards).

In-process (no engine): `TargetTensor`s stand in for the partitions ZeRO targets want.
"""
from __future__ import annotations

import math
import shutil

import pytest
import torch

import ucp
from support.checkpoints import TinySpec
from support.llama_tp_runs import build_sources
from test_load_hook_tp import TRAIN
from ucp.convert import convert
from ucp.deepspeed import LoadStats
from ucp.deepspeed.engine.targets import TargetTensor
from ucp.deepspeed.loading import load as engine_load
from ucp.deepspeed.loading.flat_runs import FlatRun, flat_runs, run_reads
from ucp.deepspeed.loading.source import AtomicSource, PlannedSource, box_numel
from ucp.errors import CorruptCheckpointError
from ucp.format.byte_ranges import ByteRange
from ucp.format.safetensors_stream import TORCH_DTYPES
from ucp.patterns import FragmentInfo, Pattern, PatternSpec
from ucp.plan.plan import ConversionPlan, Fragment, ParamPlan, Piece, StateSource
from ucp.storage.fileio import tensor_bytes

SOURCES = ["z2-fp32-dp2", "z3-bf16-dp3", "autotp2-z1"]  # ZeRO partitions; bf16 frozen fragments; TP shards


def _flat_source(runs: list[tuple[int, int]], shape: tuple[int, ...]) -> StateSource:
    """ZeRO-style partitions: (byte offset in "f", numel) per rank, tiling the padded flat tensor in rank order."""
    fragments, offset = [], 0
    for rank, (byte_offset, numel) in enumerate(runs):
        fragments.append(Fragment(FragmentInfo(rank, (numel,), offset), Piece("f", byte_offset, numel, "float32")))
        offset += numel
    return StateSource(PatternSpec(Pattern.SHARD_V, shape, flat=True, padded_size=offset), tuple(fragments))


def _read(source, key, t: TargetTensor, *, bypass: bool = True) -> tuple[torch.Tensor, LoadStats]:
    stats = LoadStats()
    return source.read({key: t}, [key], bypass, stats)[key], stats


def test_a_run_of_elements_maps_to_the_overlapping_bytes_of_each_partition():
    runs = flat_runs(_flat_source([(100, 4), (500, 4), (900, 4)], (11,)))
    assert runs == (FlatRun(0, Piece("f", 100, 4, "float32")), FlatRun(4, Piece("f", 500, 4, "float32")),
                    FlatRun(8, Piece("f", 900, 4, "float32")))
    assert run_reads(runs, 3, 9, 4) == [ByteRange("f", 112, 116), ByteRange("f", 500, 516), ByteRange("f", 900, 904)]
    assert run_reads(runs, 5, 7, 4) == [ByteRange("f", 504, 512)]
    assert run_reads(runs, 4, 4, 4) == []
    with pytest.raises(ValueError):
        run_reads(runs, 10, 13, 4)  # past the padded tensor


def test_only_flat_runs_and_whole_tensors_are_read_by_range():
    one = Fragment(FragmentInfo(0, (2, 3)), Piece("m", 8, 6, "bfloat16"))
    whole = StateSource(PatternSpec(Pattern.UNIQUE, (2, 3)), (one,))
    assert flat_runs(whole) == (FlatRun(0, Piece("m", 8, 6, "bfloat16")),)
    copies = StateSource(PatternSpec(Pattern.REPLICATE, (2, 3)),
                         tuple(Fragment(FragmentInfo(r, (2, 3)), Piece("m", 100 * r, 6, "float32")) for r in (0, 1)))
    assert flat_runs(copies) is None  # materialised whole (rank 0's copy), as ucp convert does
    rows = StateSource(PatternSpec(Pattern.SHARD_V, (4, 3), dim=0),
                       tuple(Fragment(FragmentInfo(r, (2, 3)), Piece("m", 100 * r, 6, "float32")) for r in (0, 1)))
    assert flat_runs(rows) is None


def test_states_not_stored_as_flat_runs_are_read_whole_by_one_rank_for_its_group(tmp_path):
    copy, rows = torch.arange(12, dtype=torch.float32).reshape(4, 3), torch.arange(100, 112, dtype=torch.float32)
    raw = tmp_path / "ranks.bin"
    raw.write_bytes(bytes(tensor_bytes(torch.cat([copy.reshape(-1), copy.reshape(-1), rows]))))

    def fragments(shape: tuple[int, ...], first: int) -> tuple[Fragment, ...]:  # rank r's at byte first + r * size
        n = math.prod(shape)
        return tuple(Fragment(FragmentInfo(r, shape), Piece(str(raw), first + 4 * n * r, n, "float32")) for r in (0, 1))

    replicated = StateSource(PatternSpec(Pattern.REPLICATE, (4, 3)), fragments((4, 3), 0))
    split = StateSource(PatternSpec(Pattern.SHARD_V, (4, 3), dim=0), fragments((2, 3), 96))  # TP shards of rows
    source = PlannedSource(ConversionPlan([ParamPlan("w", (4, 3), "param", {"fp32": replicated, "exp_avg": split},
                                                     group=0)], {}, None))
    t = TargetTensor("w", "param", (4, 3), 6, 6, False, lambda s: None)  # ZeRO-3 rank 1 of 2
    for key, full, nbytes in ((("w", "fp32"), copy, 96), (("w", "exp_avg"), rows, 48)):
        assert source.shared(key, t)
        got, stats = _read(source, key, t)  # the whole tensor, for the group: every fragment read
        assert torch.equal(got, full.reshape(-1)) and stats.bytes_read == nbytes
        assert torch.equal(_read(source, key, t, bypass=False)[0], full.reshape(-1)[6:])


@pytest.fixture(scope="module")
def sources(tiny_checkpoint, ckpt_root, tmp_path_factory):
    """name -> (planned source of the DeepSpeed checkpoint, atomic source of its conversion, the plan)."""
    tp2 = build_sources("tp-resume-tp2", 2, 2, {"tied-z1": {**TRAIN, "stage": 1, "tied": True}}, ckpt_root)
    raws = {"z2-fp32-dp2": tiny_checkpoint(TinySpec(stage=2)),
            "z3-bf16-dp3": tiny_checkpoint(TinySpec(stage=3, dtype="bf16", world_size=3)),
            "autotp2-z1": tp2 / "tied-z1" / "ckpt"}  # the one test_load_hook_tp resumes: AutoTP 2, ZeRO-1
    out = {}
    for name, raw in raws.items():
        converted = tmp_path_factory.mktemp("atomic") / name
        convert(raw, converted, workers=1, progress=False)
        plan = ucp.open_checkpoint(raw).plan
        out[name] = (PlannedSource(plan), AtomicSource(ucp.open_checkpoint(converted)), plan)
    return out


def _fragment_bytes(plan: ConversionPlan, key: tuple[str, str]) -> int:
    fragments = plan.param(key[0]).states[key[1]].fragments
    return sum(f.piece.numel * TORCH_DTYPES[f.piece.dtype].itemsize for f in fragments)


def _partitions(name: str, shape: tuple[int, ...], kind: str, dp: int) -> list[TargetTensor]:
    """What ZeRO-3 ranks 0..dp-1 want of a tensor: ceil(numel / dp) elements each, the last one fewer."""
    numel = math.prod(shape)
    per = -(-numel // dp)
    return [TargetTensor(name, kind, shape, r * per, max(0, min(per, numel - r * per)), False, lambda s: None)
            for r in range(dp)]


@pytest.mark.parametrize("spec", SOURCES)
def test_every_partition_equals_the_converted_one_and_reads_only_its_bytes(spec, sources):
    planned, atomic, plan = sources[spec]
    for name, entry in atomic.ckpt.index.params.items():
        shape = entry.shape
        for state in entry.states:
            key = (name, state)
            itemsize = TORCH_DTYPES[plan.param(name).states[state].fragments[0].piece.dtype].itemsize
            for dp in (1, 2, 3):
                for t in _partitions(name, shape, entry.kind, dp):
                    if t.numel == 0:
                        continue
                    got, stats = _read(planned, key, t)
                    want, _ = _read(atomic, key, t)
                    if planned.shared(key, t):  # read whole for the group: every fragment once
                        got, nbytes = got.narrow(0, t.start, t.numel), _fragment_bytes(plan, key)
                    else:
                        nbytes = t.numel * itemsize
                    assert got.dtype == want.dtype and torch.equal(got, want), (key, dp, t.start)
                    assert stats.bytes_read == nbytes, (key, dp, t.start)


@pytest.mark.parametrize("spec", SOURCES)
def test_boxes_and_whole_tensors_equal_the_converted_ones(spec, sources):
    planned, atomic, _ = sources[spec]
    for name, entry in atomic.ckpt.index.params.items():
        shape = entry.shape
        boxes = [None]
        if len(shape) == 2:  # cut along rows; along columns
            boxes += [((1, shape[0]), (0, shape[1])), ((0, shape[0]), (1, shape[1] - 1))]
        for state in entry.states:
            key = (name, state)
            for box in boxes:
                n = math.prod(hi - lo for lo, hi in box) if box else math.prod(shape)
                whole = TargetTensor(name, entry.kind, shape, 0, n, True, lambda s: None, box=box)
                part = TargetTensor(name, entry.kind, shape, 1, n - 2, False, lambda s: None, box=box)
                for t in (whole, part):
                    for bypass in (True, False):
                        got, _ = _read(planned, key, t, bypass=bypass)
                        want, _ = _read(atomic, key, t, bypass=bypass)
                        if bypass and planned.shared(key, t) and not t.whole:
                            got = got.narrow(0, t.start, t.numel)  # a shared key's reader gets the whole box
                        assert box_numel(t) == n and torch.equal(got, want), (key, box, t.whole, bypass)


def test_negative_control_another_partition_differs(sources):
    planned, atomic, _ = sources[SOURCES[0]]
    first, second = _partitions("l1.weight", (9, 7), "param", 2)
    mine, other = _read(planned, ("l1.weight", "fp32"), first)[0], _read(atomic, ("l1.weight", "fp32"), second)[0]
    n = min(mine.numel(), other.numel())  # the partitions hold 32 and 31 elements
    assert not torch.equal(mine[:n], other[:n])


def _fresh(which: str, planned: PlannedSource, atomic: AtomicSource):
    """A source of the same checkpoint that has checked nothing yet (the fixture's are shared between tests)."""
    return PlannedSource(planned.plan) if which == "planned" else AtomicSource(atomic.ckpt)


def _rank_1_of_2(source) -> list[dict]:
    """What ZeRO-3 rank 1 of 2 wants of every state, one layer per parameter."""
    params = source.ckpt.index.params.items() if isinstance(source, AtomicSource) else \
        ((p.name, p) for p in source.plan.params)
    return [{(name, state): _partitions(name, tuple(entry.shape), entry.kind, 2)[1] for state in entry.states}
            for name, entry in params]


@pytest.mark.parametrize("which", ["planned", "atomic"])
def test_what_the_check_could_not_keep_is_read_again_exactly_and_compared_with_it(sources, which):
    """The check before a load reads each key once and records the CRC-32 of what it read; the install reads
    again what it could not keep: the same values, from the same bytes (`bytes_read_again`, none of the load's
    own bytes twice)."""
    planned, atomic, _ = sources["z2-fp32-dp2"]
    source = _fresh(which, planned, atomic)
    layers = _rank_1_of_2(source)
    stats = LoadStats()
    checked = [source.check(wants, list(wants), True, stats) for wants in layers]
    source.close(stats)
    first = stats.bytes_read
    own = first - stats.bytes_checked_extra  # without what closing rank 0's chunks alone read (no other rank here)
    assert own > 0 and stats.bytes_read_again == 0
    for wants, values in zip(layers, checked):
        again = source.read(wants, list(wants), True, stats)
        assert all(torch.equal(again[k], values[k]) for k in wants)
    assert stats.bytes_read == first and stats.bytes_read_again == own


@pytest.mark.parametrize("which", ["planned", "atomic"])
def test_bytes_that_change_after_the_check_are_refused_when_read_again(sources, tiny_checkpoint, tmp_path, which):
    """A file written between the check and the install (or storage returning other bytes) is caught by the
    second read's CRC-32; the first read of the same copy passes (control: test above)."""
    planned, atomic, _ = sources["z2-fp32-dp2"]
    folder = shutil.copytree(tiny_checkpoint(TinySpec(stage=2)) if which == "planned" else atomic.ckpt.path,
                             tmp_path / "copy")
    opened = ucp.open_checkpoint(folder)
    source = PlannedSource(opened.plan) if which == "planned" else AtomicSource(opened)
    layers = _rank_1_of_2(source)
    stats = LoadStats()
    for wants in layers:
        source.check(wants, list(wants), True, stats)
    source.close(stats)
    wants = next(w for w in layers if ("emb.weight", "exp_avg") in w)
    key = ("emb.weight", "exp_avg")
    if which == "planned":
        where = source._reads(key, wants[key], True)[0]
        path, offset = where.file, where.begin + 5
    else:
        stored = opened.index.entry("emb.weight").states["exp_avg"]
        path, offset = folder / stored.file, stored.begin + 4 * wants[key].start + 5
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match="changed since the check before the load"):
        source.read(wants, list(wants), True, stats)


def test_the_hook_reads_a_layer_in_consecutive_batches_of_at_most_batch_bytes(sources, monkeypatch):
    """A rank holds one batch of a layer's values at a time: consecutive keys, in the layer's order, up to
    `BATCH_BYTES` of the values they read (a state larger than that alone)."""
    planned, atomic, _ = sources["z2-fp32-dp2"]
    layer = {(name, state): _partitions(name, tuple(entry.shape), entry.kind, 2)[1]
             for name, entry in atomic.ckpt.index.params.items() for state in entry.states}
    monkeypatch.setattr(engine_load, "BATCH_BYTES", 256)
    for source in (planned, atomic):
        batches = list(engine_load._batches(layer, source))
        sizes = [sum(t.numel * source.dtype(key).itemsize for key, t in batch.items()) for batch in batches]
        assert [key for batch in batches for key in batch] == list(layer)
        assert all(size <= 256 or len(batch) == 1 for size, batch in zip(sizes, batches))
        firsts = [next(iter(batch.items())) for batch in batches[1:]]  # each batch as full as the next allows
        assert all(size + t.numel * source.dtype(key).itemsize > 256 for size, (key, t) in zip(sizes, firsts))
        assert len(batches) > 2  # the test's layer is larger than a batch


def test_the_check_reads_a_partition_straight_into_the_tensor_it_goes_to(sources):
    """`into`: a ZeRO partition of a flat-stored state is read straight into the tensor given for it (the
    engine's memory in a load), range after range, with no buffer of its own: the same values and bytes read
    as without it, and the same parts checked. States of another dtype than the tensor given read as before."""
    planned, _, _ = sources["z2-fp32-dp2"]
    by_buffer, direct = PlannedSource(planned.plan), PlannedSource(planned.plan)
    stats_buffer, stats_direct = LoadStats(), LoadStats()
    straight = spanning = 0
    for wants in _rank_1_of_2(direct):
        into = {key: torch.full((t.numel,), -1.0, dtype=direct.dtype(key)) for key, t in wants.items() if t.numel}
        into[next(iter(into))] = torch.empty(0, dtype=torch.float64)  # another dtype (and size): not read into
        want = by_buffer.check(wants, list(wants), True, stats_buffer)
        got = direct.check(wants, list(wants), True, stats_direct, into)
        assert want.keys() == got.keys()
        for key, value in got.items():
            assert torch.equal(value, want[key]), key
            if key in into and value.data_ptr() == into[key].data_ptr():
                straight += 1
                spanning += len(direct._reads(key, wants[key], True)) > 1
            else:
                assert key not in into or into[key].dtype == torch.float64 or not into[key].numel(), key
    by_buffer.close(stats_buffer)
    direct.close(stats_direct)
    assert straight > 0 and spanning > 0  # some partitions continue from one rank file into the next
    assert stats_direct.bytes_read == stats_buffer.bytes_read
    assert stats_direct.bytes_checked_sources == stats_buffer.bytes_checked_sources
    assert direct._crcs == by_buffer._crcs


def test_bytes_read_straight_into_their_tensor_are_checked(tiny_checkpoint, tmp_path):
    """A flipped bit in a range the check read straight into its tensor fails the rank file's entry CRC-32
    (negative control of the test above: the same check of an intact copy passes)."""
    folder = shutil.copytree(tiny_checkpoint(TinySpec(stage=2)), tmp_path / "copy")
    key = ("emb.weight", "exp_avg")

    def check(source: PlannedSource) -> None:
        stats = LoadStats()
        for layer in _rank_1_of_2(source):
            into = {k: torch.empty(t.numel, dtype=source.dtype(k)) for k, t in layer.items() if t.numel}
            got = source.check(layer, list(layer), True, stats, into)
            assert key not in layer or got[key].data_ptr() == into[key].data_ptr()
        source.close(stats)

    check(PlannedSource(ucp.open_checkpoint(folder).plan))
    source = PlannedSource(ucp.open_checkpoint(folder).plan)
    wants = next(w for w in _rank_1_of_2(source) if key in w)
    where = source._reads(key, wants[key], True)[0]
    with open(where.file, "r+b") as f:
        f.seek(where.begin + 5)
        byte = f.read(1)[0]
        f.seek(where.begin + 5)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match="fails its CRC-32"):
        check(source)
