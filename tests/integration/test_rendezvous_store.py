"""`ucp.elastic.init_distributed` under torchrun's shared agent store: a restarted round meets in a store of its
own, where torch's env:// init reads the address a dead worker of the last round left and fails to connect.

The test plays torchrun's agent: it hosts the shared TCP store and starts each round's workers with the
environment the agent gives them (TORCHELASTIC_USE_AGENT_STORE=True, MASTER_ADDR/PORT of that store). Rounds
end as a lost node ends them: the workers are killed while alive, so their keys stay in the store. Rank 0 of
each round starts only once rank 1 is joining, so rank 1 reads whatever the store holds before rank 0 of the same
round can overwrite it: deterministic, where a real restart hits the same race by chance.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from support.processes import wait_for

WORKER = Path(__file__).resolve().parents[1] / "support" / "rendezvous_worker.py"
LAG_S = 8   # rank 0 of a round starts this long after rank 1 began to join: by then rank 1 has read the store
# A round that meets needs ~5 s here (two interpreters importing torch on 2 cores, with the lag); one that
# hangs would wait for gloo's 30-minute timeout. 60 s separates the two with room for a loaded machine.
ROUND_LIMIT_S = 60
# Whether gloo connects to the stale address depends on how the ports of the two ranks sort (the side whose
# address sorts higher connects), so a round of torch's own init over stale keys still meets now and then (about
# 2 in 5 here). The negative control loses such rounds until one does not meet: 10 all meeting is ~1e-4.
CONTROL_ROUNDS = 10
CONTROL_LIMIT_S = 20


class Agent:
    """The agents' shared store and the workers of its rounds, 2 ranks each."""

    def __init__(self, workdir: Path):
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        self.workdir, self.rounds = workdir, 0

    def start_round(self, mode: str, stay: bool) -> list[tuple[subprocess.Popen, Path]]:
        """Start rank 1, then rank 0 LAG_S after rank 1 began to join; each worker with its log."""
        self.rounds += 1
        workers = []
        for rank in (1, 0):
            log = self.workdir / f"round{self.rounds}-rank{rank}.log"
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port), RANK=str(rank),
                       LOCAL_RANK=str(rank), WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True",
                       TORCHELASTIC_RESTART_COUNT=str(self.rounds - 1), TORCHELASTIC_MAX_RESTARTS="3")
            with open(log, "w") as out:
                cmd = [sys.executable, str(WORKER), mode, *(["--stay"] if stay else [])]
                workers.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env), log))
            if rank == 1:
                wait_for(lambda: "joining" in log.read_text(), ROUND_LIMIT_S, "rank 1 to start")
                time.sleep(LAG_S)
        return workers


def met(workers) -> bool:
    return all("sum 3" in log.read_text() for _, log in workers)


def met_within(workers, limit_s: float) -> bool:
    try:
        return wait_for(lambda: met(workers), limit_s, "a round to meet")
    except TimeoutError:
        return False


def lose(workers) -> None:
    for proc, _ in workers:
        proc.kill()
        proc.wait()


def finish(workers, limit_s: float = ROUND_LIMIT_S) -> list[int | None]:
    """Exit codes within `limit_s`, None for a worker still waiting then (killed)."""
    deadline = time.monotonic() + limit_s
    codes = []
    for proc, _ in workers:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes.append(None)
    return codes


@pytest.fixture
def agent(tmp_path) -> Agent:
    return Agent(tmp_path)


def test_restarted_rounds_meet_in_a_store_of_their_own(agent):
    # A round of torch's own init leaves gloo's keys of both ranks in the shared store when its node is lost.
    stale = agent.start_round("plain", stay=True)
    wait_for(lambda: met(stale), ROUND_LIMIT_S, "the first round's all-reduce")
    lose(stale)
    # ucp's init meets anyway, and is lost in turn: its announcement now names a store that died with it.
    first = agent.start_round("ucp", stay=True)
    wait_for(lambda: met(first), ROUND_LIMIT_S, "ucp's round despite gloo's stale keys")
    lose(first)
    second = agent.start_round("ucp", stay=False)
    assert finish(second) == [0, 0] and met(second), [log.read_text()[-2000:] for _, log in second]
    # Negative control: torch's own init in the same situation takes a dead worker's address from the store and
    # does not meet (it fails in gloo's connectFullMesh, or waits in connect for gloo's 30-minute timeout).
    for _ in range(CONTROL_ROUNDS):
        control = agent.start_round("plain", stay=True)
        meets = met_within(control, CONTROL_LIMIT_S)
        lose(control)
        if not meets:
            break
    else:
        pytest.fail(f"torch's own init met in all {CONTROL_ROUNDS} rounds over a dead round's keys")


def test_the_shared_store_is_warned_about_and_under_ucps_init_only_for_the_agents(agent):
    plain = agent.start_round("plain", stay=False)   # a first round: nothing stale, it meets
    assert finish(plain) == [0, 0]
    rank0 = plain[1][1].read_text()
    assert "hang in gloo's connect" in rank0 and "launch with ucp-torchrun" in rank0
    own = agent.start_round("ucp", stay=False)
    assert finish(own) == [0, 0]
    rank0 = own[1][1].read_text()
    assert "hang in gloo's connect" not in rank0 and "launch with ucp-torchrun" in rank0
