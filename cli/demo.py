"""`ucp demo`: the main job on the embedded default, end to end on this machine's CPUs."""
from __future__ import annotations

import json
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
        if line.startswith(("  step", "  resumed")):
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
    from ucp.cli.tables import describe
    from ucp.convert import convert

    root = Path(workdir or tempfile.mkdtemp(prefix="ucp-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    save_dir, out_dir = root / "deepspeed", root / "atomic"
    print(f"[1/4] training a tiny language model with DeepSpeed ZeRO-2 on 2 CPU ranks; saving at step 5 to "
          f"{save_dir}, then training on to step 8 as the reference")
    torchrun("ucp.cli.demo_train", ["--save-dir", str(save_dir), "--steps", "5", "--more-steps", "3",
                                    "--stage", "2", "--losses-out", str(root / "reference.json")], nproc=2)
    print(f"[2/4] converting the step-5 checkpoint to the atomic format: {out_dir}")
    result = convert(save_dir, out_dir, workers=2, progress=False)
    print(f"      {result.params} parameters in {len(result.files)} safetensors files + index")
    print("[3/4] the atomic checkpoint (ucp inspect):")
    ckpt = open_checkpoint(out_dir)
    print(describe(ckpt, [ckpt.info(n) for n in ckpt.names]))
    problems = ckpt.verify()
    print(f"      ucp verify: {'OK' if not problems else problems}")
    print("[4/4] resuming it at another layout, ZeRO-3 on 3 CPU ranks, through ucp.deepspeed.initialize")
    torchrun("ucp.cli.demo_train", ["--ucp-load", str(out_dir), "--steps", "3", "--stage", "3",
                                    "--losses-out", str(root / "resumed.json")], nproc=3)
    reference = json.loads((root / "reference.json").read_text())[5:]
    resumed = json.loads((root / "resumed.json").read_text())
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed, reference))
    print(f"      losses after the resume vs the uninterrupted ZeRO-2 run: largest relative difference {worst:.1e}")
    return 1 if problems or worst > 1e-5 else 0
