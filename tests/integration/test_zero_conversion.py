"""Zero-conversion resume: `ucp.deepspeed` loads a DeepSpeed checkpoint directly, resharded on the fly.

Each loaded rank equals, tensor for tensor, a load of the same checkpoint converted by `ucp convert`;
the data-parallel group reads each needed source byte once; training continues the uninterrupted
run, from ZeRO checkpoints and from an AutoTP one (its TP shards read whole by one rank of the group
and broadcast); a DeepSpeed checkpoint with a missing or stray rank file is refused on every rank before the
engine is touched.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

import ucp
from support.atomic import stored_bytes
from support.checkpoints import (
    SUPPORT_DIR,
    TinySpec,
    read_tag,
    tag_dir,
    ucp_load_errors,
    ucp_resume,
    ucp_stats,
    uninterrupted_losses,
)
from support.launch import run_torchrun
from support.llama_tp_runs import build_sources, load_stats, losses, resume
from test_load_hook_tp import RESUME, SAVED_AT, TRAIN
from test_source_checksums import unloaded_bytes
from ucp.convert import convert
from ucp.format.safetensors_stream import TORCH_DTYPES
from ucp.plan.plan import BUFFER

CASES = [  # (saved at, loaded at)
    (TinySpec(stage=2), TinySpec(stage=2, world_size=1)),                               # DP 2 -> 1
    (TinySpec(stage=2), TinySpec(stage=3, world_size=3)),                               # ZeRO 2 -> 3
    (TinySpec(stage=1), TinySpec(stage=3)),                                             # ZeRO 1 -> 3, DP 2
    (TinySpec(stage=1), TinySpec(stage=1, world_size=3)),                               # ZeRO-1, DP 2 -> 3
    (TinySpec(stage=3, dtype="bf16", world_size=3), TinySpec(stage=2, dtype="bf16")),   # bf16, ZeRO 3 -> 2
]


MASTERS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")  # compare_loads.py's names


@pytest.fixture(scope="module")
def converted(tiny_checkpoint, tmp_path_factory):
    memo = {}

    def make(spec: TinySpec) -> Path:
        if spec not in memo:
            memo[spec] = tmp_path_factory.mktemp("atomic") / spec.name
            convert(tiny_checkpoint(spec), memo[spec], workers=1, progress=False)
        return memo[spec]

    return make


def compare_loads(first: Path, second: Path, target: TinySpec, root: Path, check_keep_bytes: int | None = None
                  ) -> list[dict]:
    """Load `first`, then `second`, into one engine at `target` (support/compare_loads.py); by rank."""
    runs = Path(root) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"compare-{target.name}-", dir=runs))
    args = ["--stage", target.stage, "--dtype", target.dtype, "--optimizer", target.optimizer,
            "--first", first, "--second", second, "--out", run_dir / "compare.json"]
    if check_keep_bytes is not None:
        args += ["--check-keep-bytes", check_keep_bytes]
    run_torchrun(SUPPORT_DIR / "compare_loads.py", args, target.world_size, run_dir / "train.log")
    return json.loads((run_dir / "compare.json").read_text())


def needed_source_bytes(save_dir: Path) -> int:
    """Bytes of every state the engine loads, as the rank files store them (their own dtype, no padding)."""
    plan = ucp.open_checkpoint(save_dir).plan
    return sum(math.prod(p.shape) * TORCH_DTYPES[s.fragments[0].piece.dtype].itemsize
               for p in plan.params for s in p.states.values())


def unrestorable_bytes(save_dir: Path) -> int:
    """Stored bytes of the states a load cannot put back in the engine if the check before it fails: the frozen
    weights and the buffers (the module's own tensors). Trainable masters and optimizer states can be."""
    plan = ucp.open_checkpoint(save_dir).plan
    return sum(math.prod(p.shape) * TORCH_DTYPES[s.fragments[0].piece.dtype].itemsize
               for p in plan.params if p.kind != "param" for s in p.states.values())


def zero3_partition_bytes(save_dir: Path, rank: int, dp: int) -> int:
    """Stored bytes of ZeRO-3 rank `rank`'s partitions (ceil(numel / dp) elements, the last fewer) of every
    trainable and frozen parameter's states."""
    total = 0
    for p in ucp.open_checkpoint(save_dir).plan.params:
        numel = math.prod(p.shape)
        per = -(-numel // dp)
        mine = max(0, min(per, numel - rank * per))
        if p.kind != BUFFER:
            total += sum(mine * TORCH_DTYPES[s.fragments[0].piece.dtype].itemsize for s in p.states.values())
    return total


def buffer_bytes(save_dir: Path) -> int:
    plan = ucp.open_checkpoint(save_dir).plan
    return sum(math.prod(p.shape) * TORCH_DTYPES[s.dtype].itemsize for p in plan.params if p.kind == BUFFER
               for s in p.states.values())


@pytest.mark.parametrize("source,target", CASES, ids=lambda s: s.name)
def test_loads_equal_loads_of_the_converted_checkpoint(source, target, tiny_checkpoint, converted, ckpt_root):
    raw = tiny_checkpoint(source)
    ranks = compare_loads(converted(source), raw, target, ckpt_root, check_keep_bytes=0)
    assert len(ranks) == target.world_size
    for rank, r in enumerate(ranks):
        unequal = [n for n, same in zip(r["names"], r["equal"]) if not same]
        assert not unequal, (rank, unequal)
        assert r["meta_equal"], rank  # global steps, LR scheduler, client state
        # Negative control: the comparison can fail, as the first load changed the fresh engine's masters.
        masters = [same for n, same in zip(r["names"], r["fresh_equal"]) if n.startswith(MASTERS)]
        assert masters and not any(masters), rank
    # Bypass: the ranks together read each source byte they need once, each its own share.
    reads = [r["stats"][1]["bytes_read"] for r in ranks]
    assert sum(reads) == needed_source_bytes(raw)
    assert all(reads) or target.world_size == 1
    if source.dtype == "fp32":  # the same bytes the converted checkpoint stores, and its load reads
        installed = sum(r["stats"][0]["bytes_read"] - r["stats"][0]["bytes_checked_extra"] for r in ranks)
        assert sum(reads) == stored_bytes(converted(source)) == installed
    if target.stage == 3:  # each rank exactly its own partitions, plus its share of the replicated buffers
        own = [zero3_partition_bytes(raw, rank, target.world_size) for rank in range(target.world_size)]
        assert all(read >= mine for read, mine in zip(reads, own))
        assert sum(reads) - sum(own) == buffer_bytes(raw) > 0
    # The check before the load read nothing but what no rank loads (partition padding, small entries no state
    # reads): every other byte of the entries was checked from the CRC-32s of the parts the ranks loaded.
    raw_stats = [r["stats"][1] for r in ranks]
    gaps = unloaded_bytes(raw)
    assert sum(s["bytes_checked_sources"] for s in raw_stats) == sum(map(len, gaps.values())) > 0
    assert not any(s["bytes_checked_extra"] for s in raw_stats)
    # Keeping nothing for the install (check_keep_bytes=0), the check put every trainable master and optimizer
    # state straight into the fresh engine (put back on damage: test_source_checksums); only the frozen
    # weights and buffers, which the engine cannot take back, were read a second time, once across the group.
    assert sum(s["bytes_read_again"] for s in raw_stats) == unrestorable_bytes(raw) > 0


def test_resume_from_the_deepspeed_checkpoint_continues_the_uninterrupted_run(tiny_checkpoint, ckpt_root):
    source, target = TinySpec(stage=2), TinySpec(stage=3, world_size=3)
    raw = tiny_checkpoint(source)
    resumed = ucp_resume(raw, target, 2, source.steps, ckpt_root)
    straight = uninterrupted_losses(dataclasses.replace(source, steps=0), source.steps + 2, ckpt_root)
    # Another DP degree and ZeRO stage sum gradients in another order: ~1e-7 apart (as test_load_hook).
    assert resumed.losses == pytest.approx(straight[source.steps:], rel=1e-6)
    assert sum(s["bytes_read"] for s in ucp_stats(resumed)) == needed_source_bytes(raw)


def test_autotp_checkpoint_resumes_without_conversion_at_tp1(ckpt_root):
    """AutoTP 2 x DP 1, ZeRO-1, tied (test_load_hook_tp's source) -> DP 2, ZeRO-2: no state is stored as flat
    runs (TP shards, norms replicated over TP), so one rank of the group reads each whole and broadcasts it."""
    tp2 = build_sources("tp-resume-tp2", 2, 2, {"tied-z1": {**TRAIN, "stage": 1, "tied": True}}, ckpt_root)
    raw = tp2 / "tied-z1" / "ckpt"
    run = resume("raw-tp2-to-dp2", 1, 2, {"z2": {**RESUME, "stage": 2, "tied": True, "ucp_load": str(raw),
                                                 "dump_loaded": True}}, ckpt_root)
    ckpt = ucp.open_checkpoint(raw)
    for rank in torch.load(run / "z2" / "loaded.pt", weights_only=False)["ranks"]:
        assert set(rank["params"]) == set(ckpt.names)
        for name, states in rank["params"].items():
            for state, loaded in states.items():
                assert torch.equal(loaded, ckpt.tensor(name, state)), (name, state)
    # TP sums row-parallel products in another order than DP 2 does (~1e-7 apart in fp32), as in test_load_hook_tp.
    assert losses(run / "z2") == pytest.approx(losses(tp2 / "tied-z1")[SAVED_AT:], rel=1e-6)
    stats = load_stats(run / "z2")
    fragments = sum(f.piece.numel * TORCH_DTYPES[f.piece.dtype].itemsize
                    for p in ckpt.plan.params for s in p.states.values() for f in s.fragments)
    assert sum(s["bytes_read"] for s in stats) == fragments  # every fragment once, replicas included
    assert all(s["bytes_read"] and s["bytes_broadcast"] for s in stats)  # the reads are shared out


def test_broken_deepspeed_checkpoints_are_refused_before_the_engine_is_touched(tiny_checkpoint, ckpt_root, tmp_path):
    raw = tiny_checkpoint(TinySpec(stage=2))
    rank1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    missing = shutil.copytree(tag_dir(raw), tmp_path / "missing" / read_tag(raw))
    (missing / rank1).unlink()
    stray = shutil.copytree(tag_dir(raw), tmp_path / "stray" / read_tag(raw))
    shutil.copy(stray / rank1, stray / "zero_pp_rank_2_mp_rank_00_optim_states.pt")  # left by a DP 3 save
    results = ucp_load_errors([missing, stray], TinySpec(stage=2), ckpt_root)
    needles = [f"{missing / rank1}: missing", "files from different runs are mixed"]
    for result, needle in zip(results, needles):
        assert result["error"] is not None and needle in result["error"], result
        assert "\n" not in result["error"] and result["untouched"], result
