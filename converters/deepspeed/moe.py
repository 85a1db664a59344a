"""Plan the conversion of a checkpoint with native DeepSpeed MoE layers (`deepspeed.moe.layer.MoE`), ZeRO-0/1/2.

Layout written by DeepSpeed 0.19 (no tensor or pipeline parallelism):

* `layer_{L}_expert_{E}_mp_rank_00_model_states.pt`: the weights of expert E of MoE layer L, under
  their global names (`<layer>.deepspeed_moe.experts.deepspeed_experts.<E>.<param>`).
* `mp_rank_00_model_states.pt`: the non-expert module state, `num_experts` per MoE layer, and
  `param_shapes` as rank 0's optimizer lists them.
* `[bf16_]zero_pp_rank_{D}_mp_rank_00_optim_states.pt`: rank D's partitions. Expert parameters are
  in their own param groups (hyper-parameter `moe`), partitioned over the expert-data-parallel
  group, and named with each rank's **local** expert ids 0 .. num_local-1.
* ZeRO-0 writes `expp_rank_{F}_mp_rank_00_optim_states.pt` instead, one per rank of the largest EP
  group: that rank's whole optimizer state, by slot position (see `_plan_zero0`).

Expert-parallel rank of data-parallel rank D (DeepSpeed's `_create_expert_and_data_parallel`):
`D % ep_size`, or `D // (dp / ep_size)` with `use_data_before_expert_parallelism`. Its local
expert i is global expert `ep_rank * num_local + i`. ds_to_universal 0.19 joins the local names
of different EP ranks as if they were one parameter; here every fragment gets its global name
first, so each expert is Unique to its EP rank (Shard-V over its expert-data-parallel ranks).
"""
from __future__ import annotations

import re
from pathlib import Path

from ucp.converters.deepspeed.slices import (
    combined_source,
    dtype_name,
    expect,
    held_params,
    load_dict,
    param_groups,
    read_slice,
    whole,
)
from ucp.converters.deepspeed.zero0 import zero0_slice
from ucp.converters.plan_common import finish_plan, frozen_and_buffers
from ucp.converters.tag_folder import TagDir, model_files, optim_files
from ucp.converters.torch_zip import LazyTensor
from ucp.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedLayoutError
from ucp.patterns import recognize
from ucp.plan.plan import FROZEN, TRAINABLE, WEIGHT_STATE, ConversionPlan, ParamPlan, StateSource

EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
EXPP_FILE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_EP_GROUP = re.compile(r"^ep_size_(\d+)$")
_EXPERT_NAME = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..+)$")


def is_moe(names: list[str]) -> bool:
    return any(EXPERT_FILE.match(n) for n in names)


def plan_moe(where: TagDir, names: list[str]) -> ConversionPlan:
    """The plan of the MoE checkpoint in tag folder `where.path`, whose files are `names`."""
    folder = where.path
    models = model_files(folder, names)
    if set(models) != {0} or any(m.group(3) != "00" for n in names if (m := EXPERT_FILE.match(n))):
        raise UnsupportedLayoutError(f"{folder}: MoE with tensor or pipeline parallelism (several mp_rank files) "
                                     "is not supported yet")
    model = load_dict(models[0])
    experts = _expert_tensors(folder, names)
    prefixes = _layer_prefixes(experts)
    num_experts = [int(n) for n in (model.get("num_experts") or [])]
    if len(num_experts) != len(prefixes):
        raise CorruptCheckpointError(f"{models[0]}: records num_experts for {len(num_experts)} MoE layers, the "
                                     f"expert files hold {len(prefixes)}; files from different runs are mixed")
    optims = optim_files(folder, names)
    if not optims:
        return _plan_zero0(where, names, models[0], model, experts, dict(zip(prefixes, num_experts)))
    dp = int(model.get("dp_world_size") or 1)
    local = _local_counts(folder, optims, prefixes, dp)
    ep = {prefix: _ep_size(num_experts[layer], local[prefix], prefix) for layer, prefix in enumerate(prefixes)}
    data_first = bool((model.get("ds_config") or {}).get("use_data_before_expert_parallelism"))

    def rename(rank: int, group: int, name: str) -> str:
        m = _EXPERT_NAME.match(name)
        if not m or m.group(1) not in ep:
            return name
        size = ep[m.group(1)]
        ep_rank = rank // (dp // size) if data_first else rank % size
        return f"{m.group(1)}{ep_rank * local[m.group(1)] + int(m.group(2))}{m.group(3)}"

    part = read_slice(folder, 0, models[0], model, optims, rename)
    module = model.get("module") or {}
    trainable = [n for n in part.shapes if not _EXPERT_NAME.match(n)]
    trainable += [n for n in experts if (n, WEIGHT_STATE) in part.fragments]
    params = []
    for name in trainable:
        t = experts.get(name, module.get(name))
        shape = t.shape if isinstance(t, LazyTensor) else part.shapes[name]
        states = {s: combined_source(name, shape, [(0, shape, part.fragments[(name, s)])])
                  for s in part.states() if (name, s) in part.fragments}
        if WEIGHT_STATE not in states:
            raise CorruptCheckpointError(f"{part.optim_paths[0]}: parameter '{name}' has no optimizer fragment (it "
                                         "never received a gradient); convert a checkpoint saved after a full step")
        group = part.group_of[name]
        params.append(ParamPlan(name, shape, TRAINABLE, states, group, part.steps.get(group),
                                dtype_name(t) if isinstance(t, LazyTensor) else "float32"))
    missing = [n for n in part.fragments if n[0] not in experts and _EXPERT_NAME.match(n[0])]
    if missing:
        raise CorruptCheckpointError(f"{part.optim_paths[0]}: the optimizer holds expert '{missing[0][0]}' (by its "
                                     "global id), for which no expert file exists; copy every layer_*_expert_* file")
    for name, t in experts.items():
        if name not in trainable:
            params.append(_frozen_expert(name, t))
    params += frozen_and_buffers(model, models[0], set(part.shapes) | set(trainable))
    files = [*part.optim_paths, models[0]] + [folder / n for n in names if EXPERT_FILE.match(n)]
    sizes = sorted(set(ep.values()))
    return finish_plan(where, model, params, part.hyper, part.moment_names, part.stage, part.dp, files,
                       part.loss_scaler, {"ep": sizes[0] if len(sizes) == 1 else sizes})


