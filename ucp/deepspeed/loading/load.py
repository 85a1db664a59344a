"""The load pipeline: restore a DeepSpeed engine from a ucp or DeepSpeed checkpoint under the engine's own layout.

    client_state = ucp.deepspeed.load(engine, "/ckpt/ucp")   # or through `"ucp": {"load": ...}` (`ucp.deepspeed.hook`)

A load opens the checkpoint, checks it against the engine's target (`ucp.deepspeed.engine.targets`) on every rank and
agrees on the verdict, reads and checks every byte it will use (`check_first`), then installs the tensors layer by
layer, the optimizer's step and hyper-parameters, the loss scale, the LR scheduler and the training counters. The
options are those of the `"ucp"` config section (`ucp.deepspeed.hook`'s docstring).

Loading is layer by layer: a rank holds its own shard plus one batch of a layer's states at a time
(`BATCH_BYTES`, or one state larger than that; with `check_first`, plus up to `check_keep_bytes` of what
the check read, kept for the install). Read buffers from 1 MiB on are mappings of their own
(`ucp.storage.fileio.read_buffer`), returned to the system as soon as they are freed. From a DeepSpeed
checkpoint, what the check puts straight into the engine (a rank's own run of a flat-stored state, stored in
the engine's dtype) is read into the engine's memory itself, with no buffer (`Source.check`'s `into`), so a
zero-conversion resume holds nothing beyond the engine and the states it creates.

Tied weights (one Parameter under two names, e.g. `lm_head.weight` and `model.embed_tokens.weight`)
are one parameter: the checkpoint records the second name as an alias of the first (its index's
`aliases`), the model's `named_parameters` lists it once, so a tied model loads a tied checkpoint
strictly. When only one side ties them:

* tied checkpoint, untied model: the model's own copy of the alias gets the source's weight and
  optimizer states (both copies start equal and train apart from there);
* untied checkpoint, tied model: loads when the checkpoint's two copies are equal (every state the
  alias holds); otherwise `CheckpointMismatchError` names the alias, and `strict=False` loads the
  source's values for both (the checkpoint's other copy is ignored).

Target layouts: ZeRO stage 0-3 at any data-parallel degree, fp32/fp16/bf16 (`ucp.deepspeed.engine.targets`);
DeepSpeed AutoTP tensor parallelism with ZeRO 0-3, where each TP rank loads the box of every full
tensor that the engine's own `affine_map` gives it (`ucp.deepspeed.engine.autotp`); `PipelineModule`
engines at any number of stages, each stage loading its own layers (a tied module on every stage
that uses it) within its data-parallel group (`ucp.deepspeed.engine.targets`); native DeepSpeed MoE at
any `ep_size`, each rank loading the experts of the global ids it owns within its
expert-data-parallel group (`ucp.deepspeed.engine.moe`); a Megatron-style `mpu` (TP), in a `PipelineModule`
or not, at any TP x PP x DP, each TP rank loading the boxes of its shards that the module's
`universal_checkpoint_info` pattern lists give (`ucp.deepspeed.loading.mpu`; a fused QKV or gate/up shard from a
ucp checkpoint only); and an explicit `layout`.
"""
from __future__ import annotations

import copy
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ucp import collectives, errors
from ucp.checkpoint import AtomicCheckpoint, Checkpoint, open_checkpoint
from ucp.deepspeed.engine.autotp import with_tensor_parallel
from ucp.deepspeed.engine.placement import as_layout, place_by_layout
from ucp.deepspeed.engine.targets import OPTIMIZER_STATES, Target, TargetTensor, module_aliases, target_for
from ucp.deepspeed.loading.mpu import serves, shard_shapes, with_mpu
from ucp.deepspeed.loading.readers import assign_readers
from ucp.deepspeed.loading.source import Source, box_numel, source_for
from ucp.deepspeed.saving.layout import mpu_tp_size
from ucp.errors import CheckpointMismatchError, CorruptCheckpointError, UcpError, UnsupportedLayoutError
from ucp.format import loss_scale
from ucp.format.folder import INDEX_NAME, latest_checkpoint, reading
from ucp.hmp.layout import Layout, ParamSpec
from ucp.storage.layer import has_locks, is_file
from ucp.storage.locations import Location, location

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from torch.distributed import ProcessGroup

