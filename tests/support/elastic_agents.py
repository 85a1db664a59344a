"""torchrun elastic agents on this machine, each a "node" of `nproc` workers, for fault tests (loopback only).

Every agent runs `ucp-torchrun --nnodes=MIN:MAX --nproc-per-node=NPROC --rdzv-backend=c10d` against one rendezvous
on 127.0.0.1, whose store this process hosts (as a job's launcher or a head node would), so that any agent can
be taken away. A node lost is its agent and every process under it killed with SIGKILL; a worker lost is one
worker process.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from support.launch import ds_env, free_port
from support.processes import kill_tree, wait_for


class ElasticJob:
    def __init__(self, script: Path, args: list[str], workdir: Path, nodes: str = "1:4", max_restarts: int = 10,
                 nproc: int = 1):
        self.script, self.args, self.workdir = script, [str(a) for a in args], workdir
        self.nodes, self.max_restarts, self.nproc = nodes, max_restarts, nproc
        from torch.distributed import TCPStore

        self.port = free_port()
        self.store = TCPStore("127.0.0.1", self.port, is_master=True, multi_tenant=True, wait_for_workers=False)
        self.agents: list[subprocess.Popen] = []
        workdir.mkdir(parents=True, exist_ok=True)

    def start_agent(self, env: dict[str, str] | None = None) -> int:
        """Start one more agent (with `env` added to its environment); its index."""
        index = len(self.agents)
        cmd = [sys.executable, "-m", "ucp.elastic.torchrun", f"--nnodes={self.nodes}",
               f"--nproc-per-node={self.nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}",
               "--rdzv-id=ucp-test",
               "--rdzv-conf=is_host=false,last_call_timeout=2,join_timeout=300,keep_alive_interval=1,"
               "keep_alive_max_attempt=3", f"--max-restarts={self.max_restarts}",
               "--monitor-interval=0.5", str(self.script), *self.args]
        log = open(self.workdir / f"agent{index}.log", "w")
        # The README's recipe: ucp-torchrun (torchrun with a store of each round's own), no variable to set.
        env = ds_env({"LOGLEVEL": "INFO", **(env or {})})
        self.agents.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        log.close()
        return index

    def workers(self, index: int) -> list[psutil.Process]:
        try:
            return psutil.Process(self.agents[index].pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def lose_node(self, index: int) -> None:
        """The node is gone: its agent and every process under it, SIGKILL."""
        kill_tree(self.agents[index].pid)
        self.agents[index].wait()

    def pause(self) -> list[psutil.Process]:
        """Stop (SIGSTOP) every running worker, so that nothing moves while a test changes the scene; the workers."""
        return _suspend([p for i, a in enumerate(self.agents) if a.poll() is None for p in self.workers(i)])

    @staticmethod
    def resume(workers: list[psutil.Process]) -> None:
        for p in workers:
            try:
                p.resume()
            except psutil.NoSuchProcess:
                pass

    def lose_worker(self, index: int) -> None:
        """One worker process dies (SIGKILL); its agent lives on."""
        workers = wait_for(lambda: [p for p in self.workers(index) if "train" in cmdline(p)], 120,
                           f"agent {index}'s worker")
        workers[0].kill()

    def join_while_paused(self, env: dict[str, str] | None = None) -> int:
        """Start one more agent (with `env` added to its environment) while every worker is stopped (SIGSTOP), so
        that the job cannot finish before the new agent is waiting in the rendezvous; the running agents then
        restart their workers with it."""
        running = [i for i, a in enumerate(self.agents) if a.poll() is None]
        seen = {i: self._detections([i]) for i in running}
        workers = _suspend([p for i in running for p in self.workers(i)])
        try:
            index = self.start_agent(env)
            # Every agent, not one: a worker resumed under an agent that has not seen the new node yet trains on,
            # and can finish the run before that agent restarts it.
            wait_for(lambda: all(self._detections([i]) > seen[i] for i in running), 300,
                     f"every running agent to see agent {index} wait")
        finally:
            for p in workers:
                try:
                    p.resume()
                except psutil.NoSuchProcess:
                    pass
        return index

    def _detections(self, agents: list[int]) -> int:
        """How often these agents logged that new nodes wait to join (they then restart their workers)."""
        return sum((self.workdir / f"agent{i}.log").read_text(errors="replace").count("new nodes from group_rank")
                   for i in agents)

    def wait(self, timeout: float = 600) -> dict[int, int]:
        """Exit codes of the agents still running (those not killed), once all have ended."""
        codes = {}
        for i, agent in enumerate(self.agents):
            if agent.returncode is None or agent.returncode >= 0:
                codes[i] = agent.wait(timeout=timeout)
        return codes

    def stop(self) -> None:
        for i, agent in enumerate(self.agents):
            if agent.poll() is None:
                self.lose_node(i)

    def __enter__(self) -> ElasticJob:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: object) -> None:
        """An error inside the block (a wait that timed out, a failed check): every agent stopped and their logs
        printed, then the error goes on; a block that ends normally leaves the job as it is."""
        if kind is not None:
            self.stop()
            print(self.logs())

    def logs(self, tail: int | None = 4000) -> str:
        """Every agent's log (the last `tail` characters of each; all with None)."""
        texts = [(self.workdir / f"agent{i}.log").read_text(errors="replace") for i in range(len(self.agents))]
        return "\n".join(f"--- agent {i} ---\n" + (t if tail is None else t[-tail:]) for i, t in enumerate(texts))


