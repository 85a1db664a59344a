"""The engine's side of elastic training: DeepSpeed's batch keys for this world size and layout.

`ucp.deepspeed.initialize` calls these for the `"elastic"` section (see `ucp.elastic` for the parts that know no
engine):

* `with_batch_keys` sets DeepSpeed's three batch keys from `"elastic"` for this start's data-parallel degree
  (DeepSpeed refuses a train_batch_size that is not micro x accumulation x DP), and `with_layout_keys`
  AutoTP's size for its tensor-parallel degree (the layout: `ucp.elastic.layout_choice`).
* `check_engine` checks that the engine DeepSpeed built runs the data-parallel degree the batch was shared for.

`"load": "auto"` is `ucp.deepspeed.auto_resume`; the step bookkeeping (`global_samples` at B per step, progress and
the restart report) is the engine's checkpoint life, `ucp.deepspeed.life`.
"""
from __future__ import annotations

import logging

import torch.distributed as dist

from ucp.elastic.layout_choice import RankLayout
from ucp.elastic.shares import BATCH_KEYS, ElasticBatch
from ucp.errors import ConfigError, UnsupportedLayoutError

logger = logging.getLogger("ucp.elastic")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def with_batch_keys(config: dict, batch: ElasticBatch) -> dict:
    """`config` with DeepSpeed's batch keys for `batch`; keys the config gave otherwise are replaced, and said."""
    keys = batch.deepspeed_keys()
    replaced = {k: config[k] for k in BATCH_KEYS if k in config and config[k] not in (keys[k], "auto")}
    if replaced and _rank() == 0:
        logger.warning("ucp: \"elastic\" sets DeepSpeed's batch keys for %d ranks: %s (the config said %s)",
                       batch.world, keys, replaced)
    return {**config, **keys}


def uses_autotp(initialize_kwargs: dict) -> bool:
    """Whether `deepspeed.initialize` with these arguments splits the model by AutoTP: no Megatron-style `mpu` and
    no `PipelineModule` (those carry their own tensor-parallel layout, which the script builds from `layout()`)."""
    from deepspeed.pipe import PipelineModule

    return initialize_kwargs.get("mpu") is None and not isinstance(initialize_kwargs.get("model"), PipelineModule)


def with_layout_keys(config: dict, place: RankLayout, autotp: bool) -> dict:
    """`config` with AutoTP's `"tensor_parallel": {"autotp_size": T}` for this start's layout (none at T = 1), where
    `autotp`; a size the config gave otherwise is replaced, and said. Comes after `with_batch_keys`."""
    if not autotp:
        return config
    given = config.get("tensor_parallel")
    out = {k: v for k, v in config.items() if k != "tensor_parallel"}
    if place.tp > 1:
        out["tensor_parallel"] = {**(given if isinstance(given, dict) else {}), "autotp_size": place.tp}
        # DeepSpeed checks train_batch_size against the whole world before AutoTP divides it by T: leave it out
        # (the engine derives it; the checkpoint life keeps global_samples at B per step whatever it is).
        out.pop("train_batch_size", None)
    if isinstance(given, dict) and given.get("autotp_size", 1) not in (1, place.tp) and _rank() == 0:
        logger.warning('ucp: "elastic" sets AutoTP\'s autotp_size to %d for this layout (the config said %s)',
                       place.tp, given["autotp_size"])
    return out


def check_engine(engine, batch: ElasticBatch) -> None:
    """The engine runs the data-parallel degree the batch was shared for."""
    if engine.dp_world_size != batch.world:
        raise ConfigError(f'"ucp": {{"elastic": ...}}: the engine runs {engine.dp_world_size} data-parallel ranks, '
                          f"but the layout ucp chose has {batch.world}; call ucp.elastic.init_distributed() (or "
                          "deepspeed.init_distributed()) before ucp.deepspeed.initialize, and build the model for "
                          "ucp.elastic.layout()")
    problem = batch.pipeline_problem() if getattr(engine, "pipeline_parallelism", False) else None
    if problem is not None:
        raise UnsupportedLayoutError(problem)