logger = logging.getLogger("ucp.deepspeed")
KEEP_BYTES = 64 << 20  # of what the check before a load read, kept for the install (beyond it: read again)
BATCH_BYTES = 32 << 20  # of a layer's values read at once
Key = tuple[str, str]  # (parameter, state)
Owners = dict[Key, int]  # the rank that reads each shared key
Groups = dict[int, tuple[tuple[int, ...], "ProcessGroup | None"]]  # id(tensor) -> (its DP ranks, their group)


@dataclass
class LoadStats:
    """What this rank read from storage and exchanged with its data-parallel group."""

    bytes_read: int = 0
    bytes_checked_extra: int = 0  # of bytes_read: read only to check whole chunks around a partial read
    bytes_read_again: int = 0  # not in bytes_read: what check_first read but could not keep, read again to install
    bytes_checked_sources: int = 0  # not in bytes_read: bytes of DeepSpeed rank-file entries no rank loads, read
    # only to check the entries' CRCs (ZeRO's padding, small entries: steps and other scalars)
    bytes_exchanged: int = 0  # sent and received to check units that several ranks read parts of
    read_calls: int = 0
    bytes_broadcast: int = 0
    tensors: int = 0
    layers: int = 0
    peak_layer_bytes: int = 0
    client_state: dict[str, Any] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)  # frozen parameters the checkpoint does not hold, left as they were


def load(engine: DeepSpeedEngine, path: str | os.PathLike[str], *, bypass: bool = True,
         load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True, strict: bool = True,
         check_first: bool = True,
         layout: Layout | dict[str, Any] | str | os.PathLike[str] | None = None,
         param_table: Sequence[ParamSpec] | None = None, check_keep_bytes: int = KEEP_BYTES) -> dict[str, Any]:
    """Restore `engine` from the checkpoint at `path`; returns the saved client state.

    `path` is a ucp checkpoint (or a save directory: its `latest`), or a DeepSpeed checkpoint (a
    save directory with `latest`, or a tag folder) of any layout `ucp convert` reads, resharded on
    the fly without conversion (`ucp.deepspeed.loading.source`). Everything is checked before the engine is
    touched: a missing, extra or reshaped parameter, an optimizer whose states differ from the
    checkpoint's, or (strict) a weight the model ties that the checkpoint holds as two different
    copies, raises `CheckpointMismatchError`; an unreadable DeepSpeed checkpoint (a missing rank
    file, files of mixed runs) raises its `UcpError` on every rank. A tied alias of the checkpoint
    that the model keeps untied loads its source's weight and states (module docstring, "Tied weights").
    With `layout` (HMP included, see `ucp.deepspeed.engine.placement`) each module tensor is the slice the
    layout gives this rank; `param_table` (default: the module's `ucp_param_table`) describes the
    full model. `check_keep_bytes` bounds what the check before the load keeps for the install
    (`ucp.deepspeed.hook`'s docstring, `check_first`).
    """
    place = location(path)  # a URL no installed filesystem serves is refused before the engine is touched
    with reading(_tag_folder(place)):
        return _load(engine, place, bypass, load_optimizer_states, load_lr_scheduler_states, strict, check_first,
                     layout, param_table, check_keep_bytes)


def _tag_folder(path: Location) -> Location:
    """The checkpoint folder `path` names (a save folder's `latest`), for the reading lock."""
    if not has_locks(path) or is_file(path / INDEX_NAME):
        return path
    try:
        return latest_checkpoint(path) or path
    except (OSError, UcpError):  # an unreadable `latest`: the load itself says what is wrong with it
        return path


