"""The Ray backend on a real local Ray cluster: byte-identical to the local backend, survives a killed
worker, resumes an interrupted conversion (Ray or local), and runs as a submitted Ray job.

One cluster (`ray start --head --block`, 2 CPUs, dashboard for the job server, its own temp dir)
serves the whole module; it runs in its own session, so teardown stops exactly its processes, by
session id, even when a test fails.

Faults are injected with `ucp.convert.driver._hold_for_tests`: every process of the cluster sees
$UCP_TEST_HOLD_DIR, and while `<dir>/<data file>.hold` exists the writer of that data file writes
its pid to `<dir>/<data file>.pid` after its first tensor and waits, so a test can kill it mid-file.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.checkpoints import TinySpec, read_tag
from support.processes import gone, ucp_command, wait_for
from support.ray_nodes import RAY_ENV, free_port, stop_session
from support.s3_proxy import BUCKET
from ucp.cli.main import main
from ucp.convert.driver import convert, write_atomic
from ucp.convert.manifest import manifest_name
from ucp.converters.dispatch import plan_deepspeed
from ucp.errors import CorruptCheckpointError
from ucp.format.folder import INDEX_NAME, data_file_name

SPECS = [TinySpec(stage=1), TinySpec(stage=3, dtype="bf16", world_size=3)]
WORKERS = 2
BIN0, BIN1 = data_file_name(0, WORKERS), data_file_name(1, WORKERS)
@dataclass(frozen=True)
class Cluster:
    address: str    # GCS address, for --ray-address
    dashboard: str  # job server, for ucp submit
    hold: Path      # $UCP_TEST_HOLD_DIR of every process of the cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("r")  # short: Ray's socket paths under it must stay below 108 bytes
    temp_dir, hold = root / "t", root / "hold"
    temp_dir.mkdir()
    hold.mkdir()
    dashboard_port = free_port()
    cmd = ["ray", "start", "--head", "--block", f"--port={free_port()}", "--num-cpus=2", "--disable-usage-stats",
           f"--temp-dir={temp_dir}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dashboard_port}", f"--ray-client-server-port={free_port()}"]
    log = root / "ray-start.log"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in RAY_ENV.items():
            mp.setenv(key, value)
        env = {**os.environ, "UCP_TEST_HOLD_DIR": str(hold)}
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            address_file = temp_dir / "ray_current_cluster"

            def started():
                if proc.poll() is not None:
                    raise RuntimeError(f"ray start exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
                return address_file.is_file() and address_file.read_text().strip()

            address = wait_for(started, what="ray start")
            yield Cluster(address, f"http://127.0.0.1:{dashboard_port}", hold)
        finally:
            stop_session(proc)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, tmp_path_factory):
    """Factory: the local backend's output for `spec` with WORKERS workers."""
    memo: dict[TinySpec, Path] = {}

    def make(spec: TinySpec) -> Path:
        if spec not in memo:
            memo[spec] = tmp_path_factory.mktemp("local") / spec.name
            convert(tiny_checkpoint(spec), memo[spec], workers=WORKERS, progress=False)
        return memo[spec]

    return make


def tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def params_in(reference_dir: Path, file_name: str) -> int:
    index = json.loads((reference_dir / INDEX_NAME).read_text())
    return sum(1 for e in index["params"].values() if next(iter(e["states"].values()))["file"] == file_name)


def ray_convert(cluster: Cluster, source: Path | str, output: Path | str, **kwargs):
    from ucp.convert.ray_executor import RayExecutor

    with RayExecutor(cluster.address, WORKERS, progress=False) as executor:
        return convert(source, output, executor=executor, **kwargs)


@contextlib.contextmanager
def held(hold_dir: Path, file_name: str):
    """Hold the writer of `file_name` (see the module docstring) until the block ends."""
    flag = hold_dir / f"{file_name}.hold"
    (hold_dir / f"{file_name}.pid").unlink(missing_ok=True)
    flag.touch()
    try:
        yield
    finally:
        flag.unlink(missing_ok=True)


def held_pid(hold_dir: Path, file_name: str, other_than: int | None = None) -> int:
    pid_file = hold_dir / f"{file_name}.pid"

    def read():
        pid = int(pid_file.read_text()) if pid_file.is_file() else None
        return pid if pid and pid != other_than else None

    return wait_for(read, what=f"the writer of {file_name}")


