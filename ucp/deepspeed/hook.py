"""Resume DeepSpeed training from a ucp checkpoint under the engine's own layout, and save into one.

    engine, optimizer, loader, scheduler = ucp.deepspeed.initialize(model=..., config={
        ..., "ucp": {"load": "/ckpt/ucp/global_step1000", "save": {"dir": "/ckpt/ucp", "every": 1000}}})

or, after `deepspeed.initialize`, `ucp.deepspeed.load(engine, path)` and
`ucp.deepspeed.save(engine, dir)` (asynchronous; `ucp.deepspeed.wait(engine)` blocks until it is
committed, and runs at exit too; see `ucp.deepspeed.life`). The `"ucp"` config section:

* `load` (str): the atomic checkpoint to restore, or a save directory (its `latest` is restored);
  or a DeepSpeed checkpoint (save directory with `latest`, or a tag folder), resharded on the fly
  without conversion (`ucp.deepspeed.loading.source`); or
  `"auto"`: the newest committed checkpoint of the `save` folder that passes its checks (an older one,
  with a warning naming both, when the newest is damaged), or a fresh start when there is none; one
  line on rank 0 says which (`ucp.deepspeed.auto_resume`). The same command then serves the
  first start and every restart.
* `save` (dict): `{"dir": str, "every": int, "keep": int}` saves asynchronously into
  `<dir>/global_step<N>` after every `every`-th optimizer step (`engine.step` is wrapped, `train_batch`
  on a pipeline engine; nothing else to call), and moves `<dir>/latest` once each is committed; with
  `keep`, only the newest `keep` committed checkpoints stay (never the one `latest` names, nor one
  being read). A save that finds the previous one still writing waits for it, with a warning.
  Client state for these saves is
  `engine.ucp_client_state` (a dict) when set. Data parallelism (ZeRO 0-3), AutoTP, PipelineModule
  (ZeRO-0/1; with a Megatron-style mpu, ZeRO-1 or fp32 ZeRO-0), an mpu without a pipeline (ZeRO-1) and MoE
  (ZeRO 0-2). With `"memory": {"every": k, "replicas": r, "dir": ...}` it also saves every k steps into each node's host
  memory, with copies on r other nodes, which `"auto"` prefers when newer (`ucp.deepspeed.memory.tier`).
* `elastic` (dict): `{"global_batch": B, "micro_batch": m}` sets DeepSpeed's batch keys for the
  current world size so that every optimizer step sees the same B samples at any world size, in
  uneven shares where B does not divide (`ucp.elastic.shares`); pair it with
  `ucp.elastic.ElasticBatchSampler`, which continues one global sample order from the checkpoint.
  With `"tensor_parallel"` / `"pipeline_parallel"` (sizes the job may use; `"expert_parallel"`: the MoE
  layers' ep_size, which D stays a multiple of) each start takes one T x P x D layout
  (`ucp.elastic.layout_choice`; `ucp.elastic.layout()` returns it, spares wait in `ucp.elastic.spare_loop`):
  B is shared over the D data-parallel ranks, and an AutoTP engine (no `mpu`, not a `PipelineModule`) gets
  `"tensor_parallel": {"autotp_size": T}`. With `"heterogeneous": true` a start
  whose ranks no homogeneous layout uses without spares takes replicas of unequal TP size (pipelines where the
  search's plan has them, `"pipeline_parallel"` allowing), and every
  start of the job trains through the `"layout"` + `"hmp"` path below (`_elastic_hmp`; the script builds
  its replica from `ucp.elastic.layout().hmp_layout(...)` and passes `RankAloneMpu`), the memory tier included.
* `bypass` (bool, default true): redundancy-bypassing read. Each rank reads its own ZeRO
  partitions straight from storage, and every tensor that all ranks of the data-parallel group
  need whole (ZeRO-0 models, frozen parameters, buffers) is read by one rank, chosen to balance
  bytes, and broadcast. False makes every rank read every tensor it touches whole, as stock
  `load_universal` does (for comparison).
* `load_optimizer_states` (bool, default true), `load_lr_scheduler_states` (bool, default true).
* `check_first` (bool, default true): read and check every byte the load will use before installing
  any, so that a damaged checkpoint raises `CorruptCheckpointError` on every rank with the engine
  untouched. Each rank reads exactly its share of the load once and CRCs what it read; a unit with a
  CRC-32 of its own (a chunk of a ucp checkpoint's state, a zip entry of a DeepSpeed rank file) that a
  rank read only part of is checked by one owner rank from the parts' CRC-32s, sent to it by one
  all-to-all (`ucp.deepspeed.loading.exchange`), reading only the bytes no rank loads (ZeRO's padding, small
  entries). What the check read goes straight into the engine where damage can be undone: the
  optimizer states this load creates (an engine that has not stepped: taken back on damage) and the
  fp32 masters while they equal the module's low-precision weights (as DeepSpeed makes them before the
  first step, and keeps them in fp32 training: put back from those weights on damage), so a resume reads
  each byte once. Anything else is kept for the install up to `check_keep_bytes`, or is read again as it
  is installed and compared with the CRC-32 the check saw. False reads once
  and installs layer by layer: unchecked for a DeepSpeed source, and damage found at layer k of a ucp
  checkpoint leaves layers before k loaded.
* `check_keep_bytes` (int, default 64 MiB): see `check_first`; 0 keeps nothing (what the check cannot put
  into the engine is then read twice: the masters of a bf16/fp16 engine that has stepped).
* `strict` (bool, default true): a checkpoint parameter the model lacks is an error (tied weights:
  see below). A frozen parameter of the model that the checkpoint lacks is an error too, unless the
  checkpoint records that it left its frozen parameters out (`save_checkpoint(exclude_frozen_parameters=True)`,
  as the Trainer saves PEFT models: see `ckpt.not_saved`) or `strict` is false: such parameters keep the
  values the model has (its base weights), and `LoadStats.kept` names them. A trainable parameter the
  checkpoint lacks is always an error.
* `layout` (dict, or path to its JSON): an explicit `ucp.hmp.layout.Layout`, for heterogeneous model
  parallelism (Elastor's HMP: TP sizes that differ between replicas), which DeepSpeed itself cannot
  describe. Each rank's module holds the slices the layout gives it (shapes of those slices) and
  exposes the whole model's `ucp_param_table`; every rank reads exactly its slices
  (`ucp.deepspeed.engine.placement`).
* `hmp` (dict): `{"global_batch": B, "micro_batch": m, "shares": [...]}` with a `layout`: train on it. Each
  engine gets one replica's batch keys, and the gradient sync across replicas of unequal TP size runs
  inside `engine.step` (`ucp.deepspeed.engine.hmp_sync`; `engine.ucp_hmp.batch` serves the sampler and loss weights).
  `save` (its `memory` tier too) and `ucp.deepspeed.save` write the checkpoint a homogeneous run writes
  (`ucp.deepspeed.saving.hmp`), and `"load": "auto"` resumes from either tier at any layout.

The load pipeline is `ucp.deepspeed.loading.load`; the save, its cadence and the rest of the engine's checkpoint
life are `ucp.deepspeed.life`. This module wires them into `initialize`, which reads the section once
(`ucp.deepspeed.config.read_section`) and hands each of them its part of that one value.
"""
from __future__ import annotations