def _load(engine: DeepSpeedEngine, path: Location, bypass: bool, load_optimizer_states: bool,
          load_lr_scheduler_states: bool, strict: bool, check_first: bool,
          layout: Layout | dict[str, Any] | str | os.PathLike[str] | None,
          param_table: Sequence[ParamSpec] | None, keep_bytes: int) -> dict[str, Any]:
    target = target_for(engine)
    shards = shard_shapes(target) if layout is None and serves(target) else None  # a collective: before any raise
    try:
        ckpt = open_checkpoint(path)
        with_tensor_parallel(target)
        model_names = None
        if layout is not None:
            model_names = _place(engine, target, layout, param_table)
        elif shards is not None:
            with_mpu(target, shards)
            _check_fused_source(ckpt, target, engine)
        state_names, kept = _check(ckpt, target, engine, load_optimizer_states, strict, model_names)
        steps = _saved_steps(ckpt, target) if load_optimizer_states else {}
        if load_lr_scheduler_states:
            _check_lr_scheduler(ckpt, engine)
        error = None
    except UcpError as e:
        error = e
    _agree(error)
    stats = LoadStats(client_state=dict(ckpt.client_state), kept=kept)
    if kept:
        target.tensors = [t for t in target.tensors if t.name not in set(kept)]
        _say_kept(ckpt, kept)
    with torch.no_grad():
        _load_tensors(source_for(ckpt), target, state_names, bypass, check_first, keep_bytes, stats)
    if load_optimizer_states:
        for group, step in steps.items():
            target.set_step(group, step)
        _restore_optimizer_globals(ckpt, target)
        _restore_loss_scale(ckpt, engine)
    with torch.no_grad():
        target.finish()
    training = ckpt.training
    for key in ("global_steps", "global_samples", "skipped_steps"):
        if key in training:
            setattr(engine, key, int(training[key]))
    if load_lr_scheduler_states and engine.lr_scheduler is not None and ckpt.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(ckpt.lr_scheduler)
    engine.ucp_load_stats = stats
    return stats.client_state


# -- checks, before anything is written ---------------------------------------------------------------

def _place(engine: DeepSpeedEngine, target: Target, layout: Layout | dict[str, Any] | str | os.PathLike[str],
           param_table: Sequence[ParamSpec] | None) -> set[str]:
    table = param_table if param_table is not None else getattr(engine.module, "ucp_param_table", None)
    if table is None:
        raise UnsupportedLayoutError("loading by a layout needs the model's parameter table: pass param_table= "
                                     "or give the module a `ucp_param_table` (a list of ucp.hmp.layout.ParamSpec)")
    rank = collectives.rank()
    return place_by_layout(target, as_layout(layout), table, rank)


def _check_fused_source(ckpt: Checkpoint, target: Target, engine: DeepSpeedEngine) -> None:
    """A fused TP shard (several boxes of the full tensor) is read from a ucp checkpoint only."""
    fused = next((t.name for t in target.tensors if t.pieces is not None), None)
    if fused is not None and not isinstance(ckpt, AtomicCheckpoint):
        raise UnsupportedLayoutError(f"{ckpt.path}: a DeepSpeed checkpoint does not load into this Megatron-style "
                                     f"mpu at TP {mpu_tp_size(engine)} on the fly ('{fused}' is fused); run "
                                     "`ucp convert` on it and load the converted checkpoint")


def _check(ckpt: Checkpoint, target: Target, engine: DeepSpeedEngine, load_optimizer_states: bool, strict: bool,
           model_names: set[str] | None = None) -> tuple[list[str], list[str]]:
    """The optimizer states to load, and the frozen parameters the checkpoint does not hold (kept as they are)."""
    if isinstance(ckpt, AtomicCheckpoint):
        ckpt.check_headers()  # every read below takes the index's dtypes and shapes: they must be the files' own
    names = ckpt.names  # in the checkpoint's order, which errors name the first of
    params = set(names)
    kept = []
    for t in target.tensors:
        if t.name not in params and t.name not in ckpt.aliases:
            if t.kind == "frozen" and (ckpt.not_saved is not None or not strict):
                kept.append(t.name)
                continue
            raise CheckpointMismatchError(_missing(ckpt, t.name, t.kind))
        saved = ckpt.info(t.name)  # a tied alias the model keeps untied gets its source's weight and states
        if saved.shape != t.shape:
            raise CheckpointMismatchError.shape(t.name, saved.shape, t.shape, getattr(ckpt, "path", "the checkpoint"))
        if t.kind == "param" and load_optimizer_states and saved.kind != "param":
            raise CheckpointMismatchError(f"{t.name}: trainable in the model but {saved.kind} in the "
                                          "checkpoint, which has no optimizer state for it; pass "
                                          "load_optimizer_states=False to load weights only")
    tied = module_aliases(engine.module)
    if strict:
        for alias, source in tied.items():
            if alias in params:
                _check_untied_copy(ckpt, alias, source)
        known = (model_names if model_names is not None else target.model_names()) | set(tied)
        extra = [n for n in [*names, *ckpt.aliases] if n not in known]
        if extra:
            raise CheckpointMismatchError(f"{ckpt.path}: holds parameter '{extra[0]}' ({len(extra)} in all) that "
                                          "the model does not have; pass strict=False to ignore them")
    saved_states = _optimizer_states(ckpt, target, engine) if load_optimizer_states else []
    for t in target.tensors:
        if t.name in kept:
            continue
        missing = [s for s in _states_of(t, saved_states) if s not in ckpt.states(t.name)]
        if missing:
            raise CheckpointMismatchError(f"{ckpt.path}: parameter '{t.name}' has no state '{missing[0]}'; the "
                                          "index is damaged, convert the checkpoint again")
    return saved_states, kept