def interrupt(cmd: list[str], output: Path, hold_dir: Path, env: dict) -> None:
    """Run `cmd` until BIN0 is finished (its manifest is there) and BIN1's writer is held, then kill
    the driver's whole process group and wait until BIN1's writer is gone."""
    with held(hold_dir, BIN1):
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            writer = held_pid(hold_dir, BIN1)
            wait_for(lambda: (output / manifest_name(BIN0)).is_file(), what=f"{BIN0} to finish")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        wait_for(lambda: gone(writer), timeout=60, what="the held writer to die with its driver")
    assert not (output / INDEX_NAME).exists()
    assert (output / BIN0).is_file() and not (output / BIN1).exists()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_ray_output_is_byte_identical_to_local(spec, cluster, tiny_checkpoint, reference, tmp_path):
    out = tmp_path / "ray"
    result = ray_convert(cluster, tiny_checkpoint(spec), out)
    assert result.redone == result.params
    assert tree(out) == tree(reference(spec))
    # Negative control: the comparison does see a different layout of the same tensors.
    other = tmp_path / "local-1"
    convert(tiny_checkpoint(spec), other, workers=1, progress=False)
    assert tree(other) != tree(reference(spec))


def test_ray_converts_from_s3_to_s3_what_it_converts_locally(cluster, s3, tiny_checkpoint, reference,
                                                             tmp_path):
    """`ucp convert --executor ray --input s3://... --output s3://...` (moto's server, test_s3.py): the data
    objects are the local backend's data files, byte for byte, and the index object went up last."""
    spec = SPECS[0]
    save_dir = tiny_checkpoint(spec)
    for path in sorted(p for p in save_dir.rglob("*") if p.is_file()):
        s3.client.upload_file(str(path), BUCKET, f"ray-in/{path.relative_to(save_dir).as_posix()}")
    s3.proxy.reset()
    ray_convert(cluster, f"s3://{BUCKET}/ray-in", f"s3://{BUCKET}/ray-out")
    expected = {name: data for name, data in tree(reference(spec)).items() if name != INDEX_NAME}
    stored = {o["Key"].removeprefix("ray-out/")
              for o in s3.client.list_objects_v2(Bucket=BUCKET, Prefix="ray-out/")["Contents"]}
    assert stored == {*expected, INDEX_NAME}
    for name, data in expected.items():
        assert s3.client.get_object(Bucket=BUCKET, Key=f"ray-out/{name}")["Body"].read() == data, name
    writes = [r for r in s3.proxy.seen if r.method in ("PUT", "POST")]
    assert writes[-1].path == f"/{BUCKET}/ray-out/{INDEX_NAME}"


def test_killed_worker_is_retried_and_output_is_complete(cluster, tiny_checkpoint, reference, tmp_path):
    spec = SPECS[0]
    killed = []

    def kill_the_writer() -> None:
        try:
            pid = held_pid(cluster.hold, BIN0)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            killed.append(held_pid(cluster.hold, BIN0, other_than=pid))  # Ray retried the task in a new worker
        finally:
            (cluster.hold / f"{BIN0}.hold").unlink(missing_ok=True)

    with held(cluster.hold, BIN0):
        killer = threading.Thread(target=kill_the_writer, daemon=True)
        killer.start()
        ray_convert(cluster, tiny_checkpoint(spec), tmp_path / "out")
    killer.join(timeout=10)
    assert len(killed) == 2, "the writer was not held, or not retried after it was killed"
    assert tree(tmp_path / "out") == tree(reference(spec))


def test_interrupted_ray_conversion_resumes_only_missing_bins(cluster, tiny_checkpoint, reference, tmp_path, capsys):
    spec = SPECS[1]
    source, out = tiny_checkpoint(spec), tmp_path / "out"
    args = ["convert", "--input", str(source), "--output", str(out), "--workers", str(WORKERS),
            "--executor", "ray", "--ray-address", cluster.address, "--quiet"]
    interrupt(ucp_command(*args), out, cluster.hold, dict(os.environ))
    assert main(args + ["--resume"]) == 0
    expected = params_in(reference(spec), BIN1)
    assert 0 < expected < len(json.loads((reference(spec) / INDEX_NAME).read_text())["params"])
    assert f"redid {expected} of" in capsys.readouterr().out
    assert tree(out) == tree(reference(spec))


