"""A torchrun-style worker for tests/integration/test_rendezvous_store.py: joins the process group under the
agent-store environment the test sets, all-reduces its rank + 1 and prints the sum; then waits to be killed
(`--stay`) or leaves.

    python rendezvous_worker.py ucp|plain [--stay]
"""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import ucp.elastic
from ucp.elastic.rendezvous import warn_shared_rendezvous_store


def main() -> None:
    print("joining", flush=True)
    if sys.argv[1] == "ucp":
        ucp.elastic.init_distributed("gloo")
    else:
        dist.init_process_group("gloo")   # torch's env:// init: the agents' shared store as it is
    warn_shared_rendezvous_store()
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} sum {total.item():g}", flush=True)
    if "--stay" in sys.argv:
        time.sleep(600)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