def _missing(ckpt: Checkpoint, name: str, kind: str) -> str:
    """Why the model's parameter `name` (of `kind`) cannot be loaded from `ckpt`, which lacks it, and the fix."""
    if kind == "param" and ckpt.not_saved is not None:
        return (f"{ckpt.path}: has no parameter '{name}', which the model trains; the checkpoint holds no "
                f"{ckpt.not_saved.kind} parameters ({ckpt.not_saved}), but this one is trainable here: freeze it "
                "as the run that saved the checkpoint did (the same PEFT config), or resume from a checkpoint "
                "that holds it")
    if kind == "frozen":
        return (f"{ckpt.path}: has no parameter '{name}', which the model has (frozen); if the checkpoint was "
                "saved with exclude_frozen_parameters, pass strict=False to keep the model's own value; "
                "otherwise, was it saved from another model?")
    return f"{ckpt.path}: has no parameter '{name}', which the model has; was it saved from another model?"


def _say_kept(ckpt: Checkpoint, kept: list[str]) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    why = f" ({ckpt.not_saved})" if ckpt.not_saved is not None else " (strict=False)"
    logger.info("%s: kept %d frozen parameter(s) as the model has them, which the checkpoint does not hold%s: %s",
                ckpt.path, len(kept), why, ", ".join(kept[:3]) + (", ..." if len(kept) > 3 else ""))


def _optimizer_states(ckpt: Checkpoint, target: Target, engine: DeepSpeedEngine) -> list[str]:
    """The optimizer states the checkpoint saved, if the engine's optimizer keeps the same ones."""
    saved_states = list((ckpt.optimizer or {}).get("states", []))
    basic = type(getattr(engine, "basic_optimizer", None) or target.engine.optimizer).__name__
    expected = OPTIMIZER_STATES.get(basic.lower())
    if expected is not None and set(saved_states) != set(expected):
        saved = (f"optimizer {ckpt.optimizer.get('type')} saved states {saved_states}" if ckpt.optimizer is not None
                 else "saved no optimizer state")
        raise CheckpointMismatchError(
            f"{ckpt.path}: {saved}, but the engine's {basic} keeps {list(expected)}; use the same optimizer or pass "
            "load_optimizer_states=False")
    return saved_states


def _check_untied_copy(ckpt: Checkpoint, alias: str, source: str) -> None:
    """The model ties `alias` to `source`, the checkpoint holds both: only equal copies make one parameter."""
    if source not in ckpt.names and source not in ckpt.aliases:
        return  # reported as a missing parameter
    copy, kept = ckpt.info(alias), ckpt.info(source)
    for state in copy.states:
        if (state not in kept.states or copy.shape != kept.shape
                or not torch.equal(ckpt.tensor(alias, state), ckpt.tensor(source, state))):
            raise CheckpointMismatchError(
                f"{alias}: the model ties it to '{source}', but the checkpoint holds it untied with another "
                f"'{state}'; pass strict=False to load '{source}' for both, or untie it in the model")


def _agree(error: UcpError | None, kind: type[UcpError] | None = None) -> None:
    """Every rank raises if any rank found a mismatch (pipeline stages, expert ranks and layout slices
    differ between ranks) or damaged bytes, so none goes on into collectives the others never join.
    The others raise the same class as the rank that found it (else `kind`, default
    `CheckpointMismatchError`), naming that rank, so every rank can take the same decision on it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    found: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    first = next(((rank, f) for rank, f in enumerate(found) if f is not None), None)
    if first is not None:
        rank, (name, message) = first
        cls = getattr(errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, UcpError)):
            cls = kind or CheckpointMismatchError
        raise cls(f"rank {rank}: {message}")


# -- tensors, layer by layer ----------------------------------------------------------------------------

_LAYER = re.compile(r"^(.*?\.\d+)\.")


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: its name up to the first numeric component, else its module."""
    m = _LAYER.match(name)
    return m.group(1) if m else name.rsplit(".", 1)[0]


