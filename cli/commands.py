"""The subcommands behind `ucp`; each returns the process exit code."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import TYPE_CHECKING

from ucp.cli.tables import describe
from ucp.sizes import human_bytes

if TYPE_CHECKING:
    from ucp.convert.split_policy import SplitPolicy


def cmd_convert(args: argparse.Namespace) -> int:
    from ucp.convert import convert
    from ucp.errors import UcpError

    start = time.perf_counter()
    outlives_the_command(args.output)
    names = None
    if args.param_names:
        with open(args.param_names) as f:
            names = [line.strip() for line in f if line.strip()]
    if args.ray_address and args.executor != "ray":
        raise UcpError(f"--ray-address {args.ray_address} needs --executor ray")
    splits = split_policy(args)
    with executor_for(args) as executor:
        result = convert(args.input, args.output, tag=args.tag, workers=args.workers, fmt=args.format,
                         strict=args.strict, progress=not args.quiet, param_names=names, executor=executor,
                         resume=args.resume, splits=splits, patterns=patterns_given(args.pattern))
    if result.already_done:
        print(f"{result.output}: already holds this conversion ({result.params} parameters); nothing to do")
        return 0
    redone = f"; redid {result.redone} of {result.params} parameters, kept the rest" if args.resume else ""
    print(f"converted {result.params} parameters into {result.output} "
          f"({human_bytes(result.bytes_written)} in {result.files_written} files, "
          f"{time.perf_counter() - start:.1f} s{redone})")
    return 0


def outlives_the_command(output: str) -> None:
    """Refuse an --output that dies with the process: fsspec's memory:// is a dict inside it, so a conversion
    or export written there is gone the moment `ucp` exits (it used to report success). The Python API
    (`ucp.convert.convert`, `ucp.export`) still writes there, for a caller that reads it in the same process."""
    from ucp.errors import UnsupportedStorageError
    from ucp.storage.locations import url_scheme

    if (url_scheme(output) or "").lower() == "memory":
        raise UnsupportedStorageError(f"--output {output}: memory:// lives inside this one process, so what ucp "
                                      "writes there is gone when the command ends; write to a folder or a bucket "
                                      "(or call ucp.convert.convert from Python to keep it in memory)")


def split_policy(args: argparse.Namespace) -> SplitPolicy | None:
    """The `ucp.format.splits.SplitPolicy` that --splits and --split-rules ask for, or None."""
    from ucp.convert.split_policy import SplitPolicy, load_split_rules
    from ucp.errors import UcpError

    if args.splits is None:
        if args.split_rules:
            raise UcpError("--split-rules needs --splits K")
        return None
    if args.split_rules:
        return SplitPolicy(args.splits, load_split_rules(args.split_rules))
    return SplitPolicy(args.splits)


def patterns_given(values: list[str] | None) -> dict[str, str]:
    """`--pattern NAME=PATTERN` flags as {NAME: PATTERN} (NAME: a parameter name or a regex of whole names)."""
    from ucp.errors import UcpError

    out = {}
    for value in values or []:
        name, sep, pattern = value.rpartition("=")
        if not sep or not name or not pattern:
            raise UcpError(f"--pattern '{value}': expected NAME=PATTERN, e.g. "
                           "'model.layers.0.mlp.down_proj.weight=shard_h'")
        out[name] = pattern
    return out


def executor_for(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """The executor `--executor` names, as a context manager (Ray connects on entry, disconnects on exit)."""
    if args.executor == "ray":
        from ucp.convert.ray_executor import RayExecutor

        return RayExecutor(args.ray_address, args.workers, progress=not args.quiet)
    return contextlib.nullcontext(None)  # convert() builds the local process pool from --workers


def cmd_export(args: argparse.Namespace) -> int:
    from ucp.export import to_dcp, to_hf

    start = time.perf_counter()
    outlives_the_command(args.output)
    options = dict(dtype=args.dtype, config=args.config, workers=args.workers, tag=args.tag, progress=not args.quiet)
    if args.to == "hf":
        if args.optimizer:
            from ucp.errors import UcpError

            raise UcpError(f"--optimizer {args.optimizer} is for --to dcp; a transformers folder holds no optimizer")
        hf = to_hf(args.input, args.output, max_shard_size=args.max_shard_size, **options)
        tied = f"; tied copies stored once: {', '.join(hf.dropped)}" if hf.dropped else ""
        print(f"exported {hf.tensors} tensors into {hf.output} ({human_bytes(hf.bytes)} in {len(hf.files)} "
              f"safetensors files, {time.perf_counter() - start:.1f} s{tied})")
    elif args.to == "lightning":
        from ucp.lightning.export import to_lightning

        lit = to_lightning(args.input, args.output, dtype=args.dtype, tag=args.tag)
        print(f"exported {lit.tensors} tensors and Lightning's training state into {lit.output} "
              f"({human_bytes(lit.bytes)}, {time.perf_counter() - start:.1f} s)")
    else:
        dcp = to_dcp(args.input, args.output, optimizer=args.optimizer, **options)
        print(f"exported {dcp.model_tensors} model tensors and the optimizer state of {dcp.optimizer_params} "
              f"parameters into {dcp.output} ({human_bytes(dcp.bytes)}, {time.perf_counter() - start:.1f} s)")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from ucp.convert.ray_executor import submit_job

    argv = args.ucp_args[1:] if args.ucp_args[:1] == ["--"] else args.ucp_args
    return submit_job(args.address, argv, working_dir=args.working_dir, ship_ucp=args.ship_ucp)


def cmd_inspect(args: argparse.Namespace) -> int:
    from ucp.checkpoint import open_checkpoint

    ckpt = open_checkpoint(args.path, args.tag)
    infos = [ckpt.info(n) for n in ckpt.names]
    if args.json:
        json.dump({"source": ckpt.source, "step": ckpt.step, "optimizer": ckpt.optimizer,
                   "extra_files": ckpt.extra_files,
                   "params": [{"name": i.name, "kind": i.kind, "shape": list(i.shape), "pattern": i.pattern,
                               "states": list(i.states), "bytes": i.nbytes, "group": i.group} for i in infos],
                   "aliases": ckpt.aliases,
                   "not_saved": None if ckpt.not_saved is None else {
                       "kind": ckpt.not_saved.kind, "reason": ckpt.not_saved.reason,
                       "names": list(ckpt.not_saved.names)}},
                  sys.stdout, indent=1)
        print()
        return 0
    print(describe(ckpt, infos))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ucp.checkpoint import AtomicCheckpoint, open_checkpoint

    ckpt = open_checkpoint(args.path, args.tag)
    problems = ckpt.verify()
    if isinstance(ckpt, AtomicCheckpoint):
        tensors = sum(len(e.states) for e in ckpt.index.params.values())
        what = f"{tensors} tensors"
        done = f"{tensors} tensors, {len(ckpt.index.files)} files, every checksum matches"
    else:
        what = f"DeepSpeed checkpoint {ckpt.source['path']}"
        done = (f"read whole from {ckpt.source['path']}; DeepSpeed's files carry no checksums, "
                "ucp convert records them")
    if problems:
        for p in problems:
            print(p, file=sys.stderr)
        print(f"{ckpt.path}: {len(problems)} problem(s) in {what}", file=sys.stderr)
        return 1
    print(f"{ckpt.path}: OK ({len(ckpt.names)} parameters, {done})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ucp.cli.demo import run_demo

    return run_demo(args.workdir)


def cmd_plan(args: argparse.Namespace) -> int:
    from ucp.cli.plan import run_plan

    return run_plan(args)
