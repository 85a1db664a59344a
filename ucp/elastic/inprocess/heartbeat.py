"""The heartbeat of one world of `ucp.elastic.run`: a rank that hangs (SIGSTOP, a stuck kernel) is seen within
`detect_s`, and every rank learns of a fault that any rank saw.

Each rank's thread adds one to its own counter in the job's store every `period` seconds, watches the counter of
the next rank (a ring: one read per beat, whatever the world size) and the world's fault key. A neighbour whose
counter has not moved for `detect_s` seconds is declared hung: the thread writes the fault key. Whoever sees the
fault key set (the thread, or the training thread after a failed collective, `declare`) cuts this process's
connections to its peers (`connections`), so that a training thread blocked in a collective with the
hung rank, or with a peer that already left, gets an error instead of waiting for the group's timeout. The beats
go on through the regroup: the survivors tell a peer that is still leaving from one that is gone by them.

The thread only needs the GIL for a moment per beat, so a training thread busy in a long operator or a large
save does not stop the beat; a rank that finished (`done`) is not declared hung.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

logger = logging.getLogger("ucp.elastic")

FAULT = "fault"


def beat_key(rank: int) -> str:
    return f"beat/{rank}"


def done_key(rank: int) -> str:
    return f"done/{rank}"


class Heartbeat:
    """The beat of rank `rank` of a world of `world` ranks in `store` (a store of this world's keys alone)."""

    def __init__(self, store: dist.Store, rank: int, world: int, detect_s: float, on_fault: Callable[[str], None]):
        self.store, self.rank, self.world = store, rank, world
        self.detect_s = detect_s
        self.on_fault = on_fault
        self.fault: str | None = None   # why the world is broken, once known here
        self.second_fault: str | None = None   # a member of the regroup gone silent (`watch`)
        self._members: list[int] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ucp-heartbeat", daemon=True)

    @property
    def period(self) -> float:
        return period_of(self.detect_s)

    def start(self) -> None:
        self.store.add(beat_key(self.rank), 1)
        self._thread.start()

    def stop(self, finished: bool = False) -> None:
        """Stop beating (`finished`: this rank's training returned; it is not to be taken for hung)."""
        if finished:
            try:
                self.store.set(done_key(self.rank), "1")
            except (RuntimeError, dist.DistError):
                pass   # the job's store is gone: nobody is left to watch this rank
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period + 5)

    def declare(self, reason: str) -> str:
        """The world is broken for `reason` (the first reason any rank wrote wins); cut this rank's connections.
        Returns the reason that won."""
        try:
            won = self.store.compare_set(FAULT, "", reason).decode()
        except (RuntimeError, dist.DistError):
            won = reason
        self._act(won or reason)
        return won or reason

    def watch(self, members: list[int]) -> None:
        """During the regroup: take a silence of any of `members` (ranks of this world) for a second fault."""
        self._members = list(members)

    def _act(self, reason: str) -> None:
        with self._lock:
            if self.fault is not None:
                return
            self.fault = reason
        self.on_fault(reason)

    def _run(self) -> None:
        neighbour = (self.rank + 1) % self.world
        last, moved = -1, time.monotonic()
        members: dict[int, tuple[int, float]] = {}
        tick = time.monotonic()
        while not self._stop.wait(self.period):
            if time.monotonic() - tick > 2 * self.period + 1:
                # This watcher was itself stopped or starved (a SIGSTOP of every worker, a swapping host): what
                # it saw before says nothing of the peers now; they get a fresh detect_s.
                last, members = -1, {}
            tick = time.monotonic()
            try:
                self.store.add(beat_key(self.rank), 1)
                if self.fault is None and self.store.check([FAULT]):
                    self._act(self.store.get(FAULT).decode())
                if self.fault is not None:
                    self._watch_members(members)
                    continue
                if self.world == 1 or self.fault is not None:
                    continue
                count = self.store.add(beat_key(neighbour), 0)
                now = time.monotonic()
                if count != last:
                    last, moved = count, now
                elif now - moved > self.detect_s and not self.store.check([done_key(neighbour)]):
                    self.declare(f"rank {neighbour} sent no heartbeat for {now - moved:.0f} s (detect_s "
                                 f"{self.detect_s:g})")
            except (RuntimeError, dist.DistError) as exc:   # the job's store went away: nothing left to watch
                logger.warning("ucp: heartbeat of rank %d stopped: the job's store does not answer (%s)", self.rank,
                               exc)
                return


    def _watch_members(self, seen: dict[int, tuple[int, float]]) -> None:
        """A member of the regroup silent for `detect_s`: a second fault; cut the connections again (a group
        being made with it would wait for it)."""
        now = time.monotonic()
        for r in self._members:
            count = self.store.add(beat_key(r), 0)
            if r not in seen or seen[r][0] != count:
                seen[r] = (count, now)
            elif now - seen[r][1] > self.detect_s and self.second_fault is None:
                self.second_fault = (f"a second fault during the regroup: rank {r} of the old world sent no "
                                     f"heartbeat for {now - seen[r][1]:.0f} s")
                self.on_fault(self.second_fault)


def period_of(detect_s: float) -> float:
    """How often a rank beats: five beats per `detect_s`, at most one a second."""
    return min(1.0, detect_s / 5)