def _layers(tensors: list[TargetTensor], state_names: list[str]) -> Iterator[dict[tuple[str, str], TargetTensor]]:
    """What the load wants, one layer at a time: (name, state) -> the tensor that takes it."""
    batch: list[TargetTensor] = []
    for t in tensors:
        if batch and layer_of(t.name) != layer_of(batch[-1].name):
            yield _wants(batch, state_names)
            batch = []
        batch.append(t)
    if batch:
        yield _wants(batch, state_names)


def _batches(wants: dict[Key, TargetTensor], source: Source) -> Iterator[dict[Key, TargetTensor]]:
    """One layer's `wants` in consecutive parts of at most `BATCH_BYTES` of the values they read (a state larger
    than that alone), so that a rank holds one part at a time, not a whole layer."""
    batch: dict[Key, TargetTensor] = {}
    size = 0
    for key, t in wants.items():
        nbytes = (box_numel(t) if source.shared(key, t) else t.numel) * source.dtype(key).itemsize
        if batch and size + nbytes > BATCH_BYTES:
            yield batch
            batch, size = {}, 0
        batch[key] = t
        size += nbytes
    if batch:
        yield batch


def _wants(layer: list[TargetTensor], state_names: list[str]) -> dict[tuple[str, str], TargetTensor]:
    return {(t.name, s): t for t in layer for s in _states_of(t, state_names)}


def _states_of(t: TargetTensor, state_names: list[str]) -> list[str]:
    if t.kind == "buffer":
        return ["value"]
    return ["fp32"] + (state_names if t.kind == "param" else [])


def _load_tensors(source: Source, target: Target, state_names: list[str], bypass: bool, check_first: bool,
                  keep_bytes: int, stats: LoadStats) -> None:
    me = collectives.rank()
    groups = _dp_groups(target)
    owners = _shared_owners(source, target, state_names, groups) if bypass else {}
    fresh = target.prepare_states(state_names)
    kept: dict[Key, torch.Tensor] = {}
    done: set[Key] = set()
    if check_first:
        if target.prepare_masters():
            fresh.add("fp32")
        kept, done = _check_first(source, target, state_names, owners, me, bypass, fresh, keep_bytes, stats)
    damaged: UcpError | None = None
    for layer in _layers(target.tensors, state_names):
        for wants in _batches(layer, source):
            mine = [key for key in _mine(wants, owners, me) if key not in done]
            try:
                values = {key: kept.pop(key) for key in mine if key in kept}
                values.update(source.read(wants, [key for key in mine if key not in values], bypass, stats))
            except UcpError as exc:  # damaged bytes: keep the group's broadcasts going, then raise on every rank
                damaged, values = damaged or exc, {}
            for key, t in wants.items():  # in the same order on every rank of a group
                if key not in owners:
                    continue
                ranks, group = groups[id(t)]
                if len(ranks) > 1:
                    values[key] = _broadcast(source, key, t, values.get(key), owners[key], group, stats)
                if not t.whole and key in values:
                    values[key] = values[key].narrow(0, t.start, t.numel)
            if damaged is not None:
                continue  # nothing more is installed
            for key, t in wants.items():
                if t.numel and key not in done:
                    t.install(key[1], values[key])
                    stats.tensors += 1
            stats.peak_layer_bytes = max(stats.peak_layer_bytes,
                                         sum(v.numel() * v.element_size() for v in values.values()))
        stats.layers += 1
    _agree(damaged, CorruptCheckpointError)


