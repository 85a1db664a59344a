"""What each rank of a live DeepSpeed engine holds, and how to write a loaded state into it.

One adapter per optimizer family, chosen from the engine before anything is touched:

* ZeRO-0 — the module owns full fp32 weights (plain torch optimizer), or fp32 masters sit in
  `FP16_UnfusedOptimizer.fp32_groups` (fp16/bf16); every rank wants every tensor whole.
* ZeRO-1/2 (`DeepSpeedZeroOptimizer`), and `BF16_Optimizer` (bf16 pipelines without ZeRO, bf16 with
  fp32 gradient accumulation) — each trainable parameter's `_hp_mapping` says which run of its
  flattened elements lives in this rank's flat fp32 partition.
* ZeRO-3 (`DeepSpeedZeroOptimizer_Stage3`) — each parameter is partitioned on its own; rank r
  holds elements [r*pn, (r+1)*pn) (pn = ceil(numel / dp)), packed per sub-group in order.

`target_for` then puts any family's tensors in the groups that share them: a `PipelineModule` stage's
tensors in the stage's data-parallel group (the ranks of the same stage). A stage's module names its
layers as the whole model does (`<layer index>.<param>`, `tied_modules.<key>.<param>`), which are the
names the pipeline converter writes; a tied module on every stage that uses it loads the same atomic
tensor; no stage alone knows the whole model, so the strict check uses every stage's names. MoE
experts, under their global names (`ucp.deepspeed.engine.moe`), go in their expert-data-parallel
groups. AutoTP (`ucp.deepspeed.engine.autotp`) and an explicit layout (`ucp.deepspeed.engine.placement`) make each
tensor a box of the full tensor. A `TargetTensor` is never changed in place: each of these steps
replaces the target's tensors by new ones, through `TargetTensor.shared_by` and `TargetTensor.as_box`.

Frozen parameters and buffers are restored too (ZeRO-3 frozen parameters are partitioned like the
others). Optimizer states are created when the engine has not stepped yet.

Each tensor's `view(state)` is the live run of elements this rank holds: loading copies into it,
an asynchronous save (`ucp.deepspeed.saving.saver`) snapshots out of it, so both share this layout logic.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ucp.deepspeed.engine.moe import checkpoint_name, expert_groups, local_expert_tensors
from ucp.errors import UnsupportedLayoutError
from ucp.format.boxes import Box

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

View = Callable[[str], torch.Tensor]

# The states torch creates for each optimizer family, to check a checkpoint matches before loading.
OPTIMIZER_STATES = {
    "adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"), "fusedadam": ("exp_avg", "exp_avg_sq"),
    "deepspeedcpuadam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",),
}


@dataclass(frozen=True)
class TargetTensor:
    """One model tensor on this rank: what it wants of the full tensor and how to install it.

    Under tensor parallelism the rank's module holds `box` of the full tensor (e.g. a block of rows
    of a column-parallel weight); `start`/`numel` then count elements of that box, flattened, as
    ZeRO partitions the local shard. Without it they count elements of the full tensor.
    """

    name: str
    kind: str                   # "param", "frozen" or "buffer"
    shape: tuple[int, ...]      # the full (unsharded) shape the checkpoint holds
    start: int                  # first wanted element of the flattened box (the full tensor without one)
    numel: int                  # how many (0: this rank holds none of it)
    whole: bool                 # wants every element of the box (replicated on the DP group)
    view: View                  # view(state name): the live elements [start, start + numel), flat
    group: int | None = None    # optimizer param group index (trainable parameters)
    box: Box | None = None      # the part of the full tensor this rank's module holds (None: all of it, or `pieces`)
    dp_group: ProcessGroup | None = None  # the ranks sharing this tensor's box (None: the target's data-parallel group)
    pieces: tuple[Box, ...] | None = None  # the module holds these boxes, each flattened, one after another (a fused
    # QKV's block of each sub-parameter): its "box" is their concatenation, which `start`/`numel` count in

    def install(self, state: str, value: torch.Tensor) -> None:
        dest = self.view(state)
        if dest.data_ptr() == value.data_ptr() and dest.shape == value.shape and dest.dtype == value.dtype:
            return  # read straight into it (`Source.check`'s `into`)
        dest.copy_(value)

    def shared_by(self, dp_group: ProcessGroup | None) -> TargetTensor:
        """This tensor, its box shared by the ranks of `dp_group`."""
        return dataclasses.replace(self, dp_group=dp_group)

    def as_box(self, full_shape: tuple[int, ...], box: Box | None) -> TargetTensor:
        """This tensor, which holds the module's shard, as `box` of the full tensor of `full_shape` (None: all
        of it). A shard longer than its box (padded rows at the end) keeps the box's elements only: `start`
        and `numel` are cut at the box's size, and the view with them."""
        size = math.prod(hi - lo for lo, hi in box) if box is not None else math.prod(full_shape)
        end = min(self.start + self.numel, size)
        numel = max(0, end - self.start)
        view = self.view if numel == self.numel else _first(self.view, numel)
        return dataclasses.replace(self, shape=tuple(full_shape), box=box, start=min(self.start, size), numel=numel,
                                   view=view)

    def as_pieces(self, full_shape: tuple[int, ...], pieces: Sequence[tuple[int, Box]]) -> TargetTensor:
        """This tensor, which holds the module's shard, as `pieces` (first element in the flattened shard, box of
        the full tensor of `full_shape`), in shard order: one box as `as_box` (a shard padded at its end keeps
        the box's elements only), several (a fused tensor) as `pieces`, which must tile the whole shard."""
        full = tuple((0, n) for n in full_shape)
        if not pieces:  # every element is padding
            return self.as_box(full_shape, tuple((0, 0) for _ in full_shape))
        if len(pieces) == 1 and pieces[0][0] == 0:
            return self.as_box(full_shape, None if pieces[0][1] == full else pieces[0][1])
        starts = _starts(pieces)
        if starts[-1] != math.prod(self.shape) or any(first != at for (first, _), at in zip(pieces, starts)):
            raise UnsupportedLayoutError(f"{self.name}: its shard of shape {self.shape} is not its pieces "
                                         f"{[box for _, box in pieces]} one after another; ucp loads fused shards "
                                         "that are blocks of the full tensor end to end")
        return dataclasses.replace(self, shape=tuple(full_shape), box=None, pieces=tuple(box for _, box in pieces))


