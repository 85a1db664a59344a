"""The `ucp` command line. Heavy imports (torch, deepspeed) happen inside the commands that need them."""
from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import traceback

DESCRIPTION = """\
ucp: universal checkpoints for DeepSpeed.

Converts the sharded checkpoints DeepSpeed writes (ZeRO 1/2/3, any DP degree, fp32/fp16/bf16) into a
parallelism-free atomic format: per-parameter fp32 weights and optimizer states, keyed by name,
stored in a few safetensors files with a JSON index. Any later layout can resume from it.
"""

EPILOG = """\
examples:
  ucp convert --input ckpts/ --output ckpts_ucp/          convert the tag named in ckpts/latest
  ucp convert --input ckpts/global_step100 --output out/ --workers 4
  ucp convert --input trainer_out/ --output out/           the Trainer's last checkpoint-N, config and tokenizer
  ucp convert --input ckpts/ --output uc/global_step100 --format deepspeed   stock load_universal layout
  ucp convert --input ckpts/ --output ckpts_ucp/ --resume     finish an interrupted conversion
  ucp convert --input ckpts/ --output ckpts_ucp/ --splits 8   split-major, for split-driven loading
  ucp convert --input /shared/ckpts --output /shared/ucp --executor ray --ray-address auto
  ucp submit --address http://HEAD:8265 -- convert --input /shared/ckpts --output /shared/ucp
  ucp export --input ckpts/checkpoint-500 --output hf_model/ --to hf --dtype bfloat16
  ucp export --input ckpts_ucp/ --output dcp_ckpt/ --to dcp       for FSDP2 / torch.distributed.checkpoint
  ucp inspect ckpts_ucp/                                  parameters, shapes, patterns, sizes
  ucp verify ckpts_ucp/                                   checksums and completeness
  ucp plan --gpus 28 --gpu-memory 80 --model examples/models/llama2-7b.json   parallel plans for 28 GPUs
  ucp demo                                                train, save, convert, inspect, resume elsewhere

exit status:
  0  success            1  ucp verify found problems      2  bad input (a damaged, missing or mismatched
  3  the system refused (no space, read-only, permission)    checkpoint, a bad option): one line says which
  130 interrupted (nothing committed)                         file and the fix; --debug adds the traceback
  141 stdout's reader went away (ucp inspect ... | head)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ucp", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--debug", action="store_true", help="on an error, print the full traceback too")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("convert", help="convert a DeepSpeed checkpoint to the atomic format",
                       description="Convert a DeepSpeed checkpoint (the directory given to engine.save_checkpoint, "
                                   "or one of its tag folders) into a ucp atomic checkpoint, or into DeepSpeed's own "
                                   "universal layout with --format deepspeed.")
    p.add_argument("--input", required=True, metavar="DIR",
                   help="directory given to engine.save_checkpoint (tag read from its 'latest' file), or a tag folder; "
                        "or a Hugging Face Trainer output_dir (its last checkpoint-N folder)")
    p.add_argument("--tag", metavar="T", help="checkpoint tag to convert instead of the one in 'latest' (for a "
                   "Trainer output_dir: a checkpoint-N folder)")
    p.add_argument("--output", required=True, metavar="DIR", help="output directory (created; must be empty or new)")
    p.add_argument("--workers", type=int, metavar="N", help="parallel worker processes (default: CPU count, max 8)")
    p.add_argument("--format", choices=["ucp", "deepspeed"], default="ucp",
                   help="ucp: the atomic format (default); deepspeed: DeepSpeed's universal layout for "
                        "{\"checkpoint\": {\"load_universal\": true}} (OUTPUT is then the tag folder; "
                        "'latest_universal' is written beside it)")
    p.add_argument("--strict", action="store_true",
                   help="check that replicated copies are identical instead of taking rank 0's")
    p.add_argument("--param-names", metavar="FILE",
                   help="ZeRO-0 only, when names cannot be recovered from shapes: the optimizer's parameter "
                        "names, one per line, in param-group order (a pipeline checkpoint, tensor-parallel or not: "
                        "every stage's, stage after stage, once for all its TP ranks)")
    p.add_argument("--pattern", action="append", metavar="NAME=PATTERN",
                   help="tensor-parallel checkpoints that do not declare their layout: how the TP shards of "
                        "NAME (a parameter name, or a regex of whole names) join: shard_v (dim 0), shard_h "
                        "(dim 1), replicate or partial; repeat for several. Overrides what the checkpoint declares")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="local: a process pool on this machine (default); ray: map and reduce tasks on a Ray "
                        "cluster (--ray-address), or on a local Ray instance started for this conversion. Same "
                        "--workers, same output bytes")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="with --executor ray: the cluster to join (e.g. auto, or HEAD:6379); default: $RAY_ADDRESS, "
                        "else a local Ray instance of --workers CPUs")
    p.add_argument("--resume", action="store_true",
                   help="keep the data files an interrupted conversion of the same source finished (each checked "
                        "against its checksums) and convert only the rest; use the same --workers")
    p.add_argument("--splits", type=int, metavar="K",
                   help="store every tensor split-major in K splits along its tensor-parallel dim, so a rank of "
                        "any layout whose TP size divides K reads exactly its slice in one read (ucp.hmp); K is "
                        "e.g. the lcm of the TP sizes `ucp plan` may use. Dims come from Hugging Face Llama/Qwen2/"
                        "Mistral parameter names unless --split-rules says otherwise")
    p.add_argument("--split-rules", metavar="FILE",
                   help="with --splits: a JSON object mapping a regex of parameter names to its TP dim (or null "
                        "for tensors stored whole), first match wins")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser("export", help="export a checkpoint as a transformers folder or a PyTorch DCP checkpoint",
                       description="Export a ucp checkpoint, or any DeepSpeed checkpoint ucp reads, as a "
                                   "save_pretrained folder for transformers (--to hf: config.json, safetensors "
                                   "shards, tied weights stored once, checked against the architecture), or as a "
                                   "torch.distributed.checkpoint folder of FQN-keyed model and optimizer state "
                                   "(--to dcp, for dcp.load + set_model_state_dict / set_optimizer_state_dict at "
                                   "any world size), or as one Lightning checkpoint file (--to lightning, for "
                                   "LightningModule.load_from_checkpoint). Streams tensor by tensor; OUTPUT "
                                   "appears only once complete.")
    p.add_argument("--input", required=True, metavar="CKPT", help="a ucp checkpoint, or a DeepSpeed checkpoint "
                   "(the directory given to engine.save_checkpoint, or a tag folder)")
    p.add_argument("--output", required=True, metavar="DIR", help="output directory (must not exist, or be empty)")
    p.add_argument("--to", required=True, choices=["hf", "dcp", "lightning"], help="hf: a transformers folder; "
                   "dcp: a PyTorch distributed checkpoint; lightning: one fp32 Lightning checkpoint file (OUTPUT is "
                   "the file), as Lightning's convert_zero_checkpoint_to_fp32_state_dict writes it")
    p.add_argument("--tag", metavar="T", help="for a DeepSpeed save directory: the tag to export")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of the exported weights (default float32); DCP optimizer states stay float32")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="--to hf: largest safetensors shard, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    p.add_argument("--config", metavar="PATH", help="the model's config.json, or the folder holding it (default: "
                   "the one in the checkpoint folder or beside its DeepSpeed tag folder, as the HF Trainer "
                   "saves it); needed by --to hf, used by --to dcp for tied weights")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="threads reading tensors ahead of the writer (default 1)")
    p.add_argument("--optimizer", metavar="CLASS",
                   help="--to dcp: the optimizer class the loading job runs, whose param-group keys the export "
                        "holds: torch.optim.AdamW (the default when DeepSpeed ran Adam or AdamW: its "
                        "hyper-parameters mapped onto torch's keys, refused where the update would differ), "
                        "torch.optim.Adam, or saved (the checkpoint's own keys, the default otherwise)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser("inspect", help="table of parameters, shapes, patterns and sizes",
                       description="Show what a checkpoint holds: a ucp directory, or a DeepSpeed checkpoint.")
    p.add_argument("path", metavar="DIR")
    p.add_argument("--tag", metavar="T", help="for a DeepSpeed save directory: the tag to show")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("verify", help="check completeness and every tensor's checksum",
                       description="Verify a ucp checkpoint: every file present at its recorded size, every tensor "
                                   "in bounds and matching its CRC-32, every extra file matching its CRC-32. A "
                                   "DeepSpeed checkpoint is read whole instead. Exits 1 on any problem.")
    p.add_argument("path", metavar="DIR", help="a ucp checkpoint, or a save folder of ucp.deepspeed.save (the "
                   "checkpoint its `latest` names); or a DeepSpeed checkpoint, read whole as `ucp convert` reads it")
    p.add_argument("--tag", metavar="T", help="for a DeepSpeed save directory: the tag to verify")

    p = sub.add_parser("submit", help="run a ucp command as a job on a Ray cluster and follow its logs",
                       description="Submit `ucp COMMAND ...` (convert, verify or inspect) to a Ray cluster's job "
                                   "server, print the job's logs until it ends, and exit 1 if it fails. convert runs "
                                   "with --executor ray unless told otherwise. Paths are read on the cluster: use "
                                   "absolute paths on storage every node shares.",
                       epilog="example: ucp submit --address http://HEAD:8265 -- convert --input /shared/ckpts "
                              "--output /shared/ckpts_ucp")
    p.add_argument("--address", required=True, metavar="URL",
                   help="the job server of the cluster's head node (its dashboard), e.g. http://HEAD:8265")
    p.add_argument("--working-dir", metavar="DIR",
                   help="a local directory uploaded with the job and made its working directory (runtime_env "
                        "working_dir)")
    p.add_argument("--ship-ucp", action="store_true",
                   help="upload this ucp with the job (runtime_env py_modules), for clusters where ucp is not "
                        "installed on every node; torch, safetensors, numpy and tqdm must still be installed there")
    p.add_argument("ucp_args", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the ucp command to run on the cluster, after '--'")

    p = sub.add_parser("plan", help="search parallel plans (heterogeneous TP/PP per replica) for N GPUs",
                       description="Search Elastor-style parallel plans for a model on exactly N GPUs, counts that "
                                   "divide nothing included: TP groups of up to --tp-max GPUs, dealt to DP replicas "
                                   "that may differ in TP sizes and pipeline stages, layers balanced across stages "
                                   "and micro-batches across replicas. Prints the fastest plans under the cost model "
                                   "of docs/PLAN.md with their step time and memory per GPU.")
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs to use, all of them")
    p.add_argument("--gpu-memory", type=float, required=True, metavar="GiB", help="memory of one GPU, in GiB")
    p.add_argument("--model", required=True, metavar="CONFIG.json",
                   help="a Hugging Face config.json (Llama, Qwen2, Mistral keys); see examples/models/")
    p.add_argument("--global-batch", type=int, default=256, metavar="B", help="sequences per step (default 256)")
    p.add_argument("--seq-len", type=int, default=4096, metavar="S", help="tokens per sequence (default 4096)")
    p.add_argument("--top", type=int, default=5, metavar="K", help="how many plans to show (default 5)")
    p.add_argument("--gpu-tflops", type=float, metavar="T", help="dense bf16 TFLOP/s of one GPU (default 312, A100)")
    p.add_argument("--tp-max", type=int, metavar="T", help="largest TP group, GPUs on one fast link (default 8)")
    p.add_argument("--zero", type=int, choices=[0, 1], help="1: shard optimizer states across replicas of the "
                   "same shape (default); 0: keep them whole on every replica")
    p.add_argument("--json", action="store_true", help="machine-readable output, with each plan's layout")

    p = sub.add_parser("demo", help="train on 2 CPU ranks, save, convert, inspect, resume on 3 ranks",
                       description="End-to-end demo on this machine: trains a tiny model with DeepSpeed "
                                   "(ZeRO-2, 2 CPU processes, gloo), saves a checkpoint, converts it with ucp, "
                                   "shows the atomic checkpoint, then resumes it under ZeRO-3 on 3 processes "
                                   "through ucp.deepspeed and compares the losses with the uninterrupted run.")
    p.add_argument("--workdir", metavar="DIR", help="where to write (default: a new temporary directory)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from ucp.version import __version__

        print(f"ucp {__version__}")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    from ucp.cli.warnings_route import warnings_routed
    from ucp.errors import UcpError

    notes = _notes_to_stderr(args.command)
    # What torch or a plugin warns while the command imports it stays out of the command's output (--debug shows it).
    with warnings_routed(debug=args.debug):
        try:
            from ucp.cli import commands

            code = getattr(commands, f"cmd_{args.command}")(args)
            sys.stdout.flush()  # here, where a reader that went away (`ucp inspect ... | head`) is handled
            return code
        except BrokenPipeError:
            return _reader_gone()
        except UcpError as exc:
            return _fail(args, f"{exc}", 2)
        except OSError as exc:
            return _fail(args, os_error_line(exc, getattr(args, "output", None)), 3)
        except KeyboardInterrupt:
            print(f"ucp {args.command}: interrupted; no index was written, the output is not a checkpoint",
                  file=sys.stderr)
            return 130
        finally:
            logging.getLogger("ucp").removeHandler(notes)


def _reader_gone() -> int:
    """stdout's reader closed the pipe (`ucp inspect ... | head`): stop quietly, as a tool killed by SIGPIPE
    does (the shell reports 141), and point stdout at /dev/null so that Python's flush at exit does not
    complain about the pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


