"""Elastic training: the same run at whatever world size is left, resumed unattended.

* `ElasticBatch` (`shares`): a fixed global batch shared by any number of ranks, uneven where it must be;
  `speed_shares` cuts it by replica speed (heterogeneous model parallelism).
* `ElasticBatchSampler` (`sampler`): one global sample order, continued from the checkpoint at any world size.
* `candidates` (`resume`): which checkpoints `"load": "auto"` tries; `prune` (`retention`): what `"keep"` removes.
* `layout` / `spare_loop` (`ranks`): the tensor x pipeline x data-parallel layout of this start, chosen by
  `layout_choice`, and where this rank sits in it; ranks beyond it wait as spares.
* `init_distributed` (`rendezvous`): the process group, with a store of its own at each torchrun restart.
* `run` (`inprocess`): the process group and the user's training function, called again in the same process by
  the survivors of a fault (`heartbeat` detects a hung rank, `connections` unblocks a survivor's collective).
* `RestartReport` (`restart`): what a restart cost, from the last step before the fault to the first after it.

The DeepSpeed side (`ucp.deepspeed.initialize` with `"ucp": {"elastic": ..., "load": "auto", "save": {...}}`)
uses these; the launcher adapters sit above it: torchrun's elastic agent needs none (a script restarts as it
is), Ray Train's is `ucp.elastic.ray_train`.
"""
from ucp.elastic.inprocess import run
from ucp.elastic.layout_choice import RankLayout
from ucp.elastic.ranks import layout, spare_loop
from ucp.elastic.rendezvous import init_distributed
from ucp.elastic.restart import RestartReport
from ucp.elastic.sampler import ElasticBatchSampler
from ucp.elastic.shares import ElasticBatch, speed_shares

__all__ = ["ElasticBatch", "ElasticBatchSampler", "RankLayout", "RestartReport", "init_distributed", "layout",
           "run", "spare_loop", "speed_shares"]