def _check_first(source: Source, target: Target, state_names: list[str], owners: Owners, me: int, bypass: bool,
                 fresh: set[str], keep_bytes: int, stats: LoadStats) -> tuple[dict[Key, torch.Tensor], set[Key]]:
    """Read and check every byte the load will use, before any is installed where the engine could tell: a
    damaged checkpoint raises on every rank with every engine as it was (`Source.check`, then `Source.close`,
    the one collective before the verdict).

    Each layer's values go straight into the engine where it can be put back (`fresh`): the optimizer states
    this load created (an engine that has not stepped has none; `Target.drop_new_states` takes them back on
    damage) and, under "fp32", the masters when they equal the module's low-precision copies
    (`Target.prepare_masters`; `Target.restore_masters` puts them back). Other values are kept for the install
    while what is kept fits in `keep_bytes`, or are dropped, to be read again as they are installed (and
    compared with what was checked). Returns (kept values, keys already installed)."""
    kept: dict[Key, torch.Tensor] = {}
    done: set[Key] = set()
    damaged: UcpError | None = None
    try:
        for wants in (batch for layer in _layers(target.tensors, state_names) for batch in _batches(layer, source)):
            mine = _mine(wants, owners, me)
            into = {key: wants[key].view(key[1]) for key in mine if _into_engine(key, wants[key], owners, fresh)}
            checked = source.check(wants, mine, bypass, stats, into)  # where it can, straight into the engine
            del into
            _take_checked(checked, wants, owners, fresh, kept, done, keep_bytes, stats)
            del checked  # before the next batch is read: a batch at a time (the largest state's read, 47 MiB a
            # rank for the 112M benchmark Llama's embedding at dp 2, was still held while the next one was read)
    except UcpError as exc:  # still meet the others in the exchange below
        damaged = exc
    try:
        source.close(stats)
    except UcpError as exc:
        damaged = damaged or exc
    try:
        _agree(damaged, CorruptCheckpointError)
    except UcpError:
        target.drop_new_states()
        if "fp32" in fresh:
            target.restore_masters()
        raise
    return kept, done


def _take_checked(checked: dict[Key, torch.Tensor], wants: dict[Key, TargetTensor], owners: Owners, fresh: set[str],
                  kept: dict[Key, torch.Tensor], done: set[Key], keep_bytes: int, stats: LoadStats) -> None:
    """One batch of what the check read: into the engine where damage can be undone (`_check_first`), else into
    `kept` while it fits in `keep_bytes`; the rest is dropped. A function of its own, and `checked` emptied as it
    goes, so that no value outlives its install here (a loop variable would hold the batch's last one)."""
    held = sum(v.numel() * v.element_size() for v in kept.values())
    for key in list(checked):  # in the batch's order
        value = checked.pop(key)
        t = wants[key]
        if _into_engine(key, t, owners, fresh):
            t.install(key[1], value)  # nothing to copy where the check read it there
            done.add(key)
            stats.tensors += 1
        elif held + value.numel() * value.element_size() <= keep_bytes:
            kept[key] = value if _alone(value) else value.clone()  # not a view keeping a whole read alive
            held += value.numel() * value.element_size()
        del value


def _into_engine(key: Key, t: TargetTensor, owners: Owners, fresh: set[str]) -> bool:
    """Whether the check puts `key`'s value straight into the engine: this rank's own elements of a parameter's
    state, in memory that the engine reads only after the verdict or that is put back on damage (`fresh`)."""
    return key[1] in fresh and key not in owners and t.kind == "param"


def _alone(value: torch.Tensor) -> bool:
    """Whether `value` is all its storage holds."""
    return value.untyped_storage().nbytes() == value.numel() * value.element_size()


def _mine(wants: dict[Key, TargetTensor], owners: Owners, me: int) -> list[Key]:
    """The keys this rank reads: shared ones it was assigned (their whole box), the rest where it holds elements."""
    mine = []
    for key, t in wants.items():
        if (owners[key] == me and box_numel(t) > 0) if key in owners else t.numel > 0:
            mine.append(key)
    return mine


def _dp_groups(target: Target) -> Groups:
    """Each tensor's data-parallel group (the ranks that share its box): id(tensor) -> (ranks, group)."""
    out = {}
    for t in target.tensors:
        group = t.dp_group if t.dp_group is not None else target.dp_group
        out[id(t)] = (tuple(_group_ranks(group)), group)
    return out


