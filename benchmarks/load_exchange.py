#!/usr/bin/env python
"""Scale benchmark: the bytes each rank exchanges in the check before a zero-conversion load, at 64-256 ranks.

    python benchmarks/load_exchange.py [--worlds 64,128,256] [--layers 8,32] [--markdown-out FILE]

Nothing is trained and no process group is started: as `convert_scale.py` does for planning, a ZeRO-1
checkpoint of the Llama-like decoder (hidden 1024, 9 tensors a layer; fp32 masters and Adam's two moments) is
generated in memory on W/2 ranks and planned by the product's converter; then each of W simulated ranks of
a ZeRO-3 target takes its partition of every state the way the hook does (`PlannedSource._reads`: the byte
ranges of the rank files that hold it) and records the parts of zip entries it read
(`ucp.convert.source_check.EntryParts`, the rank files' zip directories answered from memory). What a rank
sends is `ucp.deepspeed.loading.exchange.payloads` of those parts, exactly what `to_owners` passes to the all-to-all;
what it receives is what the other ranks' payloads hold for the entries it owns; both plus the all-to-all's
counts (8 bytes each way per rank), as `LoadStats.bytes_exchanged` counts them. Beside it: the all-gather the
check used before (`all_gather_object` of every rank's parts), which hands each rank W copies of the largest
rank's pickled list.

Per rank the all-to-all moves 16 W bytes of counts plus about two records (60-160 bytes each, pickled: one
list per peer, each with its own header) per part a rank reads, and a ZeRO-3 rank reads one part per
(parameter, state) and source partition its run crosses: O(parameters x states) + O(W). The all-gather moves
W times the largest rank's list.
"""
from __future__ import annotations

import argparse
import datetime
import math
import pickle
import platform
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/convert_scale.py, beside this script

import ucp.convert.source_check as source_check  # noqa: E402
from convert_scale import HEADER_BYTES, SMALL, plan_of, synthetic_zero1  # noqa: E402
from ucp.converters.torch_zip import ZipEntry  # noqa: E402
from ucp.deepspeed.engine.targets import TargetTensor  # noqa: E402
from ucp.deepspeed.loading.exchange import payloads  # noqa: E402
from ucp.deepspeed.loading.source import PlannedSource  # noqa: E402
from ucp.plan.plan import ConversionPlan  # noqa: E402

STATES = 3  # fp32 masters, exp_avg, exp_avg_sq: each rank file stores one flat partition of each


def zip_entries(plan: ConversionPlan) -> dict[str, tuple[list[int], list[ZipEntry]]]:
    """Each synthetic rank file's storages as its zip directory would list them (`convert_scale.adam_state`
    lays them out: the three flat partitions one after the other from HEADER_BYTES)."""
    sizes: dict[str, int] = {}
    for p in plan.params:
        for source in p.states.values():
            for f in source.fragments:
                end = f.piece.byte_offset + 4 * f.piece.numel
                sizes[f.piece.path] = max(sizes.get(f.piece.path, 0), end)
    entries = {}
    for path, end in sizes.items():
        part = (end - HEADER_BYTES) // STATES
        listed = [ZipEntry(f"archive/data/{k}", HEADER_BYTES + k * part, HEADER_BYTES + (k + 1) * part, 1)
                  for k in range(STATES)]
        entries[path] = ([e.start for e in listed], listed)
    return entries


def rank_parts(source: PlannedSource, rank: int, world: int) -> list[source_check.OpenEntry]:
    """The parts of zip entries ZeRO-3 rank `rank` of `world` reads for its partitions, layer by layer."""
    parts = source_check.EntryParts()
    for p in source.plan.params:
        numel = math.prod(p.shape)
        per = -(-numel // world)
        t = TargetTensor(p.name, p.kind, p.shape, rank * per, max(0, min(per, numel - rank * per)), False,
                         lambda s: None)
        if not t.numel:
            continue
        ranges = [r for state in p.states for r in source._reads((p.name, state), t, True)]
        for r in sorted(ranges, key=lambda r: (r.file, r.begin, r.end)):
            parts.add(r.file, source._names[r.file], r.begin, r.end, 0)
    return parts.opened


def measure(layers: int, world: int, tmp: Path) -> dict:
    """Bytes each of `world` simulated ranks exchanges, all-to-all and all-gather (max and mean over ranks)."""
    src = synthetic_zero1(tmp / f"z1-{layers}-{world}", SMALL.shapes(layers), world // 2)
    plan = plan_of(src)
    entries = zip_entries(plan)
    real = source_check.entries_in_file_order
    source_check.entries_in_file_order = lambda path: entries[path]  # the files exist in memory only
    try:
        source = PlannedSource(plan)
        sent, received, lists, counts = [0] * world, [0] * world, [], []
        for rank in range(world):
            opened = rank_parts(source, rank, world)
            out = payloads(opened, lambda p: (p.file, p.entry.start), world)  # as PlannedSource.close
            sent[rank] = sum(len(p) for p in out)
            for owner, p in enumerate(out):
                received[owner] += len(p)
            lists.append(len(pickle.dumps(opened)))  # what all_gather_object sends of this rank
            counts.append(len(opened))
    finally:
        source_check.entries_in_file_order = real
    a2a = [16 * world + s + r for s, r in zip(sent, received)]
    gather = world * max(lists)  # all_gather_object: every rank's list, each padded to the largest
    return {"layers": layers, "params": len(plan.params), "keys": STATES * len(plan.params), "world": world,
            "parts": max(counts), "a2a_max": max(a2a), "a2a_mean": sum(a2a) / world, "gather": gather}


def table(rows: list[dict]) -> list[str]:
    lines = ["| target ranks (ZeRO-3) | source ranks (ZeRO-1) | layers | states (parameter x state) | parts a rank "
             "reads (max) | all-to-all bytes/rank (max) | (mean) | all-gather bytes/rank | all-gather / "
             "all-to-all |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['world']} | {r['world'] // 2} | {r['layers']} | {r['keys']} | {r['parts']} | "
                     f"{r['a2a_max'] / 1024:.0f} KiB | {r['a2a_mean'] / 1024:.0f} KiB | "
                     f"{r['gather'] / 1024 ** 2:.1f} MiB | {r['gather'] / r['a2a_max']:.0f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="64,128,256", help="target world sizes (the source has half as many)")
    ap.add_argument("--layers", default="8,32", help="decoder layers (9 parameters, 27 states each)")
    ap.add_argument("--markdown-out", metavar="FILE", help="also write the table as markdown")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ucp-load-exchange-") as tmp:
        for layers in map(int, args.layers.split(",")):
            for world in map(int, args.worlds.split(",")):
                rows.append(measure(layers, world, Path(tmp)))
                print(table(rows[-1:])[-1], flush=True)
    head = (f"Measured {datetime.date.today()} ({platform.machine()}, Python {platform.python_version()}); "
            "simulated ranks, no process group: bytes each rank sends and receives in the check's exchange.")
    text = "\n".join([head, "", *table(rows)])
    print(text)
    if args.markdown_out:
        Path(args.markdown_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
