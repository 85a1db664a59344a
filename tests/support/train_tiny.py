#!/usr/bin/env python
"""Train a tiny deterministic model with DeepSpeed on CPU and (optionally) save a checkpoint.

Launched with ``torchrun --nproc_per_node N tests/support/train_tiny.py ...`` (see
``tests/support/launch.py``). Every rank runs this file; rank 0 writes the JSON outputs.

The model is deliberately awkward for checkpoint conversion:

* odd-sized tensors (vocab 13 x dim 7 embedding, 7->9->5->13 linears), so every ZeRO
  partition of a flat group carries padding at DP degree 2 and 3;
* two optimizer parameter groups with different ``weight_decay``
  (group 0: matrices + ``gain``, 269 elements; group 1: biases, 27 elements);
* a frozen parameter ``proj.weight`` (``requires_grad=False``, not given to the optimizer);
* a registered (persistent) buffer ``pos_scale``.

With ``--tie tied`` the head reads DIM-wide features (``l2`` 9->7, ``proj`` 7x7, ``gain`` 7) and
``head.weight`` is the very Parameter ``emb.weight`` (a tied embedding, as GPT-2 or Llama with
``tie_word_embeddings``): the optimizer holds it once, DeepSpeed lists ``head.weight`` in
``shared_params``. ``--tie untied`` is the same model with ``head.weight`` a parameter of its own.

Data: global step ``s`` (0-based) always trains on the same global batch of 6 sequences drawn
from ``torch.Generator().manual_seed(s)``; data-parallel rank ``r`` of ``dp`` takes the
contiguous slice ``[r*6/dp, (r+1)*6/dp)``. Runs at DP 1, 2 and 3 therefore see identical
global batches, and gradients (DeepSpeed averages over DP) are those of the global mean loss.

The logged loss of a step is the all-reduce mean of the per-rank mean losses, computed in
fp32 from the forward pass of that step (i.e. before the optimizer update of that step).
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F

GLOBAL_BATCH = 6
SEQ_LEN = 4
VOCAB = 13
DIM = 7
HIDDEN = 9
NARROW = 5
INIT_SEED = 1234
CLIENT_STATE = {"client_marker": 7}

# Frozen parameter and buffer names (handy for tests; keep in sync with TinyModel).
FROZEN_PARAM_NAMES = ("proj.weight", )
BUFFER_NAMES = ("pos_scale", )
GROUP_WEIGHT_DECAY = (0.1, 0.0)

# What --uc-info attaches to the module, Megatron-DeepSpeed style (see DeepSpeedEngine._save_checkpoint:
# the engine stores getattr(module, "universal_checkpoint_info") under the same key in the model-states
# file(s); ds_to_universal.py then reads it instead of needing --inject_missing_state).
UC_INFO = {
    "universal_checkpoint_version": 0.4,
    # Nothing is TP-split here (TP=1); these patterns exercise the metadata path only.
    "vocabulary_parameter_patterns": [r"emb\.weight$"],
    "original_vocab_size": VOCAB,
    "tp_replicated_parameter_patterns": [r"l1\.bias$", r"l2\.bias$", r"head\.bias$"],
}


class TinyModel(torch.nn.Module):

    def __init__(self, tie: str = ""):
        super().__init__()
        g = torch.Generator().manual_seed(INIT_SEED)
        narrow = DIM if tie else NARROW  # the head's input width: a tied head is the embedding, VOCAB x DIM
        self.tied = tie == "tied"

        def rnd(*shape, scale=0.5):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * scale)

        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.l1 = torch.nn.Linear(DIM, HIDDEN)
        self.l2 = torch.nn.Linear(HIDDEN, narrow)
        self.proj = torch.nn.Linear(narrow, narrow, bias=False)
        self.head = torch.nn.Linear(narrow, VOCAB)
        # Replace default (global-RNG) init by a fixed-seed init, independent of torch.manual_seed.
        self.emb.weight = rnd(VOCAB, DIM, scale=1.0)
        self.l1.weight = rnd(HIDDEN, DIM)
        self.l1.bias = rnd(HIDDEN, scale=0.1)
        self.l2.weight = rnd(narrow, HIDDEN)
        self.l2.bias = rnd(narrow, scale=0.1)
        self.proj.weight = rnd(narrow, narrow)
        self.proj.weight.requires_grad_(False)
        self.head.weight = self.emb.weight if self.tied else rnd(VOCAB, narrow)
        self.head.bias = rnd(VOCAB, scale=0.1)
        self.gain = torch.nn.Parameter(torch.ones(narrow) + 0.1 * torch.randn(narrow, generator=g))
        self.register_buffer("pos_scale", torch.linspace(1.0, 0.5, SEQ_LEN))

    def param_groups(self):
        head = [] if self.tied else [self.head.weight]  # a tied head is emb.weight, already in the group
        return [
            {
                "params": [self.emb.weight, self.l1.weight, self.l2.weight, *head, self.gain],
                "weight_decay": GROUP_WEIGHT_DECAY[0],
            },
            {
                "params": [self.l1.bias, self.l2.bias, self.head.bias],
                "weight_decay": GROUP_WEIGHT_DECAY[1],
            },
        ]

    def forward(self, tokens, targets):
        h = self.emb(tokens) * self.pos_scale.to(self.emb.weight.dtype)[None, :, None]
        h = torch.relu(self.l1(h))
        h = self.l2(h)
        h = self.proj(h) * self.gain
        logits = self.head(torch.tanh(h))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def global_batch(step):
    """The global batch of global step ``step`` (0-based): tokens and targets, both [6, 4] int64."""
    g = torch.Generator().manual_seed(int(step))
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=g)
    targets = (tokens * 3 + tokens.roll(1, dims=1) + 1) % VOCAB
    return tokens, targets


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], required=True)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--optimizer", choices=["Adam", "AdamW"], default="AdamW")
    p.add_argument("--tie", choices=["", "tied", "untied"], default="",
                   help="tied: head.weight is emb.weight (wider head input); untied: the same shapes, untied")
    p.add_argument("--steps", type=int, default=3, help="training steps to run (after a resume, if any)")
    p.add_argument("--save-dir", type=str, default=None)
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--losses-out", type=str, default=None)
    p.add_argument("--load-dir", type=str, default=None)
    p.add_argument("--load-tag", type=str, default=None)
    p.add_argument("--load-universal", action="store_true",
                   help="set checkpoint.load_universal=true (load a ds_to_universal output)")
    p.add_argument("--start-step", type=int, default=None,
                   help="global step index of the first batch (default: engine.global_steps after load, else 0)")
    p.add_argument("--uc-info", action="store_true",
                   help="attach universal_checkpoint_info to the module (Megatron-DeepSpeed style)")
    p.add_argument("--dump-state", type=str, default=None,
                   help="rank 0 writes {param name: {fp32, exp_avg, exp_avg_sq}} (full shapes, gathered) plus "
                   "metadata to this torch file, after training (after loading when --steps 0)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--ucp-load", type=str, default=None,
                   help="resume from this ucp atomic checkpoint through ucp.deepspeed.initialize")
    p.add_argument("--ucp-no-bypass", action="store_true", help="turn redundancy-bypassing reads off")
    p.add_argument("--ucp-no-check-first", action="store_true",
                   help="with --ucp-expect-error: load with check_first=False (install as it reads)")
    p.add_argument("--ucp-check-keep-bytes", type=int, default=None,
                   help="with --ucp-expect-error: ucp.deepspeed.load's check_keep_bytes (default: ucp's own)")
    p.add_argument("--ucp-stats-out", type=str, default=None,
                   help="rank 0 writes every rank's ucp load statistics (JSON list, by rank)")
    p.add_argument("--ucp-save-dir", type=str, default=None,
                   help="save asynchronously with ucp into this folder (config \"ucp\": {\"save\": ...}); the run "
                   "waits for the last save before it ends")
    p.add_argument("--ucp-save-every", type=int, default=1, help="with --ucp-save-dir: every K optimizer steps")
    p.add_argument("--ucp-save-keep", type=int, default=None,
                   help="with --ucp-save-dir: keep this many committed checkpoints (\"keep\")")
    p.add_argument("--ucp-save-faults", metavar="DIR", default=None,
                   help="with --ucp-save-dir: files in DIR stall or fail the saves' writers (support/save_faults.py)")
    p.add_argument("--ucp-expect-error", type=str, default=None,
                   help="load each of the comma-separated --ucp-load paths after deepspeed.initialize expecting "
                   "a ucp error; write [{path, error, untouched}] to this JSON file, where untouched says "
                   "the engine state is unchanged")
    return p.parse_args(argv)


def ds_config(args, world_size):
    assert GLOBAL_BATCH % world_size == 0, f"world size {world_size} must divide {GLOBAL_BATCH}"
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": args.optimizer,
            "params": {
                "lr": args.lr,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": args.lr / 10,
                "warmup_max_lr": args.lr,
                "warmup_num_steps": 4,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.optimizer == "Adam":
        # DeepSpeed maps type "Adam" to AdamW unless adam_w_mode is false; make "Adam" mean L2-Adam.
        cfg["optimizer"]["params"]["adam_w_mode"] = False
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif args.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 100}
    if args.load_universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _flat_master_views(opt):
    """id(lp param) -> {fp32, exp_avg, exp_avg_sq} of the fp32 master copy kept by stage-0 fp16/bf16 wrappers.

    FP16_Optimizer (fused inner optimizer): one flat fp32 tensor per group (``fp32_groups_flat``).
    FP16_UnfusedOptimizer (e.g. torch Adam/AdamW): one fp32 tensor per param (``fp32_groups``).
    """
    views = {}
    if not hasattr(opt, "fp16_groups"):
        return views
    inner_state = getattr(getattr(opt, "optimizer", None), "state", {})
    if hasattr(opt, "fp32_groups_flat"):
        for flat, params in zip(opt.fp32_groups_flat, opt.fp16_groups):
            st = inner_state.get(flat, {})
            offset = 0
            for p in params:
                n = p.numel()
                views[id(p)] = {"fp32": flat.detach().narrow(0, offset, n)}
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in st:
                        views[id(p)][key] = st[key].narrow(0, offset, n)
                offset += n
            if offset != flat.numel():
                raise RuntimeError(f"flat fp32 group holds {flat.numel()} elements, params {offset}")
    elif hasattr(opt, "fp32_groups"):
        for masters, params in zip(opt.fp32_groups, opt.fp16_groups):
            for master, p in zip(masters, params):
                st = inner_state.get(master, {})
                views[id(p)] = {"fp32": master.detach()}
                views[id(p)].update({k: st[k] for k in ("exp_avg", "exp_avg_sq") if k in st})
    return views


def dump_state(engine, model, path, rank):
    """Gather full fp32 params and Adam moments for every trainable parameter (collective call)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state") and hasattr(opt, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19.x (ZeRO-1/2 and the bf16 optimizer) links each parameter's optimizer-state
        # fragments once, right after the optimizer step of param group 0, when group 1 has no state yet;
        # safe_get_full_optimizer_state then fails for params of groups >= 1. Re-link now that all exist.
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    out = {"params": {}, "global_steps": engine.global_steps}
    flat_views = _flat_master_views(opt)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        shape = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
        entry = {}
        fp32 = safe_get_full_fp32_param(p)
        for key in ("exp_avg", "exp_avg_sq"):
            t = safe_get_full_optimizer_state(p, key)
            if t is not None:
                entry[key] = t
        if fp32 is None and id(p) in flat_views:  # stage 0 + fp16/bf16: FP16_Optimizer's flat fp32 master
            entry = dict(flat_views[id(p)])
        elif fp32 is None:  # stage 0 + fp32: the param is the master copy, state keyed by the param
            entry = {"fp32": p.detach()}
            st = opt.state.get(p, {}) if hasattr(opt, "state") else {}
            entry.update({k: st[k] for k in ("exp_avg", "exp_avg_sq") if k in st})
        else:
            entry["fp32"] = fp32
        out["params"][name] = {k: v.detach().float().cpu().reshape(shape).clone() for k, v in entry.items()}
    out["lrs"] = [g["lr"] for g in engine.optimizer.param_groups]
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    if rank == 0:
        torch.save(out, path)