import copy
import json
import os
import time
from typing import Any

from ucp.deepspeed.auto_resume import resume_auto
from ucp.deepspeed.config import AUTO, SaveOptions, read_section
from ucp.deepspeed.elastic import check_engine, uses_autotp, with_batch_keys, with_layout_keys
from ucp.deepspeed.engine.hmp_sync import install_sync, replica_batch_keys
from ucp.deepspeed.life import StepBook, life_of, save, wait
from ucp.deepspeed.loading.load import LoadStats, load
from ucp.deepspeed.saving.saver import SaveStats
from ucp.elastic.inprocess import started as in_process_start
from ucp.elastic.layout_choice import RankLayout, hmp_layers
from ucp.elastic.ranks import spare_loop, start_layout
from ucp.elastic.rendezvous import warn_shared_rendezvous_store
from ucp.elastic.shares import ElasticBatch, ElasticSection
from ucp.errors import CheckpointMismatchError, ConfigError
from ucp.format.save_folder import check_save_folder, committed_tags, tag_step
from ucp.hmp.layout import Layout

__all__ = ["CheckpointMismatchError", "LoadStats", "SaveStats", "initialize", "load", "save", "wait"]


def initialize(*args: Any, **kwargs: Any) -> Any:
    """`deepspeed.initialize` with the same arguments and result, plus the `"ucp"` config section.

    The section is read and checked once, before DeepSpeed runs (`read_section`); the caller's config and `args`
    are left as given.
    """
    import deepspeed

    called = time.time()
    config_key = "config" if kwargs.get("config") is not None else "config_params"
    config = kwargs.get(config_key)
    if config is None and args and getattr(args[0], "deepspeed_config", None):
        config_key, config = "config", args[0].deepspeed_config
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    section = read_section(config)
    if section.save is not None:  # a save folder ucp cannot write into is refused before DeepSpeed runs
        check_save_folder(section.save.dir, _highest_start(section.load, section.save), say=False)
    auto_dir = section.save.dir if section.load == AUTO and section.save is not None else None
    layout, hmp, load_options = section.layout, section.hmp, section.load_options
    place = batch = None
    if section.elastic is not None:  # this start's T x P x D (the same on every rank); a spare waits in spare_loop
        place = start_layout(section.elastic, kwargs.get("model"), section.zero_stage, section.memory_tier, section)
        spare_loop()
        if place.hmp:  # "heterogeneous": true: the layout's replicas train through the HMP sync, loaded by the layout
            layout, hmp = _elastic_hmp(section.elastic, place, kwargs.get("model"))
            load_options = {**load_options, "layout": layout}
        else:
            batch = section.elastic.batch(place.dp)
    if section.deepspeed is not None:  # options come from a dict config's "ucp" section
        ds_config = section.deepspeed
        if batch is not None and place is not None:
            ds_config = with_layout_keys(with_batch_keys(ds_config, batch), place, uses_autotp(kwargs))
        if hmp is not None:
            ds_config = replica_batch_keys(ds_config, hmp)
        kwargs = {**kwargs, config_key: ds_config}
        if args and getattr(args[0], "deepspeed_config", None):
            args = (copy.copy(args[0]), *args[1:])
            args[0].deepspeed_config = None
    result = deepspeed.initialize(*args, **kwargs)
    engine = result[0]
    if batch is not None:
        check_engine(engine, batch)
        engine.ucp_elastic = batch
    if place is not None:
        engine.ucp_layout = place
        if place.hmp:  # ElasticBatchSampler serves each replica (its dp_rank) its share
            engine.ucp_elastic = hmp
    if hmp is not None and layout is not None:
        synced = install_sync(engine, layout, hmp)
        life_of(engine).run_before_step(synced.before_step)
        life_of(engine).count_samples(hmp.global_batch)  # B over all replicas, not this replica's share
    resumed = None
    if auto_dir is not None:
        warn_shared_rendezvous_store()
        memory = section.save.memory if section.save is not None else None
        resumed = resume_auto(engine, auto_dir, load, memory, **load_options)
    elif section.load:
        load(engine, section.load, **load_options)
    # ucp.elastic.run: the heartbeat's detect_s, and the in-process restart this start continues, if any
    restart = in_process_start(section.elastic.detect_s if section.elastic is not None else None,
                               auto_dir is None or (resumed is not None and resumed.path is not None))
    if batch is not None:
        life_of(engine).count_samples(batch.global_batch)
    if place is not None or auto_dir is not None:
        life_of(engine).keep_book(StepBook(engine, auto_dir, resumed, called, restart))
    if section.save is not None:
        life_of(engine).save_every(section.save)
    return result


