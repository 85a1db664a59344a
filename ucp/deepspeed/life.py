"""One owner of a DeepSpeed engine's checkpoint life (in the spirit of torchtitan's `CheckpointManager`).

    ucp.deepspeed.save(engine, "/ckpt/ucp")   # writes /ckpt/ucp/global_step<N>; returns at once
    ucp.deepspeed.wait(engine)                # the save is durable and committed once this returns

`CheckpointLife` holds everything of an engine's checkpoints that outlives one call: the saver with the save in
flight (`ucp.deepspeed.saving.saver.Saver`), the `"save"` section with the cadence of the disk and memory tiers
(`ucp.deepspeed.saving.cadence`), retention (`"keep"`: the saver runs `ucp.elastic.retention.retain` after each
commit), the step bookkeeping of elastic training and the restart report (`StepBook`), and what runs before
each step (the HMP gradient sync, `ucp.deepspeed.engine.hmp_sync`). It wraps the engine's step once, when
`ucp.deepspeed.initialize` gives it something to do at each step: `engine.step`, or `train_batch` on a pipeline
engine (whose `step` refuses to be called). The engine carries it as one attribute, `engine._ucp_life`.

The saver, with its memory tier, is made on first use: the first save, or the first step of an engine that saves
by a cadence (collectively: every rank steps, and every rank saves). `initialize` only hands the life the
section, so a restart enters the life once, after the load, and each save module once, at the first step
(docs/ARCHITECTURE.md, "One restart of an elastic job"). What the saver cannot save is refused at the start all
the same (`saving.layout.refuse_unsupported`).

What users read and set stays on the engine: `engine.ucp_client_state` (client state of the periodic saves),
`engine.ucp_save_dir` (where they go), `engine.ucp_restart` (the restart report), `engine.ucp_load_stats`.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from ucp import collectives
from ucp.deepspeed.auto_resume import Resumed
from ucp.deepspeed.config import SaveOptions
from ucp.deepspeed.memory.tier import MemoryTier
from ucp.deepspeed.saving.cadence import disk_due, memory_due
from ucp.deepspeed.saving.layout import refuse_unsupported
from ucp.deepspeed.saving.saver import Saver, SaveStats
from ucp.elastic.restart import Progress, ProgressRecorder, RestartReport, read_progress
from ucp.elastic.retention import retain
from ucp.format.save_folder import check_save_folder
from ucp.storage.locations import Location, location

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from ucp.elastic.inprocess import Restart

restart_log = logging.getLogger("ucp.elastic")


class CheckpointLife:
    """An engine's checkpoint life (module docstring): what it saves when, what it keeps, what each step records."""

    def __init__(self, engine: DeepSpeedEngine):
        self.engine = engine
        self.save_options: SaveOptions | None = None
        self.start_step = engine.global_steps  # when handed the section: the step loaded (0 fresh), not saved again
        self.book: StepBook | None = None
        self.before_step: Callable[[], None] | None = None
        self.samples_per_step: int | None = None
        self._due: tuple[int, bool, bool] | None = None  # what the optimizer step under way saves (`_due_at`)
        self._saver: Saver | None = None
        self._wrapped = False

    @property
    def saver(self) -> Saver:
        """The engine's saver, created on first use (collectively: every rank must reach this together)."""
        if self._saver is None:
            self._saver = self._new_saver()
        return self._saver

    @property
    def saver_if_any(self) -> Saver | None:
        return self._saver

    def _new_saver(self) -> Saver:
        """A saver with what the `"save"` section asks of it: the memory tier, retention after each commit."""
        saver = Saver(self.engine)
        save = self.save_options
        if save is not None:
            if save.memory is not None:
                saver.memory = MemoryTier(saver, save.memory, self.start_step)
            if save.keep is not None:
                saver.after_commit = partial(retain, keep=save.keep)
            saver.last_step = self.start_step
        return saver

    # -- what initialize hands over

    def save_every(self, save: SaveOptions) -> None:
        """Save by `save`'s cadence after each optimizer step (and into the memory tier, when it has one)."""
        refuse_unsupported(self.engine)  # before training: what the saver (made at the first step) cannot save
        check_save_folder(save.dir, self.engine.global_steps, say=collectives.rank() == 0)  # ucp.format.save_folder
        self.save_options = save
        self.start_step = self.engine.global_steps
        self.engine.ucp_save_dir = save.dir
        self._wrap()

    def keep_book(self, book: StepBook) -> None:
        """Run `book` after each optimizer step (elastic batches, progress and the restart report)."""
        self.book = book
        self._wrap()

    def count_samples(self, per_step: int) -> None:
        """Count `per_step` samples (the global batch B) in `engine.global_samples` per optimizer step, where
        DeepSpeed adds its nominal train_batch_size: an elastic world size's uneven shares, or one HMP replica's
        share. The sampler continues from this count after a resume at any layout."""
        self.samples_per_step = per_step
        self._wrap()

    def run_before_step(self, action: Callable[[], None]) -> None:
        """Run `action` before each optimizer step (the HMP gradient sync)."""
        self.before_step = action
        self._wrap()

    # -- each step

    def _wrap(self) -> None:
        """Wrap the engine's step, once."""
        if self._wrapped:
            return
        engine = self.engine
        # A pipeline engine steps inside train_batch (its `step` refuses to be called).
        method = "train_batch" if getattr(engine, "pipeline_parallelism", False) else "step"
        step: Callable[..., Any] = getattr(engine, method)

        def step_and_after(*args: Any, **kwargs: Any) -> Any:
            return self._step(method, step, *args, **kwargs)

        setattr(engine, method, step_and_after)
        self._wrapped = True

    def _step(self, method: str, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Before an optimizer step's first micro-step, what the step will save (the cadence); each micro-step, the
        next save's layout prepared off the training thread; after the optimizer step, its saves, then the book.
        In this order a step enters each module once (docs/ARCHITECTURE.md, "One restart of an elastic job")."""
        engine, save = self.engine, self.save_options
        if self.before_step is not None:
            self.before_step()
        steps, samples = engine.global_steps, engine.global_samples
        if save is not None and (self._due is None or self._due[0] != steps + 1):
            self._due = self._due_at(save, steps + 1)
        result = step(*args, **kwargs)
        if engine.global_steps == steps:  # a micro-step
            if save is not None:
                self.saver.prepare_ahead()
            return result
        stepped = time.time()
        if self.samples_per_step is not None:
            engine.global_samples = samples + self.samples_per_step
        if save is not None:
            due, self._due = self._due, None
            if due is None or due[0] != engine.global_steps:  # the step count moved by other than one
                due = self._due_at(save, engine.global_steps)
            self._save(save, *due[1:])
        if self.book is not None:
            self.book.after_step(stepped)
        return result

    def _due_at(self, save: SaveOptions, steps: int) -> tuple[int, bool, bool]:
        """(`steps`, whether the step that makes `steps` saves into the memory tier, to disk)."""
        saver = self._saver  # read, not made: the saver is made after the cadence, at the first micro-step
        memory = saver.memory if saver is not None else None
        return (steps, memory_due(save, steps, memory.last_step if memory is not None else self.start_step),
                disk_due(save, steps, saver.last_step if saver is not None else self.start_step))

    def _save(self, save: SaveOptions, to_memory: bool, to_disk: bool) -> None:
        saver = self.saver
        saver.prepare_ahead()  # the first save's layout and buffer, off the training thread
        client_state = getattr(self.engine, "ucp_client_state", None)
        if to_memory:
            saver.save_memory(client_state)
        if to_disk:
            saver.save(save.dir, None, client_state, True)


class StepBook:
    """Bookkeeping after each optimizer step: records the job's progress, and after the first step of a restarted
    job logs what the restart cost (`ucp.elastic.restart`) and sets `engine.ucp_restart`. The progress a previous
    run recorded is read at that first step, just before this run's record replaces it."""

    def __init__(self, engine: DeepSpeedEngine, progress_dir: Location | None, resumed: Resumed | None,
                 called: float, restart: Restart | None = None):
        self.engine = engine
        self.restart = restart  # the in-process restart (ucp.elastic.run) this start continues, if any
        self.progress_dir = progress_dir if collectives.rank() == 0 else None
        self.progress: ProgressRecorder | None = None  # from the first step on
        self.resumed = resumed
        self.called = called  # time.time() when ucp.deepspeed.initialize was called
        self.loaded_at = time.time()

    def after_step(self, now: float) -> None:
        """After the optimizer step that ended at `now` (time.time())."""
        engine = self.engine
        if self.progress_dir is None:
            return
        before = None
        if self.progress is None:  # the first step: the previous run's record, before this run's replaces it
            before = read_progress(self.progress_dir)
            self.progress = ProgressRecorder(self.progress_dir)
        self.progress.record(Progress(engine.global_steps, now, collectives.world_size()))
        if before is not None:
            report = self._report(before, now)
            engine.ucp_restart = report
            restart_log.warning("%s", report.line())

    def _report(self, before: Progress, now: float) -> RestartReport:
        resumed = self.resumed or Resumed(None, 0, 0.0)
        place = getattr(self.engine, "ucp_layout", None)  # an elastic job's layout (`ucp.elastic.RankLayout`)
        load_began = self.loaded_at - resumed.load_s
        same_process = self.restart   # ucp.elastic.run regrouped this process
        if same_process is not None:
            return RestartReport(
                old_world=before.world, new_world=collectives.world_size(),
                checkpoint=str(resumed.path) if resumed.path else None, checkpoint_step=resumed.step,
                steps_redone=max(0, before.step - resumed.step),
                detection_s=max(0.0, same_process.fault_seen - before.time),
                regroup_s=same_process.regrouped - same_process.fault_seen,
                startup_s=load_began - same_process.regrouped, load_s=resumed.load_s, first_step_s=now - self.loaded_at,
                layout=place.described if place is not None else None)
        started = min(max(self.called, before.time), load_began)
        return RestartReport(
            old_world=before.world, new_world=collectives.world_size(),
            checkpoint=str(resumed.path) if resumed.path else None, checkpoint_step=resumed.step,
            steps_redone=max(0, before.step - resumed.step), detection_s=started - before.time,
            startup_s=load_began - started, load_s=resumed.load_s, first_step_s=now - self.loaded_at,
            layout=place.described if place is not None else None)


def life_of(engine: DeepSpeedEngine) -> CheckpointLife:
    """The engine's checkpoint life, created on first use."""
    life = getattr(engine, "_ucp_life", None)
    if life is None:
        life = CheckpointLife(engine)
        engine._ucp_life = life
    return life


def saver_for(engine: DeepSpeedEngine) -> Saver:
    """The engine's saver, created on first use (collectively: every rank must reach this together)."""
    return life_of(engine).saver


def save(engine: DeepSpeedEngine, path: str | os.PathLike[str], tag: str | None = None, async_: bool = True, *,
         client_state: dict[str, Any] | None = None) -> SaveStats:
    """Save `engine` into `<path>/<tag>` (default tag `global_step<N>`), then point `<path>/latest` at it.

    Call on every rank. Returns once this rank's state is snapshotted (with `async_=False`, once
    the checkpoint is committed). A save still writing when the next one starts is waited for,
    with a warning in the log. A failed save raises `SaveError` from the next `save` or `wait`.
    """
    place = location(path)  # a URL no storage takes is refused before the engine is touched
    return saver_for(engine).save(place, tag, client_state, async_)


def wait(engine: DeepSpeedEngine) -> SaveStats | None:
    """Block until the engine's save in flight is committed; its stats (None if it never saved).

    Raises `SaveError` if it failed. Runs for every engine at interpreter exit too; call it before
    `torch.distributed.destroy_process_group()`, which would cut the writer's collectives.
    """
    life = getattr(engine, "_ucp_life", None)
    saver = life.saver_if_any if life is not None else None
    return saver.wait() if saver is not None else None