def engine_digest(engine) -> str:
    """A hash of every module tensor and optimizer tensor this rank holds."""
    import hashlib

    h = hashlib.sha256()
    tensors = list(engine.module.state_dict().values())
    opt = engine.optimizer
    for holder in (opt, getattr(opt, "optimizer", None)):
        for state in getattr(holder, "state", {}).values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
        tensors += list(getattr(opt, name, []))
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def expect_ucp_error(engine, args, rank) -> int:
    import torch.distributed as dist

    import ucp.deepspeed
    from ucp.errors import UcpError

    results = []
    for path in args.ucp_load.split(","):
        before = engine_digest(engine)
        try:
            keep = {} if args.ucp_check_keep_bytes is None else {"check_keep_bytes": args.ucp_check_keep_bytes}
            ucp.deepspeed.load(engine, path, check_first=not args.ucp_no_check_first, **keep)
            error = None
        except UcpError as exc:
            error = str(exc)
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        untouched = [None] * dist.get_world_size()
        dist.all_gather_object(untouched, engine_digest(engine) == before)
        results.append({"path": path, "error": error, "untouched": untouched[0], "errors": errors,
                        "untouched_on": untouched})
    if rank == 0:
        with open(args.ucp_expect_error, "w") as f:
            json.dump(results, f)
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump([], f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    torch.use_deterministic_algorithms(True)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    world_size = dist.get_world_size()

    model = TinyModel(args.tie)
    if args.uc_info:
        model.universal_checkpoint_info = dict(UC_INFO)
    config = ds_config(args, world_size)
    if args.ucp_expect_error:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.param_groups(), config=config)
        return expect_ucp_error(engine, args, rank)
    if args.ucp_load or args.ucp_save_dir:
        import ucp.deepspeed

        config["ucp"] = {}
        if args.ucp_load:
            config["ucp"].update(load=args.ucp_load, bypass=not args.ucp_no_bypass)
        if args.ucp_save_dir:
            config["ucp"]["save"] = {"dir": args.ucp_save_dir, "every": args.ucp_save_every}
            if args.ucp_save_keep is not None:
                config["ucp"]["save"]["keep"] = args.ucp_save_keep
        engine, _, _, _ = ucp.deepspeed.initialize(model=model, model_parameters=model.param_groups(),
                                                   config=config)
        engine.ucp_client_state = dict(CLIENT_STATE)  # what the periodic saves record as client state
        if args.ucp_save_faults:
            from save_faults import install

            install(args.ucp_save_faults)
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.param_groups(), config=config)
    if args.ucp_load and (args.ucp_load != "auto" or engine.global_steps > 0):  # "auto" may start fresh
        if engine.ucp_load_stats.client_state.get("client_marker") != CLIENT_STATE["client_marker"]:
            raise RuntimeError("client_state not restored by ucp")
        if args.ucp_stats_out:
            stats = [None] * world_size
            dist.all_gather_object(stats, {k: v for k, v in vars(engine.ucp_load_stats).items()
                                           if k != "client_state"})
            if rank == 0:
                with open(args.ucp_stats_out, "w") as f:
                    json.dump(stats, f)

    if args.load_dir is not None:
        load_path, client_state = engine.load_checkpoint(args.load_dir, tag=args.load_tag)
        if load_path is None:
            raise RuntimeError(f"load_checkpoint({args.load_dir!r}, tag={args.load_tag!r}) loaded nothing")
        if client_state.get("client_marker") != CLIENT_STATE["client_marker"]:
            raise RuntimeError(f"client_state not restored: {sorted(client_state)}")

    start = args.start_step if args.start_step is not None else engine.global_steps
    micro = GLOBAL_BATCH // world_size
    losses = []
    for step in range(start, start + args.steps):
        tokens, targets = global_batch(step)
        sl = slice(rank * micro, (rank + 1) * micro)
        loss = engine(tokens[sl], targets[sl])
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        losses.append((t / world_size).item())

    if args.dump_state:
        dump_state(engine, model, args.dump_state, rank)

    if not args.no_save and args.save_dir is not None:
        engine.save_checkpoint(args.save_dir, client_state=dict(CLIENT_STATE))
    if args.ucp_save_dir:
        ucp.deepspeed.wait(engine)  # before destroy_process_group, which would cut the writers' collectives

    if rank == 0 and args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump(losses, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    import ucp.deepspeed
    ucp.deepspeed.finish(main())