def _starts(pieces: Sequence[tuple[int, Box]]) -> list[int]:
    """Where each of `pieces` starts when they follow one another from 0, and where the last one ends."""
    out = [0]
    for _, box in pieces:
        out.append(out[-1] + math.prod(hi - lo for lo, hi in box))
    return out


def _first(view: View, numel: int) -> View:
    """`view` cut to its first `numel` elements."""
    def first(state: str) -> torch.Tensor:
        return view(state).narrow(0, 0, numel)
    return first


class Target:
    """The tensors of one engine on one rank, in model order, plus the hooks around loading them."""

    def __init__(self, engine: DeepSpeedEngine) -> None:
        self.engine = engine
        self.tensors: list[TargetTensor] = []
        self.dp_group: ProcessGroup | None = getattr(engine, "data_parallel_group", None)
        self.every_rank_names: set[str] | None = None  # set where ranks hold different tensors
        self._created: list[tuple] = []  # (optimizer, tensor, state name, held state before) made by prepare_states

    @property
    def optimizer_groups(self) -> list[dict]:
        """The torch param groups whose hyper-parameters a checkpoint restores, with member names."""
        raise NotImplementedError

    def model_names(self) -> set[str]:
        """Every tensor name of the whole model, for the strict check: this rank's, unless the model is
        spread over ranks that hold different tensors (pipeline stages, expert-parallel ranks)."""
        return self.every_rank_names if self.every_rank_names is not None else {t.name for t in self.tensors}

    def _state_holders(self) -> list[tuple[torch.optim.Optimizer, torch.Tensor]]:
        """(torch optimizer, tensor) for each tensor whose per-element optimizer state a load fills."""
        return []

    def prepare_states(self, state_names: list[str]) -> set[str]:
        """Create empty optimizer state where the engine has none (an engine that has not stepped). Returns the
        names it created for every tensor that holds state: new memory that nothing reads yet, which a load may
        fill before its checks are done, since `drop_new_states` takes it back."""
        holders = self._state_holders()
        fresh = set(state_names) if holders else set()
        for optimizer, key in holders:
            had = key in optimizer.state
            state = optimizer.state[key]
            for name in state_names:
                if name in state:
                    fresh.discard(name)
                else:
                    state[name] = torch.zeros_like(key, memory_format=torch.preserve_format)
                    self._created.append((optimizer, key, name, had))
        return fresh

    def drop_new_states(self) -> None:
        """Take back the optimizer state `prepare_states` created, leaving the optimizer as it was before."""
        for optimizer, key, name, had in reversed(self._created):
            optimizer.state[key].pop(name, None)
            if not had and not optimizer.state[key]:
                del optimizer.state[key]
        self._created = []

    def master_copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(fp32 master, the module's low-precision copy of it) for each master a load fills; empty where the
        module's own weights are the masters (ZeRO-0 in fp32)."""
        return []

    def prepare_masters(self) -> bool:
        """Whether a load may fill the masters before its checks are done: each master equals its low-precision
        copy, upcast, as DeepSpeed makes them before the first step (and keeps them through fp32 training), so
        `restore_masters` puts them back exactly from the copies, which a load writes only after its checks."""
        copies = self.master_copies()
        return bool(copies) and all(_equal_upcast(master, low) for master, low in copies)

    def restore_masters(self) -> None:
        """Put every master back to its low-precision copy (valid after `prepare_masters` said yes)."""
        for master, low in self.master_copies():
            master.copy_(low.view(master.shape))

    def set_step(self, group: int, step: float) -> None:
        raise NotImplementedError

    def optimizer_state(self, group: int) -> dict:
        """The torch optimizer state of group `group` (of its first parameter for per-parameter state)."""
        raise NotImplementedError

    def state_names(self) -> list[str]:
        """The per-element optimizer states held now (e.g. exp_avg, exp_avg_sq); none before the first step."""
        for group in range(len(self.optimizer_groups)):
            names = [k for k, v in self.optimizer_state(group).items()
                     if k != "step" and torch.is_tensor(v) and v.dim() > 0]
            if names:
                return names
        return []

    def saved_step(self, group: int) -> float | None:
        step = self.optimizer_state(group).get("step")
        return None if step is None else float(step)

    def finish(self) -> None:
        """Propagate fp32 masters to the low-precision module weights."""


def _equal_upcast(master: torch.Tensor, low: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """`master == low.to(master.dtype)`, a chunk at a time (no whole upcast copy of a partition)."""
    if master.numel() != low.numel():
        return False
    master, low = master.detach().reshape(-1), low.detach().reshape(-1)
    for start in range(0, master.numel(), chunk):
        n = min(chunk, master.numel() - start)
        if not torch.equal(master.narrow(0, start, n), low.narrow(0, start, n).to(master.dtype)):
            return False
    return True


def target_for(engine) -> Target:
    """The adapter for `engine`'s optimizer family, its tensors in their pipeline-stage or expert groups."""
    target = _family_target(engine)
    experts = local_expert_tensors(engine.module)
    pipeline = bool(getattr(engine, "pipeline_parallelism", False))  # a PipelineModule: this rank is one stage
    groups = {}
    if pipeline:
        stage = engine.grid.get_data_parallel_group()  # the ranks of the same stage
        groups = {t.name: stage for t in target.tensors}
    groups |= expert_groups(experts)
    target.tensors = [t.shared_by(groups[t.name]) if t.name in groups else t for t in target.tensors]
    if pipeline or experts:
        target.every_rank_names = _every_rank_names(target)
    return target


def _every_rank_names(target: Target) -> set[str]:
    """The union of every rank's tensor names (collective over the world)."""
    found: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(found, sorted(t.name for t in target.tensors))
    return {name for names in found for name in names}


def _family_target(engine) -> Target:
    """The adapter for `engine`'s optimizer family, or an error naming what ucp cannot serve."""
    optimizer = engine.optimizer
    name = type(optimizer).__name__
    if name in ("DeepSpeedZeroOptimizer", "BF16_Optimizer"):
        return Zero12Target(engine)
    if name == "DeepSpeedZeroOptimizer_Stage3":
        return Zero3Target(engine)
    if name == "FP16_UnfusedOptimizer":
        return Zero0MixedTarget(engine)
    if isinstance(optimizer, torch.optim.Optimizer) and engine.zero_optimization_stage() == 0:
        return Zero0Target(engine)
    raise UnsupportedLayoutError(f"ucp cannot load into an engine whose optimizer is {name} (ZeRO stage "
                                 f"{engine.zero_optimization_stage()}); supported: ZeRO 0-3 with a torch optimizer")


def _names(engine) -> dict:
    """Each parameter's checkpoint name: the engine's own, MoE experts under their global ids."""
    experts = local_expert_tensors(engine.module)
    return {p: checkpoint_name(experts, n) for p, n in engine.param_names.items()}


def module_aliases(module: torch.nn.Module) -> dict[str, str]:
    """alias -> source for each parameter `module` holds under several names (a tied weight), as DeepSpeed's
    engine lists them in a checkpoint's `shared_params`: the first name, in module order, is the source."""
    first: dict[int, str] = {}
    found = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            found[name] = first[id(p)]
        else:
            first[id(p)] = name
    return found


def _buffers_and_frozen(target: Target, skip: set[int], zero3: bool) -> None:
    module = target.engine.module
    experts = local_expert_tensors(module)
    for name, p in module.named_parameters():
        if p.requires_grad or id(p) in skip:
            continue
        name = checkpoint_name(experts, name)
        if zero3 and hasattr(p, "ds_tensor"):
            target.tensors.append(_zero3_frozen(target, name, p))
            continue
        target.tensors.append(TargetTensor(name, "frozen", tuple(p.shape), 0, p.numel(), True, _flat(p.data)))
    persistent = set(module.state_dict().keys())
    for name, b in module.named_buffers():
        if name in persistent:
            name = checkpoint_name(experts, name)
            target.tensors.append(TargetTensor(name, "buffer", tuple(b.shape), 0, b.numel(), True, _flat(b)))


def _flat(tensor: torch.Tensor) -> View:
    def view(state: str) -> torch.Tensor:
        return tensor.data.view(-1)
    return view


class Zero0Target(Target):
    def __init__(self, engine):
        super().__init__(engine)
        names = _names(engine)
        self.optimizer = engine.optimizer
        seen = set()
        for g, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                seen.add(id(p))
                self.tensors.append(TargetTensor(names[p], "param", tuple(p.shape), 0, p.numel(), True,
                                                 self._view(p), g))
        _buffers_and_frozen(self, seen, zero3=False)

    def _view(self, p: torch.nn.Parameter) -> View:
        def view(state: str) -> torch.Tensor:
            return (p.data if state == "fp32" else self.optimizer.state[p][state]).view(-1)
        return view

    @property
    def optimizer_groups(self) -> list[dict]:
        names = _names(self.engine)
        return [{"group": g, "names": [names[p] for p in g["params"]]} for g in self.optimizer.param_groups]

    def _state_holders(self) -> list[tuple[torch.optim.Optimizer, torch.Tensor]]:
        return [(self.optimizer, p) for group in self.optimizer.param_groups for p in group["params"]]

    def set_step(self, group: int, step: float) -> None:
        for p in self.optimizer.param_groups[group]["params"]:
            self.optimizer.state[p]["step"] = torch.tensor(float(step))

    def optimizer_state(self, group: int) -> dict:
        return self.optimizer.state.get(self.optimizer.param_groups[group]["params"][0], {})


class Zero0MixedTarget(Target):
    """ZeRO-0 with fp16/bf16: fp32 masters per parameter in `fp32_groups`, the module holds low precision."""

    def __init__(self, engine):
        super().__init__(engine)
        names = _names(engine)
        self.wrapper = engine.optimizer
        self.optimizer = self.wrapper.optimizer
        seen = set()
        for g, (low, masters) in enumerate(zip(self.wrapper.fp16_groups, self.wrapper.fp32_groups)):
            for lp, master in zip(low, masters):
                seen.add(id(lp))
                self.tensors.append(TargetTensor(names[lp], "param", tuple(lp.shape), 0, lp.numel(), True,
                                                 self._view(master), g))
        _buffers_and_frozen(self, seen, zero3=False)

    def _view(self, master: torch.Tensor) -> View:
        def view(state: str) -> torch.Tensor:
            return (master.data if state == "fp32" else self.optimizer.state[master][state]).view(-1)
        return view

    @property
    def optimizer_groups(self) -> list[dict]:
        names = _names(self.engine)
        return [{"group": pg, "names": [names[lp] for lp in low]}
                for pg, low in zip(self.optimizer.param_groups, self.wrapper.fp16_groups)]

    def _state_holders(self) -> list[tuple[torch.optim.Optimizer, torch.Tensor]]:
        return [(self.optimizer, master) for masters in self.wrapper.fp32_groups for master in masters]

    def set_step(self, group: int, step: float) -> None:
        for master in self.wrapper.fp32_groups[group]:
            self.optimizer.state[master]["step"] = torch.tensor(float(step))

    def optimizer_state(self, group: int) -> dict:
        return self.optimizer.state.get(self.wrapper.fp32_groups[group][0], {})

    def master_copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(master.data, lp.data) for low, masters in zip(self.wrapper.fp16_groups, self.wrapper.fp32_groups)
                for lp, master in zip(low, masters)]

    def finish(self) -> None:
        for low, masters in zip(self.wrapper.fp16_groups, self.wrapper.fp32_groups):
            for lp, master in zip(low, masters):
                lp.data.copy_(master.data)


class _FlatPartitionTarget(Target):
    """ZeRO-1/2/3: per optimizer group, one flat fp32 partition keys the torch optimizer's state.

    Subclasses set `self.zero`, `self.flats` (the flat fp32 partitions) and `self.low_groups` (the
    module parameters of each group, in the same order).
    """

    zero: Any = None  # the engine's ZeRO optimizer (DeepSpeed's, untyped)
    flats: list = []
    low_groups: list = []

    def _view(self, flat: torch.Tensor, start: int, numel: int) -> View:
        def view(state: str) -> torch.Tensor:
            return (flat if state == "fp32" else self.zero.optimizer.state[flat][state]).narrow(0, start, numel)
        return view

    @property
    def optimizer_groups(self) -> list[dict]:
        names = _names(self.engine)
        return [{"group": pg, "names": [names[p] for p in low]}
                for pg, low in zip(self.zero.optimizer.param_groups, self.low_groups)]

    def _state_holders(self) -> list[tuple[torch.optim.Optimizer, torch.Tensor]]:
        return [(self.zero.optimizer, flat) for flat in self.flats]

    def set_step(self, group: int, step: float) -> None:
        self.zero.optimizer.state[self.flats[group]]["step"] = torch.tensor(float(step))

    def optimizer_state(self, group: int) -> dict:
        return self.zero.optimizer.state.get(self.flats[group], {})


class Zero12Target(_FlatPartitionTarget):
    """ZeRO-1/2 (`DeepSpeedZeroOptimizer`), and `BF16_Optimizer` (bf16 with fp32 gradient accumulation,
    or a bf16 pipeline without ZeRO), which keeps the same flat fp32 partitions linked to each parameter."""

    def __init__(self, engine):
        super().__init__(engine)
        names = _names(engine)
        self.zero = engine.optimizer
        if getattr(self.zero, "cpu_offload", False):
            raise UnsupportedLayoutError("ucp cannot load into a ZeRO-1/2 engine with optimizer offload yet")
        if type(self.zero).__name__ == "BF16_Optimizer":
            self.flats, self.low_groups = self.zero.fp32_groups_flat_partition, self.zero.bf16_groups
        else:
            self.flats, self.low_groups = self.zero.single_partition_of_fp32_groups, self.zero.bit16_groups
        seen = set()
        for g, group in enumerate(self.low_groups):
            flat = self.flats[g]
            for lp in group:
                seen.add(id(lp))
                mapping = getattr(lp, "_hp_mapping", None)
                if mapping is None:
                    self.tensors.append(TargetTensor(names[lp], "param", tuple(lp.shape), 0, 0, False,
                                                     _nothing, g))
                    continue
                lp_address, hp_address = mapping.lp_fragment_address, mapping.hp_fragment_address
                self.tensors.append(TargetTensor(names[lp], "param", tuple(lp.shape), lp_address.start,
                                                 lp_address.numel, False,
                                                 self._view(flat, hp_address.start, hp_address.numel), g))
        _buffers_and_frozen(self, seen, zero3=False)

    def master_copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        lows = (self.zero.bf16_partitioned_groups if type(self.zero).__name__ == "BF16_Optimizer"
                else self.zero.parallel_partitioned_bit16_groups)
        return [(flat, lows[g][dist.get_rank(group=self.zero.real_dp_process_group[g])])
                for g, flat in enumerate(self.flats)]

    def finish(self) -> None:
        self.zero.update_lp_params()


def _nothing(state: str) -> torch.Tensor:
    """This rank holds no element of the parameter."""
    return torch.empty(0)


def _zero3_frozen(target: Target, name: str, p) -> TargetTensor:
    rank = dist.get_rank(group=target.engine.optimizer.dp_process_group)
    pn = p.ds_tensor.numel()
    real = max(0, min(pn, p.ds_numel - rank * pn))

    def view(state: str) -> torch.Tensor:
        return p.ds_tensor.data.narrow(0, 0, real)
    return TargetTensor(name, "frozen", tuple(p.ds_shape), rank * pn, real, False, view)


class Zero3Target(_FlatPartitionTarget):
    def __init__(self, engine):
        super().__init__(engine)
        names = _names(engine)
        self.zero = engine.optimizer
        if getattr(self.zero, "offload_optimizer", False) or getattr(self.zero, "offload_param", False):
            raise UnsupportedLayoutError("ucp cannot load into a ZeRO-3 engine with offload yet")
        self.flats, self.low_groups = self.zero.fp32_partitioned_groups_flat, self.zero.fp16_groups
        rank = dist.get_rank(group=self.zero.dp_process_group)
        seen = set()
        for sub, group in enumerate(self.low_groups):
            flat = self.flats[sub]
            offset = 0
            for p in group:
                seen.add(id(p))
                pn = p.partition_numel()
                real = max(0, min(pn, p.ds_numel - rank * pn))
                self.tensors.append(TargetTensor(names[p], "param", tuple(p.ds_shape), rank * pn, real, False,
                                                 self._view(flat, offset, real), sub))
                offset += pn
        _buffers_and_frozen(self, seen, zero3=True)

    def master_copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.flats, self.zero.fp16_partitioned_groups_flat))

    def finish(self) -> None:
        # As DeepSpeed's own universal loader does: masters → low-precision partitions → params.
        for sub, fp32_flat in enumerate(self.zero.fp32_partitioned_groups_flat):
            if fp32_flat.numel() > 0:
                self.zero.fp16_partitioned_groups_flat[sub].data.copy_(fp32_flat.data)
        for sub, low_flat in enumerate(self.zero.fp16_partitioned_groups_flat):
            updated = self.zero.unflatten(low_flat, self.zero.fp16_partitioned_groups[sub])
            for partitioned, q in zip(self.zero.fp16_partitioned_groups[sub], updated):
                partitioned.data = q.data

