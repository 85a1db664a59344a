#!/usr/bin/env python
"""Scale benchmark: the `ucp convert` driver's planning for thousands of rank files and 100,000s of tensors.

    python benchmarks/convert_scale.py [--sizes 10000:64,30000:256,100000:1024,200000:2048]
                                       [--zero3-ranks 16,32,64,128] [--workers 96] [--cache DIR]
                                       [--markdown-out FILE]

Nothing is trained. Each run generates in memory what the driver reads from a DeepSpeed checkpoint,
laid out as DeepSpeed lays it out, every tensor a lazy tensor as `converters/torch_zip` gives it
(storage, absolute byte offset in its rank file):

* ZeRO-1 (--sizes T:R): a Llama-like decoder (hidden 1024, FFN 2816, 256-wide K/V; 9 tensors a
  layer, layers added up to T tensors) on R ranks. The model file's `param_shapes` and module; per
  rank its flat fp32 partition, Adam's `exp_avg` and `exp_avg_sq` over it and `param_slice_mappings`
  (the group flattened, padded to a multiple of R, cut into R equal partitions).
* ZeRO-3 (--zero3-ranks R): the 1T configuration of docs/RAY.md (128 layers, hidden 27,648: 1,155
  tensors, 1.01T parameters) on R ranks: per rank a model file and an optimizer file, each parameter
  cut on its own into R runs, sub-groups of 1e9 elements.

It then times the product code the driver runs, each stage on the previous stage's output:

* plan: `converters.deepspeed.zero.plan_zero12` / `plan_zero3` (slice mappings -> fragments,
  `patterns.recognize`, `plan_common.finish_plan`), `load_dict` answered from memory;
* bins: `convert.balance.plan_bins` for --workers workers;
* shuffle: the Ray backend's `ray_executor.shuffle_plan` over the driver's `WriteBin` tasks;
* index, json: `index_builder.build_index` over synthetic worker results (one CRC-32 per 1 MiB chunk,
  as data files record them) and `json.dumps` of it as `format.folder.commit_index` writes it
  (ZeRO-3: at the largest R only; the index does not depend on R).

Parsing the rank files' pickles (`torch_zip.load_lazy`) is the one step replaced (with the few reads that
check the files are their ranks', `plan_of`); it is timed apart,
per file: on real rank files (the cached benchmarks/convert.py checkpoint, else the tests' tiny ZeRO-1
checkpoint, trained once with torchrun), and on rank 0's two files of the 1T checkpoint at DP 2,048,
`torch.save`d with one-element tensors (as many pickle entries and storages as the real files).
Wall time is perf_counter; memory is the highest RSS during each stage (sampled every 5 ms) above the
RSS before the first stage, so a later stage's figure includes what earlier stages keep (the plan);
every size runs in a new interpreter, so no run reuses memory an earlier one freed.
(tracemalloc would count Python's allocations exactly, but slows the stages down ~10x.) The log-log slope of
time and memory against the fragment count shows how they grow (1 is linear). The last line scales
the largest ZeRO-3 run's cost per fragment, and the 1T pickles' cost per file, to DP 2,048.

Before timing, the smallest size's ZeRO-1 and ZeRO-3 plans are checked: every state's fragments tile
its parameter (ZeRO-3 padded to a multiple of R), and every state is a flat Shard-V (a flat Unique when
one rank holds it all). The script exits 1 if not.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import multiprocessing
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/convert.py and convert_ray.py, beside this script

from convert import CKPT_NAME, DONE_MARKER  # noqa: E402
from convert_ray import tiny_checkpoint  # noqa: E402
from ucp.convert.driver import WriteBin  # noqa: E402
from ucp.convert.ray_executor import shuffle_plan  # noqa: E402
from ucp.converters.deepspeed import slices as deepspeed_slices  # noqa: E402
from ucp.converters.deepspeed import zero3 as deepspeed_zero3  # noqa: E402
from ucp.converters.deepspeed.zero import plan_zero3, plan_zero12  # noqa: E402
from ucp.converters.tag_folder import TagDir  # noqa: E402
from ucp.converters.torch_zip import DtypeName, LazyStorage, LazyTensor, load_lazy  # noqa: E402
from ucp.format.crc import CHUNK_BYTES  # noqa: E402
from ucp.format.folder import data_file_name, tensor_key  # noqa: E402
from ucp.format.index import index_json  # noqa: E402
from ucp.format.safetensors_stream import StoredTensor  # noqa: E402
from ucp.patterns import Pattern  # noqa: E402
from ucp.plan.balance import plan_bins  # noqa: E402
from ucp.plan.index_builder import WrittenFile, build_index, records_of  # noqa: E402
from ucp.plan.plan import WEIGHT_STATE, ConversionPlan  # noqa: E402
from ucp.sizes import human_bytes  # noqa: E402

MOMENTS = ("exp_avg", "exp_avg_sq")
HYPER = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "params": [0]}
HEADER_BYTES = 4096  # where a rank file's first storage starts (the pickle and zip headers come first)
STAGES = ("plan", "bins", "shuffle", "index", "json")
DEFAULT_SIZES = "10000:64,30000:256,100000:1024,200000:2048"
DEFAULT_ZERO3_RANKS = "16,32,64,128"


@dataclass(frozen=True)
class Decoder:
    """A Llama-like decoder: 9 tensors a layer, plus the embedding, the final norm and the head."""

    hidden: int
    ffn: int
    kv: int
    vocab: int = 32000

    def shapes(self, layers: int) -> dict[str, tuple[int, ...]]:
        h = self.hidden
        layer = (("self_attn.q_proj.weight", (h, h)), ("self_attn.k_proj.weight", (self.kv, h)),
                 ("self_attn.v_proj.weight", (self.kv, h)), ("self_attn.o_proj.weight", (h, h)),
                 ("mlp.gate_proj.weight", (self.ffn, h)), ("mlp.up_proj.weight", (self.ffn, h)),
                 ("mlp.down_proj.weight", (h, self.ffn)), ("input_layernorm.weight", (h,)),
                 ("post_attention_layernorm.weight", (h,)))
        shapes = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(layers):
            shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer})
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (self.vocab, h)
        return shapes


# ZeRO-1 sweep: layers added until there are T tensors (hidden 1024: ~1.2M parameters a tensor)
SMALL = Decoder(1024, 2816, 256)
# The 1T configuration of docs/RAY.md: 128 layers, 1,155 tensors, 1.01T parameters
ONE_T = Decoder(27648, 73728, 3456, 128000)
ONE_T_LAYERS = 128
SUB_GROUP_NUMEL = 1_000_000_000  # ZeRO-3's default sub_group_size: one flat tensor per sub-group


class FragmentAddress(NamedTuple):
    """What `param_slice_mappings` holds per parameter (DeepSpeed's `fragment_address`)."""

    numel: int
    start: int


@dataclass
class Synthetic:
    """A ZeRO checkpoint's metadata as the driver reads it: file names and every rank file's dict."""

    stage: int
    where: TagDir
    model_files: dict[tuple[int, int], Path]  # ZeRO-1: rank 0's only
    optim_files: dict[tuple[int, int], Path]
    rank_dicts: dict[str, dict]  # path -> what `load_dict` would parse from it


@dataclass
class Measured:
    stage: int
    tensors: int
    ranks: int
    fragments: int
    chunks: int
    bins: int
    seconds: dict[str, float]
    peak: dict[str, int]  # per stage, the highest RSS above the RSS before the first stage
    index_bytes: int | None


def lazy(path: Path, numel: int, data_offset: int, key: str, dtype: str = "float32") -> LazyTensor:
    return LazyTensor(str(path), LazyStorage(key, DtypeName(dtype), numel), 0, (numel,), (1,), data_offset)


def model_dict(shapes: dict[str, tuple[int, ...]], param_shapes: list[dict], stage: int, ranks: int,
               path: Path) -> dict:
    """A model-states file: bf16 module weights (ZeRO-3: empty placeholders), `param_shapes`, counters, config."""
    module = {name: LazyTensor(str(path), LazyStorage(str(i), DtypeName("bfloat16"), 0 if stage == 3 else
                                                      math.prod(s)), 0, (0,) if stage == 3 else s,
                               (1,) if stage == 3 else _strides(s), HEADER_BYTES)
              for i, (name, s) in enumerate(shapes.items())}
    return {"module": module, "buffer_names": [], "param_shapes": param_shapes, "dp_world_size": ranks,
            "mp_world_size": 1, "global_steps": 10, "ds_version": "0.19.0",
            "ds_config": {"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": stage}}}


