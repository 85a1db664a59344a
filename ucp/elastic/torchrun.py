"""`ucp-torchrun` (`python -m ucp.elastic.torchrun`): torchrun, with the settings elastic jobs need.

It takes torchrun's own arguments and runs torchrun in this process, with these set first:
* `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, so that each rendezvous round publishes the address of a store of its
  own. Under torchrun's default, the agents share one store with their workers across rounds, and torch 2.13's
  agents then cannot admit a node that joins later (the new agent waits for a MASTER_ADDR that the rank-0
  agent published only in the first round, and the round times out), nor lose the node hosting that store (the
  others keep its address). `ucp.elastic.init_distributed` makes the workers safe under the shared store when a
  node is lost; only the agents' environment makes joins work, hence this launcher.
* `UCP_ELASTIC_STORE` (HOST:PORT) and `UCP_ELASTIC_RUN` from `--rdzv-endpoint` and `--rdzv-id` of a c10d
  rendezvous: the store where the survivors of a fault meet under `ucp.elastic.run`, which outlives any one
  worker (it lives with the rendezvous).
"""
from __future__ import annotations

import os
import sys

SETTING = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
C10D_DEFAULT_PORT = 29400   # torchrun's, for an endpoint without a port


def main() -> None:
    os.environ[SETTING] = "1"
    os.environ.update(job_store_env(sys.argv[1:]))
    from torch.distributed.run import main as torchrun

    torchrun()


def job_store_env(argv: list[str]) -> dict[str, str]:
    """`UCP_ELASTIC_STORE` and `UCP_ELASTIC_RUN` of torchrun arguments with a c10d rendezvous endpoint; {} else."""
    values: dict[str, str] = {}
    names = {"rdzv-endpoint", "rdzv-id", "rdzv-backend"}
    i = 0
    while i < len(argv):   # torchrun's options come first: the first of each name is torchrun's
        name, eq, value = argv[i].lstrip("-").replace("_", "-").partition("=")
        if argv[i].startswith("--") and name in names and name not in values:
            if not eq and i + 1 < len(argv):
                value = argv[i + 1]
                i += 1
            values[name] = value
        i += 1
    endpoint = values.get("rdzv-endpoint", "")
    if values.get("rdzv-backend") != "c10d" or not endpoint or not values.get("rdzv-id"):
        return {}
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", str(C10D_DEFAULT_PORT))
    return {"UCP_ELASTIC_STORE": f"{host}:{port}", "UCP_ELASTIC_RUN": values["rdzv-id"]}


if __name__ == "__main__":
    main()
