"""`ucp-torchrun` (`python -m ucp.elastic.torchrun`): torchrun, with the setting elastic jobs need.

It takes torchrun's own arguments and runs torchrun in this process, with one thing set first:
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, so that each rendezvous round publishes the address of a store of its
own. Under torchrun's default, the agents share one store with their workers across rounds, and torch 2.13's
agents then cannot admit a node that joins later (the new agent waits for a MASTER_ADDR that the rank-0
agent published only in the first round, and the round times out), nor lose the node hosting that store (the
others keep its address). `ucp.elastic.init_distributed` makes the workers safe under the shared store when a
node is lost; only the agents' environment makes joins work, hence this launcher.
"""
from __future__ import annotations

import os

SETTING = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def main() -> None:
    os.environ[SETTING] = "1"
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
