"""The abort at interpreter exit, made certain: a gloo worker thread needs the GIL after `main` returned.

Rank 1 posts its half of an all-reduce only after rank 0's script has returned; rank 0 registered a
Python callback on it, which gloo's worker thread runs once the collective completes: while the
interpreter finalizes (it waits on the pending work), so CPython ends that thread and the process
aborts ("terminate called without an active exception"). With `--finish` the script ends with
`ucp.deepspeed.finish()`, which must exit 0 on both ranks.
"""
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(1.0)
future = dist.all_reduce(torch.ones(1000), async_op=True).get_future()
future.then(lambda done: done.value())
if "--finish" in sys.argv:
    import ucp.deepspeed

    ucp.deepspeed.finish()
