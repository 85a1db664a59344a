"""`ucp demo`: the main job on the embedded default, end to end on this machine's CPUs."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from ucp.errors import UcpError


def cpu_launch_env() -> dict[str, str]:
    """Environment for DeepSpeed on CPU ranks: gloo, a fixed cache for the shm op DeepSpeed compiles once."""
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/ucp/torch_extensions"))
    env.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    return env


def torchrun(module: str, args: list[str], nproc: int) -> None:
    env = cpu_launch_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", env["MASTER_PORT"], "-m", module, *args]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("  step"):
            print(line)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise UcpError(f"the demo's training job failed (exit {proc.returncode}):\n{tail}")


def run_demo(workdir: str | None) -> int:
    try:
        import deepspeed  # noqa: F401  (only checks it is installed)
    except ImportError:
        raise UcpError("the demo trains with DeepSpeed: pip install deepspeed") from None
    from ucp.checkpoint import open_checkpoint
    from ucp.cli.commands import describe
    from ucp.convert import convert

    root = Path(workdir or tempfile.mkdtemp(prefix="ucp-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    save_dir, out_dir = root / "deepspeed", root / "atomic"
    print(f"[1/3] training a tiny language model with DeepSpeed ZeRO-2 on 2 CPU ranks; saving to {save_dir}")
    torchrun("ucp.cli.demo_train", ["--save-dir", str(save_dir), "--steps", "5", "--stage", "2"], nproc=2)
    print(f"[2/3] converting to the atomic format: {out_dir}")
    result = convert(save_dir, out_dir, workers=2)
    print(f"      {result.params} parameters in {len(result.files)} safetensors files + index")
    print("[3/3] the atomic checkpoint (ucp inspect):")
    ckpt = open_checkpoint(out_dir)
    print(describe(ckpt, [ckpt.info(n) for n in ckpt.names]))
    problems = ckpt.verify()
    print(f"verify: {'OK' if not problems else problems}")
    return 1 if problems else 0