def _plan_zero0(where: TagDir, names: list[str], model_path: Path, model: dict, experts: dict[str, LazyTensor],
                num_experts: dict[str, int]) -> ConversionPlan:
    """ZeRO-0: `expp_rank_{F}_mp_rank_00_optim_states.pt` holds the whole optimizer state (see `deepspeed.zero0`)
    of the rank with expert-parallel rank F in the process's largest EP group and expert-data-parallel rank 0:
    the dense parameters and its own experts. The experts' param group names their EP size (`ep_size_N`,
    DeepSpeed's MoE group name), so file F holds the experts of EP rank F % N; with a larger EP group in the
    same process there are more files than EP ranks, and the extra ones are copies. Slots are named from
    the dense module state and the expert files of those global ids; a parameter in several files is a
    Replicate of their copies."""
    folder = where.path
    expp = {int(m.group(1)): folder / n for n in names if (m := EXPP_FILE.match(n)) and m.group(2) == "00"}
    if not expp:
        raise CheckpointNotFoundError(f"{folder}: an MoE checkpoint with neither ZeRO optimizer files "
                                      "(*zero_pp_rank_*_optim_states.pt) nor ZeRO-0 ones (expp_rank_*_optim_states.pt)"
                                      "; copy the optimizer files of the checkpoint too")
    missing = [f for f in range(max(expp) + 1) if f not in expp]
    if missing:
        raise CheckpointNotFoundError(f"{folder / f'expp_rank_{missing[0]}_mp_rank_00_optim_states.pt'}: missing (the "
                                      f"checkpoint has {max(expp) + 1} of them); copy every rank's file")
    optimizers = [load_dict(expp[f]).get("optimizer") for f in range(len(expp))]
    ep = _expert_group_size(optimizers[0], expp[0])
    if ep > len(expp) or any(count % ep for count in num_experts.values()):
        raise CorruptCheckpointError(f"{expp[0]}: its experts' group says ep_size {ep}, but there are {len(expp)} "
                                     f"expp_rank files and {sorted(set(num_experts.values()))} experts per MoE layer; "
                                     "files from different runs are mixed")
    if bool((model.get("ds_config") or {}).get("use_data_before_expert_parallelism")) and len(expp) != ep:
        raise UnsupportedLayoutError(f"{folder}: ZeRO-0 MoE with use_data_before_expert_parallelism and several EP "
                                     "sizes in one process is not supported yet")
    local = {prefix: count // ep for prefix, count in num_experts.items()}
    dense = dict(model.get("module") or {})
    ranks = []
    for f, optimizer in enumerate(optimizers):
        own = {n: t for n, t in experts.items() if _global_id(n) // local[_expert_name(n).group(1)] == f % ep}
        ranks.append(zero0_slice(f, expp[f], {**model, "optimizer": optimizer, "module": {**dense, **own}}))
    params = held_params(ranks, {**dense, **experts}, "expp_rank file")
    trainable = {p.name for p in params}
    for name, t in experts.items():
        if name not in trainable:
            params.append(_frozen_expert(name, t))
    params += frozen_and_buffers(model, model_path, trainable)
    files = [*expp.values(), model_path] + [folder / n for n in names if EXPERT_FILE.match(n)]
    dp = int(model.get("dp_world_size") or 1)
    return finish_plan(where, model, params, ranks[0].hyper, ranks[0].moment_names, 0, dp, files,
                       ranks[0].loss_scaler, {"ep": ep})


def _expert_group_size(optimizer, path: Path) -> int:
    """The EP size of the experts in a ZeRO-0 optimizer state: its `moe` param groups are named `ep_size_N`."""
    inner = expect(optimizer.get("optimizer_state_dict", optimizer), dict, path, "its optimizer_state_dict"
                   ) if isinstance(optimizer, dict) else {}
    sizes = {m.group(1) for g in param_groups(inner.get("param_groups") or [], path) if g.get("moe")
             and (m := _EP_GROUP.match(str(g.get("name"))))}
    if len(sizes) != 1:
        raise UnsupportedLayoutError(f"{path}: expected one expert param group named ep_size_N, found "
                                     f"{sorted(sizes) or 'none'}; MoE layers of different ep_size (or expert groups "
                                     "not made by split_params_into_different_moe_groups_for_optimizer) are not "
                                     "supported under ZeRO-0 yet")
    return int(sizes.pop())


def _expert_name(name: str) -> re.Match[str]:
    """The parts of an expert parameter's name (every name in `experts` has them)."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        raise ValueError(f"{name}: not an expert parameter's name")
    return match


def _global_id(expert_param: str) -> int:
    return int(_expert_name(expert_param).group(2))


def _frozen_expert(name: str, t: LazyTensor) -> ParamPlan:
    fragment = whole(t)
    return ParamPlan(name, t.shape, FROZEN, {WEIGHT_STATE: StateSource(recognize(name, t.shape, [fragment.info]),
                                                                       (fragment,))}, model_dtype=dtype_name(t))


def _expert_tensors(folder: Path, names: list[str]) -> dict[str, LazyTensor]:
    """Every expert tensor by its global name, in layer and expert order."""
    found = sorted((int(m.group(1)), int(m.group(2)), n) for n in names if (m := EXPERT_FILE.match(n)))
    out = {}
    for layer, expert, file_name in found:
        for key, t in load_dict(folder / file_name).items():
            m = _EXPERT_NAME.match(str(key))
            if not isinstance(t, LazyTensor):
                continue
            if not m or int(m.group(2)) != expert:
                raise CorruptCheckpointError(f"{folder / file_name}: holds '{key}', which is not a parameter of "
                                             f"expert {expert}; the file was renamed or damaged")
            out[str(key)] = t
    return out


def _layer_prefixes(experts: dict[str, LazyTensor]) -> list[str]:
    """The name prefix (`...deepspeed_experts.`) of each MoE layer, in layer order."""
    prefixes: list[str] = []
    for name in experts:
        prefix = _expert_name(name).group(1)
        if prefix not in prefixes:
            prefixes.append(prefix)
    return prefixes


def _local_counts(folder: Path, optims: dict, prefixes: list[str], dp: int) -> dict[str, int]:
    """How many experts of each MoE layer one EP rank holds: the local ids its optimizer files use."""
    seen: dict[str, set[int]] = {p: set() for p in prefixes}
    for rank in range(dp):
        path = optims.get((rank, 0))
        if path is None:
            raise CheckpointNotFoundError(f"{folder}: the optimizer file of data-parallel rank {rank} is missing; "
                                          "copy every rank's *_optim_states.pt")
        osd = expect(load_dict(path).get("optimizer_state_dict"), dict, path, "its optimizer_state_dict")
        for g, mapping in enumerate(expect(osd.get("param_slice_mappings") or [], (list, tuple), path,
                                           "its param_slice_mappings")):
            for name in expect(mapping, dict, path, f"its param_slice_mappings of param group {g}"):
                m = _EXPERT_NAME.match(name)
                if m and m.group(1) in seen:
                    seen[m.group(1)].add(int(m.group(2)))
    return {p: len(ids) for p, ids in seen.items()}


def _ep_size(num_experts: int, num_local: int, prefix: str) -> int:
    if num_local == 0 or num_experts % num_local:
        raise CorruptCheckpointError(f"{prefix}*: {num_experts} experts but the optimizer files hold {num_local} "
                                     "local experts per rank; files from different runs are mixed")
    return num_experts // num_local