def _highest_start(load: str | os.PathLike[str] | None, save: SaveOptions) -> int | None:
    """The highest step this start can resume from, where it is known before DeepSpeed runs: 0 with no "load", the
    newest committed checkpoint of the save folder under "auto" without a memory tier (a fallback only goes
    lower); else None. What a later save needs is then refused before DeepSpeed runs, not after "starting fresh"
    (`ucp.deepspeed.life` checks again at the step actually loaded)."""
    if not load:
        return 0
    if load != AUTO or save.memory is not None:
        return None
    committed, _ = committed_tags(save.dir)
    return tag_step(committed[0]) if committed else 0


def _elastic_hmp(elastic: ElasticSection, place: RankLayout, model: Any) -> tuple[Layout, ElasticBatch]:
    """This start's layout and its batch (`"heterogeneous": true`): the replicas `ucp.elastic.layout()` chose
    (pipelines where the search's plan has them), over the layers of the model's parameter table, each taking its
    share of the `"elastic"` section's global batch."""
    table = getattr(model, "ucp_param_table", None)
    if not table:
        raise ConfigError('"ucp": {"elastic": {"heterogeneous": true}} trains by a layout: give the module a '
                          "`ucp_param_table` (a list of ucp.hmp.layout.ParamSpec), built for ucp.elastic.layout()")
    layout = place.hmp_layout(hmp_layers(table))
    batch = ElasticBatch(elastic.global_batch, elastic.micro_batch, len(layout.replicas), tuple(place.shares))
    return layout, batch
