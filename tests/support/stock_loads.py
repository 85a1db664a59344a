"""Judge a universal checkpoint by what stock DeepSpeed makes of it: load it with `load_universal` (one
launch of support/load_universal.py for several loads) and compare the engines' state, tensor for tensor."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoints import SUPPORT_DIR
from .launch import run_torchrun


def stock_loads(model: str, tp: int, nproc: int, loads: dict[str, dict], folder: Path) -> dict[str, dict]:
    """Load every entry of `loads` (name -> {stage, dtype, load_dir, tag, tie|tied}) into its own fresh engine of
    `model` ("tiny" or "llama") at AutoTP `tp` on `nproc` processes, all in one launch; what each engine held."""
    folder.mkdir(parents=True, exist_ok=True)
    runs = [{**options, "load_dir": str(options["load_dir"]), "out": str(folder / f"{name}.pt")}
            for name, options in loads.items()]
    run_torchrun(SUPPORT_DIR / "load_universal.py", ["--model", model, "--tp", str(tp), "--runs", json.dumps(runs)],
                 nproc, folder / "load.log", timeout=900)
    return {name: torch.load(folder / f"{name}.pt", weights_only=False) for name in loads}


def _equal(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def engine_differences(mine: dict, reference: dict) -> list[str]:
    """What differs between two engines' recorded state: per (TP, DP) rank every trainable parameter's fp32
    master and moments (torch.equal, dtype included), the optimizer's steps and hyper-parameters, and the
    engine's global step. Empty when they are the same."""
    def by_rank(dump: dict) -> dict:
        return {(r.get("stage", 0), r["tp_rank"], r["dp_rank"]): r for r in dump["ranks"]}

    out = [] if mine["global_steps"] == reference["global_steps"] else ["global_steps"]
    ours, theirs = by_rank(mine), by_rank(reference)
    if ours.keys() != theirs.keys():
        return out + [f"ranks {sorted(ours)} != {sorted(theirs)}"]
    for rank, want in theirs.items():
        got = ours[rank]
        if got["params"].keys() != want["params"].keys():
            out.append(f"{rank}: parameters {sorted(got['params'])} != {sorted(want['params'])}")
            continue
        for name, states in want["params"].items():
            if got["params"][name].keys() != states.keys():
                out.append(f"{rank} {name}: states {sorted(got['params'][name])} != {sorted(states)}")
            out += [f"{rank} {name} {s}" for s, t in states.items()
                    if s in got["params"][name] and not _equal(got["params"][name][s], t)]
        if len(got["steps"]) != len(want["steps"]) or not all(map(_equal, got["steps"], want["steps"])):
            out.append(f"{rank}: optimizer steps {got['steps']} != {want['steps']}")
        if got["param_groups"] != want["param_groups"]:
            out.append(f"{rank}: param_groups")
    return out