class _Redacting(logging.Formatter):
    """A note's line with every URL in it shown without credentials (`redact`), whoever formatted the URL."""

    def format(self, record: logging.LogRecord) -> str:
        from ucp.errors import redact

        return redact(super().format(record))


def _notes_to_stderr(command: str) -> logging.Handler:
    """Show ucp's informational log lines (which checkpoint-N was picked, which files were left out)
    on stderr, one line each; removed again when the command ends, so `main` can run many times."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Redacting(f"ucp {command}: %(message)s"))
    handler.setLevel(logging.INFO)
    logger = logging.getLogger("ucp")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return handler


_OS_FIXES = {
    errno.ENOSPC: "free space there, or choose another --output",
    errno.EDQUOT: "free space there, or choose another --output",
    errno.EROFS: "the file system is read-only; choose another --output",
    errno.EACCES: "check its permissions",
    errno.EPERM: "check its permissions",
    errno.ENOTDIR: "a file stands where a folder is expected; pass a folder",
    errno.EISDIR: "a folder stands where a file is expected",
    errno.ENOENT: "check the path",
}


def os_error_line(exc: OSError, output: str | None = None) -> str:
    """An OSError as one line: the path (else the output being written), what the system said, the fix."""
    where = exc.filename if exc.filename is not None else output or "?"
    fix = _OS_FIXES.get(exc.errno or 0, "check the path and the file system")
    return f"{where}: {exc.strerror or exc}; {fix}"


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    """The error's one line, every URL in it without credentials (`redact`: the message may quote a URL as the
    user typed it)."""
    from ucp.errors import redact

    if args.debug:
        traceback.print_exc()
    print(f"ucp {args.command}: error: {redact(message)}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
