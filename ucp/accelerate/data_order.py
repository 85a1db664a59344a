"""The order in which an Accelerate-prepared DataLoader yields its samples, kept across a new world size.

Where the order comes from (Accelerate 1.x, `accelerate.data_loader.prepare_data_loader`), for a
map-style dataset:

* `shuffle=False` (`SequentialSampler`): the dataset's order at any world size.
* `DataLoaderConfiguration(use_seedable_sampler=True)`: a `SeedableRandomSampler`, whose order in
  epoch e is `randperm` of a generator seeded with `initial_seed + e` (the seed `set_seed` gave):
  the same at any world size.
* `shuffle=True`, by default: a `RandomSampler`. On several processes, `prepare` gives it a
  `torch.Generator` seeded with one draw from the global torch RNG, taken when the DataLoader is
  prepared; each epoch starts by broadcasting rank 0's state of that generator to every rank
  (`rng_types=["generator"]`), and the epoch's order is its next `randperm`. On one process
  `prepare` gives it none, and `RandomSampler` seeds a fresh generator from the global torch RNG
  each time an epoch starts, at whatever state the RNG is in then.

`accelerator.save_state` keeps neither generator: only each process's global RNG states, as they are
at the save, after the epoch's order was drawn. A stock resume at the same number of processes gets
the saved run's order back only because the script seeds the global RNG alike before `prepare`, so
`prepare` draws the same seed again. At another number of processes that holds as long as both
numbers are above one. From several processes to one, the single process would draw its order at
another point of the RNG stream: this module records the global RNG state each DataLoader is
prepared at (`record_prepare`, installed when `ucp.accelerate` is imported; it draws nothing), and
`keep_order` gives the single process's sampler the generator Accelerate's multi-process `prepare`
would have given it, seeded with the same draw. From one process to several, the saved run's order
came from an RNG state no file holds: `keep_order` refuses, naming the fix, the seedable sampler.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from ucp.errors import ConfigError

logger = logging.getLogger("ucp.accelerate")
SEEDABLE_FIX = ("Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)) when saving "
                "and resuming (same order at any size)")
_RECORD = "_ucp_prepared_order"


@dataclass(frozen=True)
class PreparedOrder:
    """What decided a DataLoader's order when Accelerate prepared it."""

    rng_state: torch.Tensor  # the global torch RNG's state as `prepare_data_loader` began
    own_generator: bool  # the sampler came with a generator of the user's (its order is the user's)


def record_prepare(stock):
    """Accelerate's `prepare_data_loader`, which also records on the prepared DataLoader the global
    RNG state it was prepared at (nothing is drawn: the run's RNG stream is untouched)."""
    @functools.wraps(stock)
    def prepare_data_loader(dataloader, *args, **kwargs):
        record = PreparedOrder(torch.get_rng_state(), getattr(sampler_of(dataloader), "generator", None) is not None)
        prepared = stock(dataloader, *args, **kwargs)
        try:
            setattr(prepared, _RECORD, record)
        except AttributeError:
            pass  # a wrapper that takes no attributes: keep_order treats it as unrecorded
        return prepared

    prepare_data_loader.ucp_recording = True
    return prepare_data_loader


def install() -> None:
    """Record the order of every DataLoader `Accelerator.prepare` prepares from now on."""
    import accelerate.accelerator

    if not getattr(accelerate.accelerator.prepare_data_loader, "ucp_recording", False):
        accelerate.accelerator.prepare_data_loader = record_prepare(accelerate.accelerator.prepare_data_loader)


def keep_order(dataloaders: list, saved: int, world: int) -> None:
    """Give every prepared DataLoader of a run resumed on `world` processes from a save by `saved` the sample
    order the saved run had, or raise `ConfigError` naming the DataLoader's sampler and the fix.

    Called before anything is loaded, so a refusal leaves the run as it was. Samplers that order alike
    at any world size (sequential, seedable, a generator of the user's) need nothing.
    """
    from accelerate.data_loader import SeedableRandomSampler

    if saved == world:
        return
    for i, loader in enumerate(dataloaders):
        sampler = sampler_of(loader)
        name = f"DataLoader {i} ({type(sampler).__name__})"
        if sampler is None or isinstance(sampler, (torch.utils.data.SequentialSampler, SeedableRandomSampler)):
            continue
        if not hasattr(sampler, "generator"):
            logger.warning("%s: ucp cannot tell whether this sampler orders the data alike on %d and %d processes; "
                           "check, or %s", name, saved, world, SEEDABLE_FIX)
            continue
        record = getattr(loader, _RECORD, None)
        if record is None:
            raise ConfigError(f"{name} was prepared before ucp.accelerate was imported, so ucp cannot give it the "
                              f"order it had on {saved} processes: import ucp.accelerate before "
                              f"accelerator.prepare, or {SEEDABLE_FIX}")
        if record.own_generator or (saved > 1 and world > 1):
            continue  # the user's generator, or the one Accelerate seeds at prepare on both sides
        if saved == 1:
            raise ConfigError(
                f"{name}: the 1-process run that saved this state drew its shuffled order from an RNG state "
                f"save_state does not keep, so {world} processes cannot continue it. Fix: {SEEDABLE_FIX}.")
        sampler.generator = _generator_of_prepare(record)


def sampler_of(loader):
    """The sampler that orders `loader`'s samples, under the batch samplers Accelerate wraps around it on several
    processes (`BatchSamplerShard`, which has no `sampler` of its own); None for an iterable dataset."""
    holder = loader.sampler if isinstance(loader.sampler, torch.utils.data.BatchSampler) else loader.batch_sampler
    while holder is not None and not hasattr(holder, "sampler") and hasattr(holder, "batch_sampler"):
        holder = holder.batch_sampler
    return getattr(holder, "sampler", None)


def _generator_of_prepare(record: PreparedOrder) -> torch.Generator:
    """The generator Accelerate's `prepare_data_loader` gives a sampler on several processes, seeded with
    the same draw it takes from the global RNG, here from the recorded state."""
    rng = torch.Generator()
    rng.set_state(record.rng_state)
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=rng).item())
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