def adam_state(path: Path, numel: int, first_key: int) -> tuple[LazyTensor, dict]:
    """A flat fp32 partition of `numel` elements and Adam's state over it: three storages of the rank file."""
    flats = [lazy(path, numel, HEADER_BYTES + k * numel * 4, str(first_key + k)) for k in range(3)]
    return flats[0], {"step": 10.0, "exp_avg": flats[1], "exp_avg_sq": flats[2]}


def synthetic_zero1(folder: Path, shapes: dict[str, tuple[int, ...]], ranks: int) -> Synthetic:
    """The metadata of a ZeRO-1 fp32 checkpoint of `shapes` on `ranks` ranks (one param group).

    As DeepSpeed lays it out: the group's parameters flattened in order, padded to a multiple of `ranks`,
    rank r holding elements [r P, (r + 1) P) of it.
    """
    tag = folder / "global_step10"
    tag.mkdir(parents=True, exist_ok=True)
    model_path = tag / "mp_rank_00_model_states.pt"
    part = -(-sum(math.prod(s) for s in shapes.values()) // ranks)
    bounds, start = [], 0
    for name, shape in shapes.items():
        bounds.append((name, start, start + math.prod(shape)))
        start += math.prod(shape)
    dicts = {str(model_path): model_dict(shapes, [shapes], 1, ranks, model_path)}
    optim_files, i = {}, 0
    for r in range(ranks):
        path = tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        lo, hi = r * part, (r + 1) * part
        mapping = {}
        while i < len(bounds) and bounds[i][1] < hi:
            name, begin, end = bounds[i]
            mapping[name] = FragmentAddress(min(end, hi) - max(begin, lo), max(begin, lo) - lo)
            if end > hi:
                break
            i += 1
        fp32, state = adam_state(path, part, 0)
        osd = {"zero_stage": 1, "partition_count": ranks, "single_partition_of_fp32_groups": [fp32],
               "param_slice_mappings": [mapping], "loss_scaler": None,
               "base_optimizer_state": {"state": {0: state}, "param_groups": [HYPER]}}
        optim_files[(r, 0)] = path
        dicts[str(path)] = {"optimizer_state_dict": osd}
    return Synthetic(1, TagDir(folder, tag.name), {(0, 0): model_path}, optim_files, dicts)


def synthetic_zero3(folder: Path, shapes: dict[str, tuple[int, ...]], ranks: int) -> Synthetic:
    """The metadata of a ZeRO-3 fp32 checkpoint of `shapes` on `ranks` ranks (see `zero3_rank`)."""
    tag = folder / "global_step10"
    tag.mkdir(parents=True, exist_ok=True)
    dicts, model_files, optim_files = {}, {}, {}
    groups = sub_groups(shapes)
    for r in range(ranks):
        model_files[(r, 0)], optim_files[(r, 0)] = paths = zero3_paths(tag, r)
        dicts.update(zip(map(str, paths), zero3_rank(paths, shapes, groups, ranks)))
    return Synthetic(3, TagDir(folder, tag.name), model_files, optim_files, dicts)


def sub_groups(shapes: dict[str, tuple[int, ...]]) -> list[dict[str, tuple[int, ...]]]:
    """ZeRO-3's sub-groups: consecutive parameters of up to SUB_GROUP_NUMEL elements in all."""
    groups: list[dict[str, tuple[int, ...]]] = [{}]
    for name, shape in shapes.items():
        if groups[-1] and sum(math.prod(s) for s in groups[-1].values()) + math.prod(shape) > SUB_GROUP_NUMEL:
            groups.append({})
        groups[-1][name] = shape
    return groups


def zero3_paths(tag: Path, rank: int) -> tuple[Path, Path]:
    return (tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
            tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")


def zero3_rank(paths: tuple[Path, Path], shapes: dict[str, tuple[int, ...]], groups: list[dict], ranks: int
               ) -> tuple[dict, dict]:
    """One rank's model-states and optimizer dicts under ZeRO-3, as DeepSpeed lays them out: each parameter
    cut on its own into `ranks` runs of ceil(numel / ranks), the rank's runs of a sub-group concatenated
    into its flat tensor."""
    model_path, path = paths
    flats, states = [], {}
    for g, group in enumerate(groups):
        fp32, states[g] = adam_state(path, sum(-(-math.prod(s) // ranks) for s in group.values()), 3 * g)
        flats.append(fp32)
    osd = {"zero_stage": 3, "partition_count": ranks, "loss_scaler": None, "fp32_flat_groups": flats,
           "optimizer_state_dict": {"state": states, "param_groups": [HYPER] * len(groups)}}
    return model_dict(shapes, groups, 3, ranks, model_path), {"optimizer_state_dict": osd}


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for s in reversed(shape):
        out.append(step)
        step *= s
    return tuple(reversed(out))


def plan_of(src: Synthetic) -> ConversionPlan:
    """The converter's plan of `src`, its rank files' dicts answered from memory instead of parsed from pickles.

    The synthetic rank files exist in memory only, so the checks that read the real files' zip directories
    and a few of their elements (`converters.rank_identity.check_distinct`, `check_masters_match_module`: an
    `os.stat` and a zip directory per rank file, four element reads per piece of a parameter split between
    ranks) are left out with the parsing; the layout checks on the metadata run."""
    answer = lambda path: src.rank_dicts[str(path)]  # noqa: E731
    skip = lambda *args, **kwargs: None  # noqa: E731
    real = (deepspeed_slices.load_dict, deepspeed_slices.check_distinct, deepspeed_slices.check_masters_match_module,
            deepspeed_zero3.check_distinct)
    deepspeed_slices.load_dict = deepspeed_zero3.load_dict = answer
    deepspeed_slices.check_distinct = deepspeed_zero3.check_distinct = skip
    deepspeed_slices.check_masters_match_module = skip
    try:
        if src.stage == 3:
            return plan_zero3(src.where, src.model_files, src.optim_files)
        model_path = src.model_files[(0, 0)]
        return plan_zero12(src.where, model_path, src.rank_dicts[str(model_path)], src.optim_files)
    finally:
        deepspeed_slices.load_dict = deepspeed_zero3.load_dict = real[0]
        (deepspeed_slices.check_distinct, deepspeed_slices.check_masters_match_module,
         deepspeed_zero3.check_distinct) = real[1:]


def fake_results(tasks: list[WriteBin]) -> list[WrittenFile]:
    """What the workers report per data file: each state's byte range, CRC-32 and one CRC-32 per chunk."""
    results = []
    for task in tasks:
        offset, where = 0, {}
        for p in task.params:
            for state, source in p.states.items():
                n = source.nbytes
                crcs = [(offset + c * CHUNK_BYTES) * 2654435761 & 0xFFFFFFFF for c in range(-(-n // CHUNK_BYTES))]
                key = tensor_key(p.name, state)
                where[key] = StoredTensor(key, offset, offset + n, crcs[0], tuple(crcs))
                offset += n
        results.append(WrittenFile(task.file_name, offset, CHUNK_BYTES, where))
    return results


def pipeline(src: Synthetic, workers: int, clock: Callable[[str, Callable], object],
             with_index: bool) -> tuple[ConversionPlan, int, int | None]:
    """The driver's planning on `src`, stage by stage through `clock(stage, thunk)`; the plan, its bin count and
    the index's size in bytes (None without `with_index`)."""
    plan = clock("plan", lambda: plan_of(src))
    bins = clock("bins", lambda: plan_bins(plan, workers))
    tasks = [WriteBin("/out", data_file_name(i, len(bins)), tuple(b), False, "0" * 32) for i, b in enumerate(bins)]
    clock("shuffle", lambda: shuffle_plan(tasks))
    if not with_index:
        return plan, len(bins), None
    results = fake_results(tasks)
    index = clock("index", lambda: build_index(*records_of(plan), "0" * 32, results))
    text = clock("json", lambda: json.dumps(index_json(index), indent=1))  # as format.folder.commit_index writes it
    return plan, len(bins), len(text)


def in_fresh_process(stage: int, layers: int, ranks: int, workers: int, tmp: Path, with_index: bool) -> Measured:
    """`measure` of a synthetic ZeRO-`stage` checkpoint in a new interpreter, so that no run's RSS reuses memory
    an earlier run freed."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(synthetic_run, stage, layers, ranks, workers, tmp, with_index).result()


def synthetic_run(stage: int, layers: int, ranks: int, workers: int, tmp: Path, with_index: bool) -> Measured:
    if stage == 1:
        src = synthetic_zero1(tmp / f"z1-{ranks}", SMALL.shapes(layers), ranks)
    else:
        src = synthetic_zero3(tmp / f"z3-{ranks}", ONE_T.shapes(layers), ranks)
    return measure(src, workers, with_index)


class PeakRss:
    """The process's RSS, sampled every 5 ms on a thread: `high` is the highest since the last `reset`."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.high = self.proc.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.high = max(self.high, self.proc.memory_info().rss)

    def reset(self) -> None:
        self.high = self.proc.memory_info().rss

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def measure(src: Synthetic, workers: int, with_index: bool) -> Measured:
    seconds: dict[str, float] = {}
    peak: dict[str, int] = {}
    gc.collect()
    with PeakRss() as rss:
        base = rss.high

        def timed(stage: str, thunk: Callable):
            rss.reset()
            start = time.perf_counter()
            out = thunk()
            seconds[stage] = time.perf_counter() - start
            peak[stage] = max(rss.high, rss.proc.memory_info().rss) - base
            return out

        plan, bins, index_bytes = pipeline(src, workers, timed, with_index)
    states = [s for p in plan.params for s in p.states.values()]
    return Measured(src.stage, len(plan.params), len(src.optim_files), sum(len(s.fragments) for s in states),
                    sum(-(-s.nbytes // CHUNK_BYTES) for s in states), bins, seconds, peak, index_bytes)


def check_plan(plan: ConversionPlan, ranks: int, stage: int) -> list[str]:
    """What is wrong with a synthetic ZeRO plan: fragments that do not tile a parameter (ZeRO-3 pads each one
    to a multiple of `ranks`), patterns other than flat Shard-V (flat Unique for a single fragment)."""
    problems = []
    for p in plan.params:
        if set(p.states) != {WEIGHT_STATE, *MOMENTS}:
            problems.append(f"{p.name}: states {sorted(p.states)}")
        for state, source in p.states.items():
            covered = 0
            for f in source.fragments:
                if f.info.offset != covered:
                    problems.append(f"{p.name}:{state}: a fragment starts at {f.info.offset}, expected {covered}")
                covered += f.piece.numel
            padding = -(-p.numel // ranks) * ranks - p.numel if stage == 3 else 0
            if covered != p.numel + padding:
                problems.append(f"{p.name}:{state}: fragments cover {covered} elements, expected {p.numel} + "
                                f"{padding} padding")
            want = Pattern.SHARD_V if len(source.fragments) > 1 else Pattern.UNIQUE
            if source.spec.pattern != want or not source.spec.flat:
                problems.append(f"{p.name}:{state}: {source.spec.pattern.value} (flat={source.spec.flat}), expected "
                                f"flat {want.value} for {len(source.fragments)} fragment(s)")
    return problems


def pickle_cost(cache: Path) -> tuple[float, int, int, str]:
    """Seconds per optimizer rank file to parse its pickle (`load_lazy`, median of 5), mappings per file, file
    count, and which checkpoint: the cached benchmark checkpoint if built, else the tiny test one."""
    bench = cache / CKPT_NAME
    save_dir = bench / "ckpt" if (bench / DONE_MARKER).is_file() else tiny_checkpoint(cache)
    files = sorted(save_dir.glob("*/*optim_states.pt"))
    mappings = sum(len(m) for f in files for m in load_lazy(f)["optimizer_state_dict"]["param_slice_mappings"])
    return median_seconds(files), mappings // len(files), len(files), str(save_dir)


def one_t_pickle_cost(folder: Path) -> float:
    """Seconds to parse rank 0's two pickles (`load_lazy`, median of 5) of the 1T ZeRO-3 checkpoint at DP 2,048,
    `torch.save`d with one-element tensors: the pickle holds as many entries and storages as the real one."""
    import torch

    shapes = ONE_T.shapes(ONE_T_LAYERS)
    paths = zero3_paths(folder, 0)
    for path, obj in zip(paths, zero3_rank(paths, shapes, sub_groups(shapes), 2048)):
        torch.save(_as_torch(obj, torch), path)
    return median_seconds(list(paths))


def _as_torch(obj, torch):
    """`obj` with every lazy tensor a real one of at most one element, of its dtype."""
    if isinstance(obj, dict):
        return {k: _as_torch(v, torch) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_as_torch(v, torch) for v in obj]
    if isinstance(obj, LazyTensor):
        return torch.zeros(min(obj.numel, 1), dtype=getattr(torch, obj.dtype))
    return obj


def median_seconds(files: list[Path]) -> float:
    """Seconds per file `load_lazy` takes over `files`, median of 5 rounds."""
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for f in files:
            load_lazy(f)
        runs.append((time.perf_counter() - start) / len(files))
    return sorted(runs)[2]


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x: 1 is linear growth."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def table(runs: list[Measured]) -> list[str]:
    lines = ["| tensors | rank files | fragments | chunk CRCs | bins | plan (s) | bins (s) | shuffle (s) | index (s) "
             "| json (s) | total (s) | µs / fragment | peak RSS growth | B / fragment | index JSON |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in runs:
        total, peak = sum(m.seconds.values()), max(m.peak.values())
        lines.append(f"| {m.tensors:,} | {m.ranks:,} | {m.fragments:,} | {m.chunks:,} | {m.bins:,} | "
                     + " | ".join(f"{m.seconds[s]:.2f}" if s in m.seconds else "—" for s in STAGES)
                     + f" | {total:.2f} | {total / m.fragments * 1e6:.1f} | {human_bytes(peak)} | "
                     f"{peak / m.fragments:.0f} | "
                     f"{human_bytes(m.index_bytes) if m.index_bytes else '—'} |")
    frags = [m.fragments for m in runs]
    if len(set(frags)) < 2:
        return lines  # a slope needs two sizes
    lines += ["", "Log-log slope against the fragment count (1.00 = linear):", "",
              "| stage | time slope | µs / fragment, smallest → largest | peak RSS growth slope |",
              "|---|---:|---|---:|"]
    for s in STAGES:
        if all(s in m.seconds for m in runs):
            times = [m.seconds[s] for m in runs]
            lines.append(f"| {s} | {slope(frags, times):.2f} | {times[0] / frags[0] * 1e6:.2f} → "
                         f"{times[-1] / frags[-1] * 1e6:.2f} | {slope(frags, [m.peak[s] for m in runs]):.2f} |")
    return lines


def one_t_estimate(runs: list[Measured], seconds_per_file: float) -> list[str]:
    """The driver's planning for the 1T configuration at DP 2,048: per-fragment costs of the largest ZeRO-3 run
    scaled by the fragment count, the index as measured (it depends on the tensors and bytes, not on DP)."""
    largest, ranks = runs[-1], 2048
    fragments = largest.fragments // largest.ranks * ranks
    per_fragment = sum(largest.seconds[s] for s in ("plan", "bins", "shuffle")) / largest.fragments
    plan_peak = max(largest.peak[s] for s in ("plan", "bins", "shuffle"))
    peak_per_fragment = plan_peak / largest.fragments
    index_peak = max(largest.peak["index"], largest.peak["json"]) - plan_peak
    index_s = largest.seconds["index"] + largest.seconds["json"]
    files = 2 * ranks  # a model-states and an optimizer file per rank
    total = files * seconds_per_file + fragments * per_fragment + index_s
    return ["", f"1T at DP {ranks:,} (ZeRO-3, {largest.tensors:,} tensors, {fragments:,} fragments, {files:,} rank "
            f"files), one driver core: pickles {files * seconds_per_file:.0f} s + plan, bins, shuffle "
            f"{fragments * per_fragment:.0f} s ({per_fragment * 1e6:.1f} µs / fragment) + index and JSON "
            f"{index_s:.0f} s (measured at this size) ≈ {total:.0f} s; driver memory ≈ "
            f"{human_bytes(fragments * peak_per_fragment)} for the plan ({peak_per_fragment:.0f} B / fragment), "
            f"+ {human_bytes(index_peak)} more at the index's peak (measured at this size), "
            f"index.json {human_bytes(largest.index_bytes)}."]


def report(zero1: list[Measured], zero3: list[Measured], per_file: tuple[float, int, int, str], one_t_file: float,
           workers: int) -> str:
    seconds_per_file, mappings, n_files, where = per_file
    load = os.getloadavg()
    lines = [f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {os.cpu_count()} CPUs "
             f"({platform.processor() or platform.machine()}), Python {platform.python_version()}, "
             f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}; fp32 + Adam, --workers {workers}", "",
             f"ZeRO-1, Llama-like layers of hidden {SMALL.hidden} added until the tensor count is reached:", "",
             *table(zero1), "",
             f"ZeRO-3, the 1T configuration ({ONE_T_LAYERS} layers, hidden {ONE_T.hidden}), growing DP "
             "(index and JSON at the largest only):", "", *table(zero3),
             "", f"Rank-file pickles, not in the tables: `load_lazy` takes {seconds_per_file * 1e3:.2f} ms per "
             f"optimizer file ({n_files} files of {where}, {mappings} slice mappings each, median of 5), i.e. "
             f"{seconds_per_file * zero1[-1].ranks:.1f} s for {zero1[-1].ranks:,} files on one core. A rank's two "
             f"files of the 1T ZeRO-3 checkpoint at DP 2,048 (`torch.save`d with one-element tensors, as many "
             f"entries and storages as the real ones) take {one_t_file * 1e3:.1f} ms each."]
    return "\n".join(lines + one_t_estimate(zero3, one_t_file))


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        tensors, _, ranks = item.partition(":")
        sizes.append((int(tensors), int(ranks)))
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"ZeRO-1 runs, TENSORS:RANKS,... (default {DEFAULT_SIZES})")
    ap.add_argument("--zero3-ranks", default=DEFAULT_ZERO3_RANKS,
                    help=f"ZeRO-3 runs of the 1T configuration, DP,... (default {DEFAULT_ZERO3_RANKS})")
    ap.add_argument("--workers", type=int, default=96, help="workers plan_bins balances over (default 96)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/ucp-bench"),
                    help="where real rank files are found or the tiny checkpoint is built (default ~/.cache/ucp-bench)")
    ap.add_argument("--markdown-out", metavar="FILE", help="also write the tables as markdown")
    args = ap.parse_args(argv)
    sizes = parse_sizes(args.sizes)
    zero3_ranks = [int(r) for r in args.zero3_ranks.split(",")]
    per_file = pickle_cost(Path(args.cache).expanduser())
    with tempfile.TemporaryDirectory(prefix="ucp-scale-") as tmp:
        one_t_file = one_t_pickle_cost(Path(tmp))
        tensors, ranks = sizes[0]
        checks = [(synthetic_zero1(Path(tmp) / "check1", SMALL.shapes((tensors - 3) // 9), ranks), ranks, 1),
                  (synthetic_zero3(Path(tmp) / "check3", SMALL.shapes((tensors - 3) // 9), ranks), ranks, 3)]
        for src, ranks, stage in checks:
            problems = check_plan(plan_of(src), ranks, stage)
            if problems:
                print(f"the synthetic ZeRO-{stage} plan on {ranks} ranks is wrong ({len(problems)} problems):",
                      *problems[:10], sep="\n  ", file=sys.stderr)
                return 1
        print(f"checked: the ZeRO-1 and ZeRO-3 plans of {tensors:,} tensors on {ranks:,} ranks tile every parameter, "
              "flat Shard-V (flat Unique when one rank holds it)", flush=True)
        zero1, zero3 = [], []
        for tensors, ranks in sizes:
            zero1.append(in_fresh_process(1, (tensors - 3) // 9, ranks, args.workers, Path(tmp), True))
            print(f"ZeRO-1, {tensors:,} tensors, {ranks:,} ranks: {sum(zero1[-1].seconds.values()):.1f} s", flush=True)
        for ranks in zero3_ranks:
            zero3.append(in_fresh_process(3, ONE_T_LAYERS, ranks, args.workers, Path(tmp), ranks == zero3_ranks[-1]))
            print(f"ZeRO-3 1T, {ranks:,} ranks: {sum(zero3[-1].seconds.values()):.1f} s", flush=True)
    text = report(zero1, zero3, per_file, one_t_file, args.workers)
    print(text)
    if args.markdown_out:
        Path(args.markdown_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
