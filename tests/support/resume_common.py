"""What a resume run reports to its test, written by rank 0: every rank's ucp load statistics
(ucp.deepspeed.LoadStats), and the run's losses."""
import json

import torch.distributed as dist


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