def test_resume_with_local_executor_redoes_missing_and_damaged_bins(tiny_checkpoint, reference, tmp_path):
    spec = SPECS[0]
    source, out, hold_dir = tiny_checkpoint(spec), tmp_path / "out", tmp_path / "hold"
    hold_dir.mkdir()
    env = {**os.environ, "UCP_TEST_HOLD_DIR": str(hold_dir)}
    interrupt(ucp_command("convert", "--input", str(source), "--output", str(out), "--workers", str(WORKERS),
                          "--quiet"), out, hold_dir, env)
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    first_tensor = json.loads((damaged / manifest_name(BIN0)).read_text())["tensors"][0]
    with open(damaged / BIN0, "r+b") as f:  # one flipped bit inside BIN0's first tensor
        f.seek(first_tensor[1])
        byte = f.read(1)[0]
        f.seek(first_tensor[1])
        f.write(bytes([byte ^ 0x01]))
    total = len(json.loads((reference(spec) / INDEX_NAME).read_text())["params"])

    result = convert(source, out, workers=WORKERS, resume=True, progress=False)
    assert result.redone == params_in(reference(spec), BIN1) < total
    assert tree(out) == tree(reference(spec))

    result = convert(source, damaged, workers=WORKERS, resume=True, progress=False)
    assert result.redone == total
    assert tree(damaged) == tree(reference(spec))


def test_task_error_is_not_retried_and_reaches_the_caller(cluster, tiny_checkpoint, tmp_path):
    from ucp.convert.ray_executor import RayExecutor

    source = tmp_path / "src"
    shutil.copytree(tiny_checkpoint(SPECS[0]), source)
    shard = source / read_tag(source) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    plan = plan_deepspeed(source)
    first = min(f.piece.byte_offset for p in plan.params for s in p.states.values() for f in s.fragments
                if f.piece.path == str(shard))
    os.truncate(shard, first)  # after planning: the map task that reads this shard finds it short
    with RayExecutor(cluster.address, WORKERS, progress=False) as executor:
        with pytest.raises(CorruptCheckpointError, match=f"{shard}: ends at byte .* truncated"):
            write_atomic(plan, tmp_path / "out", executor)
    assert not (tmp_path / "out" / INDEX_NAME).exists()


def test_a_flipped_bit_read_by_a_map_task_is_refused(cluster, tiny_checkpoint, tmp_path):
    """The reducers CRC the pieces the map tasks read, and the driver checks them against the rank files' zip
    CRC-32s before it commits anything, as the local backend does."""
    from ucp.convert.ray_executor import RayExecutor

    source = tmp_path / "src"
    shutil.copytree(tiny_checkpoint(SPECS[0]), source)
    plan = plan_deepspeed(source)
    piece = next(f.piece for p in plan.params for s in p.states.values() for f in s.fragments
                 if "optim_states" in f.piece.path and f.piece.numel > 4)
    with open(piece.path, "r+b") as f:  # after planning: only the bytes a map task reads are damaged
        f.seek(piece.byte_offset + 5)
        byte = f.read(1)[0]
        f.seek(piece.byte_offset + 5)
        f.write(bytes([byte ^ 0x10]))
    with RayExecutor(cluster.address, WORKERS, progress=False) as executor:
        with pytest.raises(CorruptCheckpointError, match=f"{piece.path}: tensor data .* fails its CRC-32"):
            write_atomic(plan, tmp_path / "out", executor)
    assert not (tmp_path / "out" / INDEX_NAME).exists()


def test_submit_runs_the_conversion_as_a_ray_job(cluster, tiny_checkpoint, reference, tmp_path, capsys):
    spec = SPECS[0]
    out = tmp_path / "out"
    code = main(["submit", "--address", cluster.dashboard, "--ship-ucp", "--",
                 "convert", "--input", str(tiny_checkpoint(spec)), "--output", str(out), "--workers", str(WORKERS)])
    logs = capsys.readouterr().out
    assert code == 0, logs
    assert "ucp ray: convert:" in logs and "converted" in logs  # progress reaches the job's logs
    assert main(["verify", str(out)]) == 0
    assert tree(out) == tree(reference(spec))
    # A job that fails makes `ucp submit` fail.
    code = main(["submit", "--address", cluster.dashboard, "--", "convert", "--input", str(tmp_path / "missing"),
                 "--output", str(tmp_path / "never")])
    assert code == 1
