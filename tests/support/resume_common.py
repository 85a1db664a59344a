"""What resume_pipe.py and resume_moe.py share: their common options, and what they report to their
test, written by rank 0 (every rank's ucp load statistics, ucp.deepspeed.LoadStats, and the losses)."""
import argparse
import json
import os

import torch.distributed as dist


def resume_arguments() -> argparse.ArgumentParser:
    """The options of every resume script: what to train, when to save, what to load, where to report."""
    p = argparse.ArgumentParser()
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--start-step", type=int, default=0)
    p.add_argument("--save-at", type=int, default=None)
    p.add_argument("--save-dir", default=None)
    p.add_argument("--ucp-load", default=None)
    p.add_argument("--ucp-stats-out", default=None, help="rank 0 writes every rank's ucp load statistics (JSON)")
    p.add_argument("--losses-out", required=True)
    p.add_argument("--ucp-memory", default=None, help="with --ucp-save, also save into the host-memory tier every "
                   "--save-at steps, 2 simulated nodes (BASE/node0, BASE/node1), each with a peer copy of the other")
    return p


def memory_tier(base: str, every: int) -> dict:
    """The `"memory"` section of `"ucp": {"save": ...}` for 2 simulated nodes: the first half of the ranks
    make node 0 (memory folder `base`/node0), the rest node 1."""
    node = dist.get_rank() // max(1, dist.get_world_size() // 2)
    os.environ["UCP_TEST_NODE"] = os.path.join(base, f"node{node}")
    return {"every": every, "replicas": 1, "dir": "$UCP_TEST_NODE"}


def write_stats(engine, path: str) -> None:
    """Rank 0 writes a JSON list, by rank, of each rank's `engine.ucp_load_stats` less its client state."""
    stats = [None] * dist.get_world_size()
    dist.all_gather_object(stats, {k: v for k, v in vars(engine.ucp_load_stats).items() if k != "client_state"})
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(stats, f)


def write_losses_and_close(engine, losses: list[float], path: str) -> None:
    """Rank 0 writes `losses` (JSON) to `path`; then every rank waits for the others and frees the engine and groups."""
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(losses, f)
    dist.barrier()
    engine.destroy()
    dist.destroy_process_group()
