"""Train on replicas of unequal tensor-parallel size (heterogeneous model parallelism), CPU/gloo or GPU.

    torchrun --nproc-per-node 3 examples/hmp/train.py --tp-sizes 2,1 --steps 20 --global-batch 16 \\
        --losses-out /tmp/hmp.jsonl

`--tp-sizes 2,1` is one replica of TP 2 (ranks 0-1) and one of TP 1 (rank 2); `1,1` is plain data
parallelism, `1` one process. Each replica takes a share of every global batch in proportion to its
speed (`ucp.hmp.strategy.replica_speeds`, or `--speeds`), drawn from one global sample order
(`ucp.elastic.ElasticBatchSampler.for_replica`), so any TP sizes train on the same samples per step;
after each backward `ucp.hmp.grad_sync.GradSync` reduces every gradient across replicas by splits,
weighted by the samples each replica computed, so each step is the homogeneous data-parallel step over
the same global batch, and so are the losses. Rank 0 appends {"step": t, "loss": global mean loss} per
optimizer step to `--losses-out`.

`--layout FILE` trains on any layout instead, pipeline splits within a replica included: `Layout.to_json()`'s JSON
(each replica's `micro_batches` are its samples per step) or the plans `ucp plan --json` prints (the fastest, or
`--plan-index K`). Each rank then holds its stage's part of the model and activations go stage to stage point to
point (`pipeline.py`); the replica's loss is its last stage's:

    ucp plan --gpus 5 --model examples/hmp/model.json --gpu-memory 4 --global-batch 16 --seq-len 8 --json > plan.json
    torchrun --nproc-per-node 5 examples/hmp/train.py --layout plan.json --steps 20 --global-batch 16

With `--deepspeed` every rank runs a DeepSpeed engine (`--zero 0|1`, `--bf16`) built by
`ucp.deepspeed.initialize` with `"ucp": {"layout": ..., "hmp": {"global_batch", "micro_batch", "shares"}}`:
the sync then runs inside `engine.step` (`ucp.deepspeed.engine.hmp_sync`), and the loop is DeepSpeed's own,
`engine.backward(loss * sampler.loss_weight(n)); engine.step()` (a stage before the last back-propagates
`(out * grad_from_next).sum()`, not divided by the accumulation steps again). `--save-dir DIR` saves ucp
checkpoints from the layout (`"save": {"every": --save-every, "keep": --keep}`; with `--memory-every N` also into
host memory, `"memory": {"every": N, "replicas": --replicas, "dir": --memory-dir}`), `--load DIR/global_stepN`
resumes from one saved at any layout (`--load auto`: from the newest in --save-dir or the memory tier,
`"load": "auto"`), and `--plain-dp` (TP sizes of 1) runs DeepSpeed's own data parallelism instead: the
homogeneous run. `--stop-after K` ends after step K without the last save, as a lost job would.

With `--elastic` the job runs under torchrun's elastic agent and `--tp-sizes` lists the TP sizes it may use
(`"elastic": {"tensor_parallel": [...], "heterogeneous": true}`): at each start `ucp.elastic.layout()` chooses the
layout for the ranks there are (4 ranks and `--tp-sizes 2`: two TP-2 replicas; 3 ranks: TP 2 + 1, shares by speed),
the model is built for this rank's replica, `"load": "auto"` resumes from the newest save in `--save-dir` (saved at
any layout), and the loop is the plain elastic one:

    ucp-torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 \\
        --rdzv-id=hmp --max-restarts=10 --monitor-interval=1 --rdzv-conf=last_call_timeout=2 \\
        examples/hmp/train.py --elastic --tp-sizes 2 --deepspeed --zero 1 --save-dir /tmp/hmp-elastic --steps 40

With `--model examples/hmp/model.json --pipeline-parallel 2,1` each start takes the cost model's layout: where the
ranks leave spares, the plan `ucp plan` prints first for them, a replica may be a pipeline of stages of unequal TP
size (3 ranks: a TP-1 stage, then a TP-2 stage), trained through the same stage links.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from layout_file import read_layout
from pipeline import StageLinks, forward_backward
from tp_model import Config, TPModel, init_weights, param_table

from ucp.elastic import ElasticBatch, ElasticBatchSampler, init_distributed, speed_shares
from ucp.errors import ConfigError, UcpError
from ucp.hmp.grad_sync import IN_PLACE_ELEMENTS, GradSync
from ucp.hmp.layout import Layout, Placement
from ucp.hmp.strategy import CostModel, replica_speeds

SEQ = 8          # tokens per sample
SAMPLES = 96     # samples in the synthetic dataset (one epoch)


class Sequences(torch.utils.data.Dataset):
    """Learnable token sequences: each next token is (5 * token + 3) mod vocab, from a seeded first token."""

    def __init__(self, cfg: Config, seed: int = 1):
        first = torch.randint(0, cfg.vocab, (SAMPLES, 1), generator=torch.Generator().manual_seed(seed))
        rows = [first]
        for _ in range(SEQ):
            rows.append((rows[-1] * 5 + 3) % cfg.vocab)
        self.tokens = torch.cat(rows, dim=1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


def parse_sizes(text: str, what: str, kind=int) -> list:
    try:
        values = [kind(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"{what} {text!r}: expected numbers separated by commas, e.g. 2,1") from None
    if not values or min(values) <= 0:
        raise ConfigError(f"{what} {text!r}: every entry must be positive")
    return values


def main(args: argparse.Namespace) -> None:
    if (args.save_dir or args.load or args.plain_dp) and not args.deepspeed:
        raise ConfigError("--save-dir, --load and --plain-dp run DeepSpeed engines: add --deepspeed")
    if (args.tp_sizes is None) == (args.layout is None):
        raise ConfigError("pass one of --tp-sizes (one-stage replicas) and --layout (a layout or plan JSON file)")
    if args.layout and (args.elastic or args.plain_dp or args.speeds):
        raise ConfigError("--layout gives the replicas and their shares: drop --elastic, --plain-dp and --speeds")
    cfg = Config(layers=args.layers)
    if args.memory_every and not args.save_dir:
        raise ConfigError("--memory-every saves beside the disk tier: add --save-dir")
    if args.stop_after and (not args.deepspeed or args.elastic):
        raise ConfigError("--stop-after stops a --deepspeed run without --elastic")
    init_distributed("gloo" if args.device == "cpu" else "nccl")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if (args.model or args.pipeline_parallel) and not args.elastic:
        raise ConfigError("--model and --pipeline-parallel choose the layout of an --elastic job: add --elastic, or "
                          "train on a plan with --layout")
    if args.elastic:
        if not (args.deepspeed and args.save_dir) or args.load or args.plain_dp or args.sync != "weighted":
            raise ConfigError("--elastic runs DeepSpeed engines that resume from --save-dir: add --deepspeed and "
                              "--save-dir (not --load, --plain-dp or --sync)")
        train_elastic(args, parse_sizes(args.tp_sizes, "--tp-sizes"), cfg)
        dist.barrier()
        dist.destroy_process_group()
        return
    layout, shares = layout_and_shares(args, cfg)
    if args.deepspeed:
        train_deepspeed(args, layout, shares, cfg)
    else:
        train_plain(args, layout, shares, cfg)
    dist.barrier()
    dist.destroy_process_group()


def layout_and_shares(args: argparse.Namespace, cfg: Config) -> tuple[Layout, tuple[int, ...]]:
    """The layout to train on (`--layout`'s, or one-stage replicas of `--tp-sizes`) and each replica's samples."""
    world = dist.get_world_size()
    if args.layout:
        layout, shares = read_layout(args.layout, args.plan_index, cfg.layers, SEQ)
        if layout.world_size != world:
            raise ConfigError(f"--layout {args.layout} places {layout.world_size} ranks, but torchrun started "
                              f"{world}; pass --nproc-per-node {layout.world_size}")
        if sum(shares) != args.global_batch:
            raise ConfigError(f"--layout {args.layout}: the replicas take {sum(shares)} samples per step, not "
                              f"--global-batch {args.global_batch}; pass --global-batch {sum(shares)}")
        return layout, shares
    tp_sizes = parse_sizes(args.tp_sizes, "--tp-sizes")
    if sum(tp_sizes) != world:
        raise ConfigError(f"--tp-sizes {args.tp_sizes} adds up to {sum(tp_sizes)} ranks, but torchrun started "
                          f"{world}; pass --nproc-per-node {sum(tp_sizes)}")
    probe = Layout.one_stage(tp_sizes, (1,) * len(tp_sizes), cfg.layers)
    speeds = parse_sizes(args.speeds, "--speeds", float) if args.speeds else replica_speeds(probe, CostModel(80.0))
    if len(speeds) != len(tp_sizes):
        raise ConfigError(f"--speeds {args.speeds}: one speed per replica ({len(tp_sizes)})")
    shares = speed_shares(args.global_batch, speeds)
    if args.plain_dp and (max(tp_sizes) != 1 or len(set(shares)) != 1):
        raise ConfigError(f"--plain-dp: DeepSpeed's own data parallelism takes TP sizes of 1 and equal shares "
                          f"(got --tp-sizes {args.tp_sizes}, shares {list(shares)} of --global-batch "
                          f"{args.global_batch})")
    return Layout.one_stage(tp_sizes, shares, cfg.layers), shares


def train_plain(args: argparse.Namespace, layout: Layout, shares: tuple[int, ...], cfg: Config) -> None:
    """Plain AdamW, with `GradSync` called between backward and step."""
    rank = dist.get_rank()
    where = layout.placement(rank)
    tp_ranks = layout.replicas[where.replica].stages[where.stage].ranks
    tp_groups = {s.ranks: dist.new_group(list(s.ranks)) for r in layout.replicas for s in r.stages}  # all ranks
    model = TPModel(layout, rank, cfg, tp_groups[tp_ranks], init_weights(cfg, args.seed)).to(args.device)
    table = param_table(cfg)
    # --sync unweighted / off: negative controls, a plain average of unequal shares or no sync at all
    sync = None if args.sync == "off" else GradSync(
        layout, table, model.named_slices(), shares if args.sync == "weighted" else (1,) * len(shares),
        in_place_elements=args.in_place_elements)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    dataset = Sequences(cfg)
    batch = ElasticBatch(args.global_batch, max(shares), len(shares), shares)  # one micro-batch per replica and step
    sampler = ElasticBatchSampler.for_replica(dataset, batch, where.replica, shuffle=True, seed=args.seed)
    links = StageLinks.for_rank(layout, rank)
    step = 0
    while step < args.steps:
        for indices in sampler:
            tokens = torch.stack([dataset[i] for i in indices]).to(args.device)
            loss = forward_backward(links, model, lambda x, _: x.backward(), tokens, cfg.hidden, torch.float32)
            if sync is not None:
                sync()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            write_loss(args, step, loss.item() * len(indices) if holds_loss(links, where) else 0.0)
            if step == args.steps:
                break
    write_params(args, model, where.replica)


def train_deepspeed(args: argparse.Namespace, layout: Layout, shares: tuple[int, ...], cfg: Config) -> None:
    """A DeepSpeed engine per rank; `ucp.deepspeed.initialize` installs the sync inside `engine.step`."""
    import ucp.deepspeed
    from ucp.deepspeed.engine.hmp_sync import RankAloneMpu, hmp_batch, replica_batch_keys

    rank = dist.get_rank()
    mpu = RankAloneMpu.for_layout(layout)  # every rank: every TP group, then every rank's group of one
    model = TPModel(layout, rank, cfg, mpu.tp_group, init_weights(cfg, args.seed)).to(args.device)
    hmp = {"global_batch": args.global_batch, "micro_batch": max(shares), "shares": list(shares)}
    options: dict = {"layout": layout.to_json(), "hmp": hmp}
    if args.save_dir:
        options["save"] = {"dir": args.save_dir, "every": args.save_every or args.steps}
        if args.keep:
            options["save"]["keep"] = args.keep
        if args.memory_every:
            options["save"]["memory"] = memory_tier(args)
    if args.load:
        options["load"] = args.load  # loaded by the layout: each rank reads its slices
    config: dict = {"zero_optimization": {"stage": args.zero}, "steps_per_print": 10**9,
                    "gradient_clipping": 0.0,  # as the plain loop (DeepSpeed 0.19.8 clips to 1.0 by default)
                    "ucp": options}
    if args.bf16:
        config["bf16"] = {"enabled": True}
        if args.zero == 1:  # DeepSpeed's BF16_Optimizer: fp32 gradients, which the sync reduces
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    batch = hmp_batch(hmp, layout)
    if args.sync == "off":  # negative control: the same engines without the sync
        without = {k: v for k, v in options.items() if k != "hmp"}
        config = replica_batch_keys({**config, "ucp": without}, batch)
    if args.plain_dp:  # the homogeneous reference: one engine over the world, DeepSpeed's own all-reduce
        config = {**config, "ucp": {k: v for k, v in options.items() if k not in ("hmp", "layout")},
                  "train_batch_size": args.global_batch, "train_micro_batch_size_per_gpu": max(shares),
                  "gradient_accumulation_steps": 1}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)  # the plain loop's
    engine, _, _, _ = ucp.deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                               mpu=None if args.plain_dp else mpu)
    where = layout.placement(rank)
    dataset = Sequences(cfg)
    if args.sync != "off" and not args.plain_dp:
        batch = engine.ucp_hmp.batch  # the "hmp" section's, as ucp.deepspeed.initialize read it
    # After a load, the stream goes on after the samples the checkpoint consumed (B per step at any layout).
    sampler = ElasticBatchSampler.for_replica(dataset, batch, where.replica, int(engine.global_samples),
                                              shuffle=True, seed=args.seed)
    engine_steps(args, engine, layout, sampler, dataset, cfg, min(args.steps, args.stop_after or args.steps))
    last = args.save_dir and not args.stop_after  # a stopped job saves only on its cadence, as a lost one did
    if last and engine.global_steps % (args.save_every or args.steps):  # the last step, not saved yet
        ucp.deepspeed.save(engine, args.save_dir, async_=False)
    ucp.deepspeed.wait(engine)  # the save in flight is committed before the process group goes
    write_params(args, model, where.replica)


def train_elastic(args: argparse.Namespace, tp_sizes: list[int], cfg: Config) -> None:
    """The elastic loop: the layout of this start from `ucp.elastic.layout()` (with `--model`, `ucp plan`'s plan,
    pipelines within replicas included), the model built for this rank's stage."""
    import ucp.deepspeed
    import ucp.elastic
    from ucp.deepspeed.engine.hmp_sync import RankAloneMpu

    elastic = {"global_batch": args.global_batch, "micro_batch": args.global_batch, "tensor_parallel": tp_sizes,
               "heterogeneous": True}
    if args.pipeline_parallel:
        elastic["pipeline_parallel"] = parse_sizes(args.pipeline_parallel, "--pipeline-parallel")
    if args.model:  # the model's shape for the cost model and the search: every layout is ucp plan's
        elastic.update(model=args.model, gpu_memory=args.gpu_memory, seq_len=SEQ)
    save = {"dir": args.save_dir, "every": args.save_every or 1, **({"keep": args.keep} if args.keep else {})}
    if args.memory_every:
        save["memory"] = memory_tier(args)
    config: dict = {"zero_optimization": {"stage": args.zero}, "steps_per_print": 10**9, "gradient_clipping": 0.0,
                    "ucp": {"elastic": elastic, "load": "auto", "save": save}}
    if args.bf16:
        config["bf16"] = {"enabled": True}
        if args.zero == 1:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    place = ucp.elastic.layout(config)   # the same layout on every rank; no spares: unequal replicas use them all
    layout = place.hmp_layout(cfg.layers)
    rank = dist.get_rank()
    mpu = RankAloneMpu.for_layout(layout)  # every rank: every TP group, then every rank's group of one
    model = TPModel(layout, rank, cfg, mpu.tp_group, init_weights(cfg, args.seed)).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    engine, _, _, _ = ucp.deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    dataset = Sequences(cfg)
    sampler = ucp.elastic.ElasticBatchSampler(dataset, engine, shuffle=True, seed=args.seed)  # this replica's share
    stages = [[[s.tp, *s.layers] for s in r.stages] for r in layout.replicas]  # logged: TP size, layers [a, b)
    engine_steps(args, engine, layout, sampler, dataset, cfg, args.steps,
                 {"world": place.world, "tp": list(place.choice.replicas), "stages": stages, "pid": os.getpid()})
    ucp.deepspeed.wait(engine)  # the last save is committed


def engine_steps(args: argparse.Namespace, engine, layout: Layout, sampler, dataset: Sequences, cfg: Config,
                 steps: int, logged: dict | None = None) -> None:
    """DeepSpeed's loop on this rank's stage until the engine has taken `steps` steps: each micro-batch through the
    stage links, `engine.step()`, and the global loss of each optimizer step (with `logged`'s fields) to
    --losses-out."""
    rank = dist.get_rank()
    links, where = StageLinks.for_rank(layout, rank), layout.placement(rank)
    dtype = next(engine.module.parameters()).dtype  # of the activations between stages

    def backward(x: torch.Tensor, is_loss: bool) -> None:  # DeepSpeed divides the loss by the accumulation steps
        engine.backward(x, scale_wrt_gas=is_loss)           # once: the gradients sent back already carry it

    summed = 0.0
    while engine.global_steps < steps:
        for indices in sampler:
            tokens = torch.stack([dataset[i] for i in indices]).to(args.device)
            # "unweighted": negative control, every micro-batch's mean loss as it is, whatever its size
            weight = 1.0 if args.sync == "unweighted" else sampler.loss_weight(len(indices))
            loss = forward_backward(links, engine, backward, tokens, cfg.hidden, dtype, weight)
            summed += loss.item() * len(indices) if holds_loss(links, where) else 0.0
            before = engine.global_steps
            engine.step()
            if engine.global_steps != before:
                write_loss(args, engine.global_steps, summed, logged)
                summed = 0.0
            if engine.global_steps >= steps:
                break


def holds_loss(links: StageLinks, where: Placement) -> bool:
    """Whether this rank reports its replica's loss: the first TP rank of the last stage (one per replica)."""
    return links.last and where.tp_rank == 0


def memory_tier(args: argparse.Namespace) -> dict:
    """The `"memory"` section of `"save"` that --memory-every, --replicas and --memory-dir ask for."""
    section = {"every": args.memory_every, "replicas": args.replicas}
    return {**section, "dir": args.memory_dir} if args.memory_dir else section


def write_loss(args: argparse.Namespace, step: int, summed: float, extra: dict | None = None) -> None:
    """Rank 0 appends the step's global mean loss: the sum over every replica's samples (from `holds_loss` ranks)."""
    total = torch.tensor([summed / args.global_batch], dtype=torch.float64, device=args.device)
    dist.all_reduce(total)
    if dist.get_rank() == 0 and args.losses_out:
        with open(args.losses_out, "a") as f:
            f.write(json.dumps({"step": step, "loss": total.item(), **(extra or {})}) + "\n")


def write_params(args: argparse.Namespace, model: TPModel, replica: int) -> None:
    """With --params-out, every rank writes its parameter slices (fp32) and their boxes."""
    if not args.params_out:
        return
    out = Path(args.params_out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"replica": replica, "boxes": model.boxes, "shapes": {s.name: s.shape for s in model.ucp_param_table},
                "params": {n: p.detach().float().cpu() for n, p in model.named_slices().items()}},
               out / f"rank{dist.get_rank()}.pt")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp-sizes", help="one replica per entry, its TP size: 2,1 (1,1 is plain DP); or --layout")
    p.add_argument("--layout", help="train on this layout: Layout.to_json()'s JSON, or ucp plan --json's output (its "
                   "plan --plan-index); replicas may run pipeline stages of different TP sizes")
    p.add_argument("--plan-index", type=int, default=0, help="with --layout from ucp plan --json: which plan (0: the "
                   "fastest)")
    p.add_argument("--layers", type=int, default=Config.layers, help="the model's layers (a plan's layout must "
                   "have as many)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step, over all replicas")
    p.add_argument("--losses-out", help='rank 0 appends {"step": t, "loss": global mean loss} per step (JSON lines)')
    p.add_argument("--save-dir", help="with --deepspeed: save ucp checkpoints here (global_step<N>), from any layout")
    p.add_argument("--save-every", type=int, help="with --save-dir: save every this many steps (asynchronously), and "
                   "the last step (synchronously; default: only the last)")
    p.add_argument("--keep", type=int, help="with --save-dir: keep the newest this many checkpoints")
    p.add_argument("--memory-every", type=int, help="with --save-dir: also save into host memory every this many "
                   'steps ("save": {"memory": {"every": N, "replicas": --replicas, "dir": --memory-dir}})')
    p.add_argument("--memory-dir", help="with --memory-every: the memory folder ($VARS expanded by each rank; "
                   "default: one in /dev/shm named after --save-dir)")
    p.add_argument("--replicas", type=int, default=1, help="with --memory-every: other nodes that keep a copy of "
                   "each node's pieces")
    p.add_argument("--stop-after", type=int, help="with --deepspeed: stop after this step as a lost job would, "
                   "without saving the last step beyond the cadence (a later --load auto goes on to --steps)")
    p.add_argument("--load", help="with --deepspeed: resume from this ucp checkpoint (saved at any layout); \"auto\": "
                   "from the newest in --save-dir, if any")
    p.add_argument("--plain-dp", action="store_true",
                   help="with --deepspeed and TP sizes of 1: DeepSpeed's own data parallelism, no HMP sync")
    p.add_argument("--speeds", help="relative replica speeds, e.g. 2,1 (default: the cost model's)")
    p.add_argument("--params-out", help="every rank writes its parameter slices here after training (rank<r>.pt)")
    p.add_argument("--sync", choices=("weighted", "unweighted", "off"), default="weighted",
                   help="the gradient sync across replicas; unweighted and off are negative controls")
    p.add_argument("--in-place-elements", type=int, default=IN_PLACE_ELEMENTS,
                   help="the sync reduces gradient pieces cut along dim 0 of at least this many elements in place")
    p.add_argument("--deepspeed", action="store_true", help="a DeepSpeed engine per rank, the sync inside engine.step")
    p.add_argument("--elastic", action="store_true", help="with --deepspeed and --save-dir: under torchrun's elastic "
                   "agent, --tp-sizes lists the TP sizes the job may use; each start takes ucp.elastic.layout()'s "
                   "layout (heterogeneous where the ranks leave no homogeneous one without spares)")
    p.add_argument("--pipeline-parallel", help="with --elastic: the pipeline stage counts the job may use, e.g. 2,1 "
                   "(default 1)")
    p.add_argument("--model", help="with --elastic: the model's shape as a Hugging Face config "
                   "(examples/hmp/model.json): each start takes the fastest plan ucp plan finds for its ranks")
    p.add_argument("--gpu-memory", type=float, default=4.0, help="with --model: GiB per rank for the cost model")
    p.add_argument("--zero", type=int, choices=(0, 1), default=0, help="with --deepspeed: the ZeRO stage")
    p.add_argument("--bf16", action="store_true", help="with --deepspeed: bf16 (ZeRO-1: fp32 gradient accumulation)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank, NCCL")
    return p


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        main(parser().parse_args())
    except UcpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