def _group_ranks(group: ProcessGroup | None) -> list[int]:
    if not dist.is_initialized():
        return [0]
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _shared_owners(source: Source, target: Target, state_names: list[str], groups: Groups) -> Owners:
    """Who reads each shared key (`ucp.deepspeed.loading.source`): balanced over its group, counting the slices each
    rank reads anyway.

    Groups are visited in one global order (by their ranks), so ranks that belong to several (expert
    and non-expert data-parallel groups) meet in their collectives without deadlock.
    """
    sizes: dict[tuple[int, ...], dict[Key, int]] = {}
    own: dict[tuple[int, ...], int] = {}
    handles: dict[tuple[int, ...], ProcessGroup | None] = {}
    for t in target.tensors:
        ranks, group = groups[id(t)]
        handles[ranks] = group
        sizes.setdefault(ranks, {})
        for s in _states_of(t, state_names):
            itemsize = source.dtype((t.name, s)).itemsize
            if source.shared((t.name, s), t):
                sizes[ranks][(t.name, s)] = box_numel(t) * itemsize
            else:
                own[ranks] = own.get(ranks, 0) + t.numel * itemsize
    owners: Owners = {}
    for ranks in sorted(sizes):
        loads: list[int] = [own.get(ranks, 0)] * len(ranks)  # all_gather_object fills in every rank's
        if len(ranks) > 1:
            dist.all_gather_object(loads, own.get(ranks, 0), group=handles[ranks])
        owners.update(assign_readers(sizes[ranks], list(ranks), dict(zip(ranks, loads))))
    return owners


def _broadcast(source: Source, key: Key, t: TargetTensor, value: torch.Tensor | None, owner: int,
               group: ProcessGroup | None, stats: LoadStats) -> torch.Tensor:
    buf = value.clone() if value is not None else torch.empty(box_numel(t), dtype=source.dtype(key))
    dist.broadcast(buf, src=owner, group=group)
    stats.bytes_broadcast += buf.numel() * buf.element_size()
    return buf


def _check_lr_scheduler(ckpt: Checkpoint, engine: DeepSpeedEngine) -> None:
    """The saved LR scheduler state loads into the engine's scheduler, tried on a shallow copy of it (a state
    dict sets the scheduler's own attributes), so a state that does not fit is refused before anything is
    installed instead of raising from the scheduler after."""
    scheduler, saved = engine.lr_scheduler, ckpt.lr_scheduler
    if scheduler is None or saved is None:
        return
    try:
        copy.copy(scheduler).load_state_dict(copy.deepcopy(saved))
    except Exception as exc:  # whatever the scheduler class raises on a state that is not its own
        raise CheckpointMismatchError(f"{ckpt.path}: its LR scheduler state does not load into the engine's "
                                      f"{type(scheduler).__name__} ({type(exc).__name__}: {exc}); use the scheduler "
                                      "it was saved with, or pass load_lr_scheduler_states=False") from None


def _saved_steps(ckpt: Checkpoint, target: Target) -> dict[int, float]:
    """The optimizer step of each engine param group, which all its parameters were saved at (checked before
    anything is installed, so a refused load leaves the engine as it was)."""
    groups: dict[int, set[float]] = {}
    for t in target.tensors:
        if t.kind != "param" or t.group is None:
            continue
        step = ckpt.step_of(t.name)
        if step is not None:
            groups.setdefault(t.group, set()).add(step)
    for group, steps in groups.items():
        if len(steps) != 1:
            raise CheckpointMismatchError(f"{ckpt.path}: parameters of optimizer group {group} were saved at "
                                          f"different steps {sorted(steps)}")
    return {group: steps.pop() for group, steps in groups.items()}


def _restore_loss_scale(ckpt: Checkpoint, engine: DeepSpeedEngine) -> None:
    """fp16 only: the dynamic loss scale and its counters continue where training stopped."""
    saved = ckpt.training.get("loss_scaler")
    scaler = loss_scale.live_scaler(engine.optimizer)
    if saved and scaler is not None:
        loss_scale.restore(saved, scaler)


def _restore_optimizer_globals(ckpt: Checkpoint, target: Target) -> None:
    """Hyper-parameters of each engine param group, from the checkpoint group its members came from."""
    saved = (ckpt.optimizer or {}).get("param_groups", [])
    group_of = {n: i for i, g in enumerate(saved) for n in g["params"]}
    for entry in target.optimizer_groups:
        sources = {group_of.get(n) for n in entry["names"]} - {None}
        if len(sources) == 1:
            for key, value in saved[sources.pop()]["hyperparams"].items():
                if key in entry["group"]:
                    entry["group"][key] = tuple(value) if isinstance(entry["group"][key], tuple) else value