def _suspend(processes: list[psutil.Process]) -> list[psutil.Process]:
    """SIGSTOP each process still there; those stopped. A worker's child that ended since it was listed (a compiler
    run, a helper process) is left out: there is nothing of it to stop."""
    stopped = []
    for p in processes:
        try:
            p.suspend()
        except psutil.NoSuchProcess:  # ZombieProcess included
            continue
        stopped.append(p)
    return stopped


def cmdline(process: psutil.Process) -> str:
    """The process's command line, "" once it has exited (a child listed a moment ago may be gone by now)."""
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:  # ZombieProcess included
        return ""


def read_losses(path: Path) -> list[dict]:
    """The JSON lines the training script appended, one per step it finished (a step redone appears again)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def by_step(records: list[dict]) -> dict[int, list[dict]]:
    """`records` by the step each is of, in the order logged (a step redone after a restart appears again)."""
    out: dict[int, list[dict]] = {}
    for r in records:
        out.setdefault(r["step"], []).append(r)
    return out


def first_losses(path: Path) -> dict[int, float]:
    """The loss of each step an uninterrupted run logged to `path`."""
    return {step: rows[0]["loss"] for step, rows in by_step(read_losses(path)).items()}


def assert_same_losses(records: list[dict], reference: dict[int, float], rtol: float) -> None:
    """Every step `records` logged, redone ones included, has the reference run's loss within `rtol` (runs at
    other world sizes or layouts sum the same gradients in another order: see each test's RTOL)."""
    for step, rows in by_step(records).items():
        for r in rows:  # a step redone after a restart is the same step again
            assert r["loss"] == pytest.approx(reference[step], rel=rtol), (step, r, reference[step])


def assert_restarts_redo_at_most(records: list[dict], every: int, restarts: int) -> None:
    """The job started at least `restarts` + 1 times (a start is a run of records of one rank-0 pid), and each start
    began at most `every` steps before the last step of the start before it."""
    starts: list[list[int]] = []   # the steps of each start, in order
    for r in records:
        if not starts or r["pid"] != starts[-1][0]:
            starts.append([r["pid"]])
        starts[-1].append(r["step"])
    assert len(starts) > restarts, f"the job restarted {len(starts) - 1} times, not at least {restarts}"
    for before, after in zip(starts, starts[1:]):
        assert after[1] > before[-1] - every, f"steps redone > every ({every}): {before[1:]} then {after[1:]}"


def assert_stock_resume_is_not_the_run(script: Path, save_dir: Path, reference: dict[int, float], ranks: int,
                                       tmp_path: Path) -> None:
    """Negative control: `script --stock` (DeepSpeed's own load_checkpoint) resumes `save_dir`'s step-3 checkpoint on
    `ranks` ranks and either fails in DeepSpeed's load or logs steps 4-5 that are not the uninterrupted run's."""
    from support.launch import run_torchrun

    losses, log = tmp_path / "losses.jsonl", tmp_path / "log"
    try:
        run_torchrun(script, ["--save-dir", save_dir, "--steps", 5, "--stock", "--load-tag", "global_step3",
                              "--losses-out", losses], ranks, log)
    except RuntimeError:
        assert "load_checkpoint" in log.read_text(), "the stock resume failed, but not in DeepSpeed's load"
        return
    got = by_step(read_losses(losses))
    assert sorted(got) == [4, 5]
    assert any(got[s][0]["loss"] != pytest.approx(reference[s], rel=1e-3) for s in (4, 5))


def reached(path: Path, step: int, world: int | None = None):
    """A predicate for `wait_for`: a step >= `step` was logged (at `world` ranks, when given)."""
    return lambda: any(r["step"] >= step and (world is None or r["world"] == world) for r in read_losses(path))


def lose_a_node_then_get_it_back(script: Path, args: list, workdir: Path, losses: Path, on_three: int = 4) -> str:
    """The failure trace most elastic tests run: 4 agents of one worker each; after step 2 on 4 ranks one node is
    lost; after step `on_three` on the 3 left a node joins while the job is paused; every agent then ends with 0.
    Returns all agents' logs."""
    with ElasticJob(script, args, workdir) as job:
        for _ in range(4):
            job.start_agent()
        wait_for(reached(losses, 2, world=4), 300, "step 2 on 4 ranks")
        job.lose_node(3)
        wait_for(reached(losses, on_three, world=3), 300, f"step {on_three} on 3 ranks")
        job.join_while_paused()
        codes = job.wait(timeout=600)
    assert set(codes.values()) == {0}, job.logs()
    return job.logs(tail=None)


def assert_continues_the_run(records: list[dict], reference: dict[int, float], steps: int, rtol: float) -> None:
    """After `lose_a_node_then_get_it_back`: the job ended on 4 ranks at `steps`, logged every step, each with the
    uninterrupted run's loss within `rtol`, and redid at most one step per restart (a save every step). The check can
    fail: the reference's losses differ step to step, so a restart from scratch or another step would show."""
    assert records[-1]["world"] == 4 and records[-1]["step"] == steps
    assert sorted(by_step(records)) == list(range(1, steps + 1))
    assert_same_losses(records, reference, rtol)
    assert all(reference[s] != pytest.approx(reference[1], rel=rtol) for s in range(2, steps + 1))
    assert_restarts_redo_at_most(records, every=1, restarts=2)
