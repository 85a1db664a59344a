"""Checkpoints in S3-compatible object storage (issue #22), against moto's real S3 server on 127.0.0.1 behind a
counting, fault-injecting proxy (support/s3_proxy.py): `ucp convert --output s3://`, then verify, inspect,
`open_checkpoint` and a 2-rank hook load from `s3://`, each equal to the same checkpoint converted locally; the
bytes each rank reads counted at the HTTP level; throttling and 500s retried; an upload that fails midway leaves
no index and no parts; wrong credentials and a missing bucket give one line. Training saves asynchronously to
s3:// with "keep" and resumes from there with "load": "auto"; a save whose uploads fail commits nothing and leaves
no parts. `ucp convert --input s3://` downloads only the tag it converts and writes what converting the local
folder writes. The Hugging Face Trainer and Accelerate resume from a ucp conversion on s3:// exactly as from the
same conversion in a local folder; a DeepSpeed checkpoint uploaded as it is gets one line naming the conversion
to run. (Exports to s3:// are in test_export.py, Ray conversions in test_ray.py.)
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ucp
from support.checkpoints import TinySpec, run_tiny, ucp_resume, uninterrupted_losses
from support.dcp_leaves import assert_same_leaves, dcp_leaves
from support.hf_runs import SAVE_STEP, SOURCE_WORLD, accelerate_resume, accelerate_source, losses, trainer_resume
from support.s3_proxy import BUCKET, Cut, Fault
from test_zero_conversion import compare_loads
from ucp.cli.main import main as cli_main
from ucp.convert import convert
from ucp.errors import CheckpointNotFoundError, UnsupportedStorageError
from ucp.storage.locations import ObjectPath, location

SPEC = TinySpec(stage=2)  # saved on 2 ranks, loaded on 2


@pytest.fixture(scope="module")
def converted(s3, tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint converted by `ucp convert` to s3://BUCKET/run1 and to a local folder; the requests
    the S3 conversion sent."""
    save_dir = tiny_checkpoint(SPEC)
    local = convert(save_dir, tmp_path_factory.mktemp("s3-local") / "run1", workers=2, progress=False).output
    s3.proxy.reset()
    url = f"s3://{BUCKET}/run1"
    assert cli_main(["convert", "--input", str(save_dir), "--output", url, "--workers", "2", "--quiet"]) == 0
    return SimpleNamespace(url=url, local=Path(local), requests=list(s3.proxy.seen))


def keys(s3, prefix: str) -> list[str]:
    return sorted(o["Key"] for o in s3.client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", []))


def open_uploads(s3) -> list[str]:
    return [u["Key"] for u in s3.client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]


def test_convert_to_s3_commits_by_object_order_and_reads_back_equal(s3, converted, capsys):
    local_keys = sorted(p.name for p in converted.local.iterdir())
    assert keys(s3, "run1/") == [f"run1/{n}" for n in local_keys]
    index = s3.client.get_object(Bucket=BUCKET, Key="run1/ucp_index.json")["Body"].read()
    assert index == (converted.local / "ucp_index.json").read_bytes()
    writes = [r for r in converted.requests if r.method in ("PUT", "POST")]
    assert writes[-1].path == f"/{BUCKET}/run1/ucp_index.json" and writes[-1].method == "PUT"  # committed last
    assert any(r.method == "POST" and r.query == "uploads" for r in writes), "no multipart upload was exercised"
    assert open_uploads(s3) == []

    s3_ckpt, local_ckpt = ucp.open_checkpoint(converted.url), ucp.open_checkpoint(converted.local)
    assert s3_ckpt.names == local_ckpt.names and s3_ckpt.training == local_ckpt.training
    for name in local_ckpt.names:
        for state in local_ckpt.states(name):
            assert torch.equal(s3_ckpt.tensor(name, state), local_ckpt.tensor(name, state)), (name, state)

    assert cli_main(["verify", converted.url]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli_main(["inspect", "--json", converted.url]) == 0
    from_s3 = json.loads(capsys.readouterr().out)
    assert cli_main(["inspect", "--json", str(converted.local)]) == 0
    assert from_s3 == json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def deepspeed_on_s3(s3, tiny_checkpoint):
    """The tiny DeepSpeed save folder uploaded as it is to s3://BUCKET/ds-run, beside an older tag folder that
    `latest` does not name (a conversion must not download it)."""
    save_dir = tiny_checkpoint(SPEC)
    for path in sorted(p for p in save_dir.rglob("*") if p.is_file()):
        s3.client.upload_file(str(path), BUCKET, f"ds-run/{path.relative_to(save_dir).as_posix()}")
    s3.client.put_object(Bucket=BUCKET, Key="ds-run/global_step0/mp_rank_00_model_states.pt", Body=b"older")
    return f"s3://{BUCKET}/ds-run"


def test_convert_from_s3_reads_one_tag_and_writes_what_converting_the_local_folder_writes(
        s3, converted, deepspeed_on_s3, capsys):
    """Six ranged GETs of the rank files (one in seven) have their bodies cut halfway (#32): read on from where
    they stopped, the conversion writes the same bytes."""
    s3.proxy.reset()
    s3.proxy.cuts.append(Cut(times=6, every=7, when=lambda path: "/ds-run/" in path))
    url = f"s3://{BUCKET}/from-ds-s3"
    assert cli_main(["convert", "--input", deepspeed_on_s3, "--output", url, "--workers", "2", "--quiet"]) == 0
    assert s3.proxy.injected == 6  # control: bodies were cut
    assert [r.path for r in s3.proxy.seen if "/global_step0/" in r.path] == []
    assert any(r.method == "GET" and "_optim_states.pt" in r.path for r in s3.proxy.seen)  # control: read from s3
    data = sorted(n for n in os.listdir(converted.local) if n.startswith("data-"))
    assert data and keys(s3, "from-ds-s3/") == sorted([f"from-ds-s3/{n}" for n in data]
                                                      + ["from-ds-s3/ucp_index.json"])
    for name in data:
        stored = s3.client.get_object(Bucket=BUCKET, Key=f"from-ds-s3/{name}")["Body"].read()
        assert stored == (converted.local / name).read_bytes(), name
    source = ucp.open_checkpoint(url).index.run.source
    assert source["path"].startswith(f"{deepspeed_on_s3}/"), source  # where it came from, not the staging folder
    capsys.readouterr()
    assert cli_main(["convert", "--input", deepspeed_on_s3, "--output", url, "--quiet"]) == 0
    assert "already holds this conversion" in capsys.readouterr().out  # objects' mtimes make the same fingerprint


@pytest.mark.parametrize("argv, words", [
    (["--input", f"s3://{BUCKET}/no-such-run"], ["no objects under this prefix"]),
    (["--input", f"s3://{BUCKET}/ds-run", "--tag", "global_step7"], ["global_step7", "does not exist"]),
], ids=["empty-prefix", "missing-tag"])
def test_convert_from_s3_errors_name_the_url_not_the_staging_folder(s3, deepspeed_on_s3, argv, words, tmp_path,
                                                                      capsys, monkeypatch):
    monkeypatch.setenv("UCP_STAGING_DIR", str(tmp_path))
    assert cli_main(["convert", *argv, "--output", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and argv[1] in err and all(w in err for w in words), err
    assert str(tmp_path) not in err and os.listdir(tmp_path) == []  # no staging folder named, none left


def test_convert_to_s3_errors_name_the_url_not_the_staging_folder(s3, tiny_checkpoint, tmp_path, monkeypatch):
    """An error of the local conversion into the staging folder names the s3:// URL the user gave. It is provoked
    for real: the staging folder is locked as a second ucp process writing there holds it, so the local writer
    (`ucp.convert.convert`) refuses it, naming the folder; the control is that same refusal outside the upload."""
    from ucp.convert.object_output import convert_to_object_store
    from ucp.errors import OutputExistsError
    from ucp.storage.fileio import writing_alone

    monkeypatch.setenv("UCP_STAGING_DIR", str(tmp_path))
    save_dir, url = tiny_checkpoint(SPEC), f"s3://{BUCKET}/staging-named"

    def write_locked(staging: Path):
        with writing_alone(staging):  # the lock a second writer of the same folder holds
            return convert(save_dir, staging, workers=1, progress=False)

    with pytest.raises(OutputExistsError) as control:
        write_locked(tmp_path / "control")
    assert str(tmp_path / "control") in str(control.value)  # the writer names the folder it was given
    with pytest.raises(OutputExistsError) as refused:
        convert_to_object_store(location(url), "fingerprint", write_locked)
    assert str(refused.value).startswith(f"{url}: another ucp process is writing into it"), refused.value
    assert str(tmp_path) not in str(refused.value) and "ucp-staging-" not in str(refused.value)
    assert keys(s3, "staging-named/") == [] and sorted(os.listdir(tmp_path)) == ["control"]  # nothing left


def test_export_from_s3_writes_what_the_local_export_writes(s3, converted, tmp_path):
    from ucp.export import to_dcp

    loaded = []
    for source, name in ((converted.url, "from-s3"), (converted.local, "from-local")):
        to_dcp(source, tmp_path / name, progress=False)
        loaded.append(dcp_leaves(tmp_path / name, tmp_path))
    from_s3, from_local = loaded
    assert from_local
    assert_same_leaves(from_s3, from_local)


def test_local_reads_send_nothing_through_the_proxy(s3, converted):
    """Control for the counts below: the proxy sees only what reads s3://."""
    s3.proxy.reset()
    ckpt = ucp.open_checkpoint(converted.local)
    for name in ckpt.names:
        ckpt.tensor(name, ckpt.states(name)[0])
    assert s3.proxy.seen == []
    ucp.open_checkpoint(converted.url).tensor(ckpt.names[0], ckpt.states(ckpt.names[0])[0])
    assert s3.proxy.seen


def test_hook_load_from_s3_equals_a_local_load_and_reads_no_more_bytes(s3, converted, ckpt_root):
    s3.proxy.reset()
    ranks = compare_loads(converted.local, converted.url, SPEC, ckpt_root)
    index = ucp.open_checkpoint(converted.local).index
    header_end = {f"/{BUCKET}/run1/{name}": f.header_end for name, f in index.files.items()}
    for rank, result in enumerate(ranks):
        assert result["names"] and all(result["equal"]), [n for n, e in zip(result["names"], result["equal"]) if not e]
        assert result["meta_equal"]
        local_stats, s3_stats = result["stats"]
        gets = [r for r in s3.proxy.seen if r.rank == rank and r.method == "GET" and r.path in header_end]
        tensor_bytes = sum(r.body_bytes for r in gets if r.range_begin is not None
                           and r.range_begin >= header_end[r.path])
        assert 0 < tensor_bytes == s3_stats["bytes_read"] <= local_stats["bytes_read"], (rank, tensor_bytes,
                                                                                          local_stats, s3_stats)


def test_training_resumes_from_s3_through_the_config_key(converted, ckpt_root):
    """`"ucp": {"load": "s3://..."}` in the DeepSpeed config (train_tiny.py --ucp-load): the resumed run's losses
    are the uninterrupted run's (fp32, same layout)."""
    resumed = ucp_resume(converted.url, SPEC, 2, SPEC.steps, ckpt_root)
    straight = uninterrupted_losses(dataclasses.replace(SPEC, steps=0), SPEC.steps + 2, ckpt_root)
    assert resumed.losses == pytest.approx(straight[SPEC.steps:], rel=1e-6)


def test_throttling_and_server_errors_are_retried_with_identical_data(s3, converted, tiny_checkpoint):
    s3.proxy.reset()
    s3.proxy.faults += [Fault(503, "SlowDown", 2, lambda m, p, q: m == "PUT" and "partNumber" in q),
                        Fault(500, "InternalError", 2, lambda m, p, q: m == "PUT" and "partNumber" not in q)]
    url = f"s3://{BUCKET}/retried"
    assert cli_main(["convert", "--input", str(tiny_checkpoint(SPEC)), "--output", url, "--quiet"]) == 0
    s3.proxy.faults += [Fault(503, "SlowDown", 2, lambda m, p, q: m == "GET" and "/data-" in p),
                        Fault(500, "InternalError", 2, lambda m, p, q: m == "GET" and "/data-" in p, skip=3)]
    retried, local = ucp.open_checkpoint(url), ucp.open_checkpoint(converted.local)
    for name in local.names:
        for state in local.states(name):
            assert torch.equal(retried.tensor(name, state), local.tensor(name, state)), (name, state)
    assert s3.proxy.injected == 8  # every fault fired (control)
    assert open_uploads(s3) == []


def test_an_upload_failing_midway_leaves_no_index_and_no_parts(s3, tiny_checkpoint, capsys):
    s3.proxy.reset()
    s3.proxy.faults.append(Fault(403, "AccessDenied", 1000, lambda m, p, q: m == "PUT" and "partNumber" in q,
                                 skip=3))
    url = f"s3://{BUCKET}/broken"
    assert cli_main(["convert", "--input", str(tiny_checkpoint(SPEC)), "--output", url, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and url in err and "AccessDenied" in err, err
    assert s3.proxy.injected > 0
    assert not any(k.endswith("ucp_index.json") for k in keys(s3, "broken/"))
    assert open_uploads(s3) == []
    assert cli_main(["verify", url]) == 2  # incomplete, and says so
    assert "incomplete" in capsys.readouterr().err
    s3.proxy.reset()  # the same command again, with the store working: the leftovers go, the commit follows
    assert cli_main(["convert", "--input", str(tiny_checkpoint(SPEC)), "--output", url, "--quiet"]) == 0
    assert cli_main(["verify", url]) == 0


def test_a_convert_killed_midway_commits_nothing_and_the_next_aborts_its_parts(s3, tiny_checkpoint, capsys):
    """A writer killed outright cannot abort its multipart upload (S3 keeps the parts: the control below); the
    prefix holds no index, and the next conversion to it aborts the upload and commits."""
    held = threading.Event()
    s3.proxy.reset()
    s3.proxy.faults.append(Fault(503, "SlowDown", 1000, lambda m, p, q: m == "PUT" and "partNumber" in q, skip=2,
                                 hold=held))
    url = f"s3://{BUCKET}/killed"
    argv = ["convert", "--input", str(tiny_checkpoint(SPEC)), "--output", url, "--quiet"]
    proc = subprocess.Popen([sys.executable, "-m", "ucp.cli.main", *argv], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while s3.proxy.holding == 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s3.proxy.holding > 0, "the conversion never reached its part uploads"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        held.set()
    assert open_uploads(s3), "a killed writer leaves its upload open"  # control: what the next run must clean
    assert not any(k.endswith("ucp_index.json") for k in keys(s3, "killed/"))
    assert cli_main(["verify", url]) == 2  # not a checkpoint: no index object
    assert "no ucp_index.json" in capsys.readouterr().err
    s3.proxy.reset()
    assert cli_main(argv) == 0
    assert open_uploads(s3) == []
    assert cli_main(["verify", url]) == 0


def test_a_missing_bucket_and_wrong_credentials_give_one_line(s3, converted, monkeypatch, capsys):
    import moto.settings

    for argv in (["verify", "s3://no-such-bucket/run1"], ["inspect", "s3://no-such-bucket/run1"]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "s3://no-such-bucket/run1" in err and "does not exist" in err, err
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "WRONGKEYID")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server checks credentials now
    assert cli_main(["verify", converted.url]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and converted.url in err and "access refused" in err, err
    assert "wrong-secret-value" not in err and "WRONGKEYID" not in err


# -- asynchronous saves to s3:// ("ucp": {"save": {"dir": "s3://...", "keep": N}}) and "load": "auto" ---------

SAVE_SPEC = TinySpec(stage=2, steps=0)  # 2 ranks at ZeRO-2: every data file has parts of both ranks


def s3_save_run(url: str, steps: int, ckpt_root: Path, tmp_path: Path, name: str, keep: int | None = 2):
    """train_tiny.py on 2 ranks with `"save": {"dir": url, "every": 1, "keep": keep}` and `"load": "auto"`."""
    extra = ["--ucp-save-dir", url, "--ucp-save-every", "1", "--ucp-load", "auto"]
    extra += [] if keep is None else ["--ucp-save-keep", str(keep)]
    return run_tiny(SAVE_SPEC, tmp_path / name, steps=steps, save=False, extra_args=extra)


def tags_in(s3, prefix: str) -> set[str]:
    return {k[len(prefix):].split("/")[0] for k in keys(s3, prefix)}


def test_async_saves_to_s3_keep_the_newest_two_and_auto_resume_continues_the_run(s3, ckpt_root, tmp_path, capsys):
    """Saves every step to s3:// with "keep": 2, then "load": "auto" from there: the resumed run's losses are the
    uninterrupted run's (fp32, same layout); each save commits by object order (data objects, then the index,
    then `latest`), the bucket holds the 2 newest checkpoints and `latest` only, and no upload is left open."""
    url, prefix = f"s3://{BUCKET}/train", "train/"
    s3.proxy.reset()
    first = s3_save_run(url, 3, ckpt_root, tmp_path, "first")
    straight = uninterrupted_losses(SAVE_SPEC, 5, ckpt_root)  # the run the test above compares with (cached)
    assert first.losses == straight[:3]  # saving does not disturb training, to the bit
    assert tags_in(s3, prefix) == {"global_step2", "global_step3", "latest", "ucp_progress.json"}
    writes = [r for r in s3.proxy.seen if r.method in ("PUT", "POST", "DELETE") and r.status < 300]
    for step in range(1, 4):
        tag = f"/{BUCKET}/train/global_step{step}/"
        completed = [i for i, r in enumerate(writes) if r.path.startswith(tag) and r.method == "POST"
                     and "uploadId" in r.query]
        index = [i for i, r in enumerate(writes) if r.path == tag + "ucp_index.json" and r.method == "PUT"]
        latest = [i for i, r in enumerate(writes) if r.path == f"/{BUCKET}/train/latest" and r.method == "PUT"]
        assert completed and len(index) == 1 and max(completed) < index[0] < latest[step - 1], step
        # ucp's partial-save marker: put before any part, deleted once the index is in (ucp.format.save_folder)
        marker = [(i, r.method) for i, r in enumerate(writes) if r.path == tag + "ucp_saving"]
        assert [m for _, m in marker][:2] == ["PUT", "DELETE"] and marker[0][0] < min(completed), step
        assert index[0] < marker[1][0] < latest[step - 1], step
        # "keep": 2 deleted step 1, index first (control: it was committed)
        deleted = [i for i, r in enumerate(writes) if r.path.startswith(tag) and r.method == "DELETE"
                   and i != marker[1][0]]
        assert bool(deleted) == (step == 1) and (not deleted or writes[deleted[0]].path == tag + "ucp_index.json")
    assert {r.rank for r in writes if "partNumber" in r.query} == {0, 1}  # each rank uploads parts of its own
    assert open_uploads(s3) == []
    for step in (2, 3):
        assert cli_main(["verify", f"{url}/global_step{step}"]) == 0
    assert cli_main(["verify", url]) == 0  # its `latest`
    assert capsys.readouterr().out.count(": OK") == 3

    resumed = s3_save_run(url, 2, ckpt_root, tmp_path, "resumed")
    log = (tmp_path / "resumed" / "train.log").read_text()
    assert f"resuming from {url}/global_step3 (step 3)" in log
    assert f"ucp: restart 2 -> 2 ranks: loaded {url}/global_step3 (step 3), 0 steps redone" in log  # the record
    assert resumed.losses == pytest.approx(straight[3:5], rel=1e-6)
    assert tags_in(s3, prefix) == {"global_step4", "global_step5", "latest", "ucp_progress.json"}
    assert s3.client.get_object(Bucket=BUCKET, Key="train/latest")["Body"].read() == b"global_step5"
    assert open_uploads(s3) == []
    assert cli_main(["verify", f"{url}/global_step4"]) == 0 and cli_main(["verify", url]) == 0


def test_a_save_whose_uploads_fail_commits_nothing_and_training_is_told(s3, ckpt_root, tmp_path, capsys):
    """Part uploads of step 2's save refused (after two went up): the save aborts its uploads and commits
    nothing (its folder holds only ucp's partial-save marker), `latest` stays at step 1, and the next save raises the
    failure in training, as a full disk does."""
    url, prefix = f"s3://{BUCKET}/failing", "failing/"
    s3.proxy.reset()
    s3.proxy.faults.append(Fault(403, "AccessDenied", 1000, lambda m, p, q: m == "PUT" and "partNumber" in q
                                 and p.startswith(f"/{BUCKET}/failing/global_step2/"), skip=2))
    with pytest.raises(RuntimeError):
        s3_save_run(url, 3, ckpt_root, tmp_path, "failing", keep=None)
    log = (tmp_path / "failing" / "train.log").read_text()
    assert f"{url}/global_step2: not committed, rank" in log and "AccessDenied" in log, log[-3000:]
    assert s3.proxy.injected > 0
    uploaded = [r for r in s3.proxy.seen if "partNumber" in r.query and r.status == 200 and "global_step2" in r.path]
    assert uploaded, "no part went up before the fault: the abort would have nothing to remove"  # control
    # Nothing of step 2 but ucp's partial-save marker, which says the folder is a ucp save that did not commit (the
    # next save's "keep" removes it; no index, so nothing reads it as a checkpoint).
    assert tags_in(s3, prefix) == {"global_step1", "global_step2", "latest", "ucp_progress.json"}
    assert keys(s3, prefix + "global_step2/") == [prefix + "global_step2/ucp_saving"]
    assert s3.client.get_object(Bucket=BUCKET, Key="failing/latest")["Body"].read() == b"global_step1"
    assert open_uploads(s3) == []
    assert cli_main(["verify", url]) == 0
    assert f"{url}/global_step1: OK" in capsys.readouterr().out


def test_auto_and_keep_over_an_object_store_prefix(s3, converted):
    """`candidates`, `set_aside` (ucp.elastic.resume) and `prune` (ucp.elastic.retention) on an s3:// save prefix,
    without training: copies of the converted checkpoint as tags 1 and 2 (each index recording its tag's step, as a
    save's does), and a tag 0 that never committed (data, ucp's partial-save marker, no index)."""
    from ucp.elastic.resume import candidates, set_aside
    from ucp.elastic.retention import prune
    from ucp.format.folder import commit_latest
    from ucp.storage.locations import location

    def copy_tag(tag: str, skip_index: bool = False) -> None:
        for key in keys(s3, "run1/"):
            target = f"saves/{tag}/{key[len('run1/'):]}"
            if not key.endswith("ucp_index.json"):
                s3.client.copy_object(Bucket=BUCKET, Key=target, CopySource={"Bucket": BUCKET, "Key": key})
            elif not skip_index:
                index = json.loads(s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
                index.setdefault("training", {})["global_steps"] = int(tag.removeprefix("global_step"))
                s3.client.put_object(Bucket=BUCKET, Key=target, Body=json.dumps(index).encode())

    for tag, partial in (("global_step0", True), ("global_step1", False), ("global_step2", False)):
        copy_tag(tag, partial)
    # a ucp save killed mid-write: its partial-save marker, written before any data (ucp.format.save_folder)
    s3.client.put_object(Bucket=BUCKET, Key="saves/global_step0/ucp_saving", Body=b"")
    url, data = location(f"s3://{BUCKET}/saves"), sorted(k[len("run1/"):] for k in keys(s3, "run1/"))
    assert candidates(url) == [url / "global_step2", url / "global_step1"]  # committed only, newest first
    set_aside([url / "global_step2"], url / "global_step1")  # as "auto" does after step 2 failed its checks
    assert tags_in(s3, "saves/") == {"global_step0", "global_step1", "global_step2.damaged", "latest"}
    assert sorted(k[len("saves/global_step2.damaged/"):] for k in keys(s3, "saves/global_step2.damaged/")) == data
    assert s3.client.get_object(Bucket=BUCKET, Key="saves/latest")["Body"].read() == b"global_step1"
    assert candidates(url) == [url / "global_step1"]
    copy_tag("global_step3")
    # "keep": 1 keeps step 3, and step 1 too, which `latest` names; the uncommitted step 0 goes
    assert prune(url, 1) == [url / "global_step0"]
    assert tags_in(s3, "saves/") == {"global_step1", "global_step2.damaged", "global_step3", "latest"}
    commit_latest(url, "global_step3")
    assert prune(url, 1) == [url / "global_step1"]  # control: no longer named by `latest`, it goes
    assert tags_in(s3, "saves/") == {"global_step2.damaged", "global_step3", "latest"}


# -- the Hugging Face Trainer and Accelerate from s3:// -----------------------------------------------------------

TRAINER_CHECKPOINT = f"checkpoint-{SAVE_STEP}"
TRAINER_LAYOUT = (2, 3)  # processes and ZeRO stage of test_trainer.py's resume from the local conversion (shared)


def upload_tree(s3, folder: Path, prefix: str) -> None:
    """Every file under `folder` to `prefix/<its path>`, as a user copies a folder to a bucket (aws s3 cp
    --recursive)."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        s3.client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(folder)}")


def copy_prefix(s3, source: str, target: str, skip=lambda name: False) -> None:
    for key in keys(s3, f"{source}/"):
        if not skip(key[len(source) + 1:]):
            s3.client.copy_object(Bucket=BUCKET, Key=f"{target}/{key[len(source) + 1:]}",
                                  CopySource={"Bucket": BUCKET, "Key": key})


@pytest.fixture(scope="module")
def trainer_on_s3(s3, trainer_run) -> str:
    """`ucp convert --input checkpoint-3 --output s3://BUCKET/hf-out/checkpoint-3` of the Trainer's checkpoint."""
    url = f"s3://{BUCKET}/hf-out/{TRAINER_CHECKPOINT}"
    assert cli_main(["convert", "--input", str(trainer_run("llama") / "out" / TRAINER_CHECKPOINT), "--output", url,
                     "--workers", "2", "--quiet"]) == 0
    return url


def test_the_trainer_resumes_from_s3_as_from_the_local_conversion(s3, trainer_on_s3, trainer_resumed_from_conversion,
                                                                  ckpt_root, tmp_path, monkeypatch):
    """ucp.transformers.train(trainer, resume_from_checkpoint="s3://...") on 2 processes at ZeRO-3 (saved at
    ZeRO-2): the losses, step and epoch are those of the resume from the same conversion in a local folder, to the
    bit (the same bytes loaded into the same layout; test_trainer.py checks those against the uninterrupted run).
    The engine is read by ranged GETs of each rank, never a whole data object; the Trainer's small files come from
    a temporary folder that is removed afterwards."""
    assert {"trainer_state.json", "config.json"} <= set(ucp.open_checkpoint(trainer_on_s3).extra_files)
    children_tmp = tmp_path / "tmp"
    children_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(children_tmp))
    s3.proxy.reset()
    run = trainer_resume("llama", trainer_on_s3, *TRAINER_LAYOUT, ckpt_root)
    resumed = losses(run / "losses.json")
    assert resumed["first_step"] == SAVE_STEP + 1
    assert resumed == losses(trainer_resumed_from_conversion("llama", *TRAINER_LAYOUT) / "losses.json")
    data = [r for r in s3.proxy.seen if r.method == "GET" and "/data-" in r.path]
    assert {r.rank for r in data} == {0, 1} and all(r.range_begin is not None for r in data)
    assert not list(children_tmp.glob("ucp-trainer-files-*"))


def test_trainer_folders_on_s3_are_found_as_locally(s3, trainer_on_s3, trainer_run):
    """What `resume_from_checkpoint="s3://..."` resolves to (ucp.transformers.trainer_folder): a conversion, an
    output_dir's copy (its last checkpoint-N; an unfinished last one refused, naming the last complete one), a
    save folder's `latest`; and saved_world_size read from there."""
    from ucp.checkpoint import saved_world_size
    from ucp.transformers import trainer_folder

    converted = location(trainer_on_s3)
    assert trainer_folder(trainer_on_s3, "/elsewhere") == converted
    assert trainer_folder(f"s3://{BUCKET}/hf-out", "/elsewhere") == converted
    assert saved_world_size(converted) == SOURCE_WORLD
    copy_prefix(s3, f"hf-out/{TRAINER_CHECKPOINT}", "hf-save/global_step3")
    s3.client.put_object(Bucket=BUCKET, Key="hf-save/latest", Body=b"global_step3")
    assert trainer_folder(f"s3://{BUCKET}/hf-save", "/elsewhere") == location(f"s3://{BUCKET}/hf-save/global_step3")

    copy_prefix(s3, f"hf-out/{TRAINER_CHECKPOINT}", "hf-out2/checkpoint-3")
    copy_prefix(s3, f"hf-out/{TRAINER_CHECKPOINT}", "hf-out2/checkpoint-10", skip=lambda n: n == "ucp_index.json")
    with pytest.raises(CheckpointNotFoundError) as refused:
        trainer_folder(f"s3://{BUCKET}/hf-out2", "/elsewhere")
    assert str(refused.value) == (
        f"s3://{BUCKET}/hf-out2/checkpoint-10: it has no ucp_index.json, so the conversion or upload that wrote it did "
        f"not finish; the last complete one is checkpoint-3: pass resume_from_checkpoint='s3://{BUCKET}/hf-out2/"
        "checkpoint-3'")  # and checkpoint-10 sorts after checkpoint-3, by N (control: not by name)


def test_deepspeed_checkpoints_uploaded_to_s3_are_refused_in_one_line_naming_the_conversion(s3, trainer_run,
                                                                                            trainer_on_s3, ckpt_root):
    """A Trainer's checkpoint-N and Accelerate's save_state folder copied to the bucket as they are (DeepSpeed's
    torch files, which ucp loads from local folders only): the Trainer (`trainer_folder` is the first thing
    ucp.transformers.train does with its argument), Accelerate and open_checkpoint refuse them in one line that
    names the conversion to run, before any engine is touched."""
    from ucp.accelerate import engine_source
    from ucp.transformers import trainer_folder

    upload_tree(s3, trainer_run("llama") / "out" / TRAINER_CHECKPOINT, f"raw-hf/{TRAINER_CHECKPOINT}")
    upload_tree(s3, accelerate_source(ckpt_root) / "state", "raw-accelerate")
    raw = f"s3://{BUCKET}/raw-hf/{TRAINER_CHECKPOINT}"
    fix = f"ucp convert --input {raw} --output s3://{BUCKET}/NEW_PREFIX, then resume from that prefix"
    accelerate = f"s3://{BUCKET}/raw-accelerate"
    calls = [(lambda: trainer_folder(raw, "/elsewhere"), raw, fix),
             (lambda: trainer_folder(f"s3://{BUCKET}/raw-hf", "/elsewhere"), raw, fix),  # as an output_dir's copy
             (lambda: ucp.open_checkpoint(raw), raw, f"ucp convert --input {raw} --output s3://{BUCKET}/"),
             (lambda: engine_source(accelerate, None), accelerate, f"ucp convert --input {accelerate} --output")]
    for call, named, needle in calls:
        with pytest.raises(UnsupportedStorageError) as refused:
            call()
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"{named}: holds a DeepSpeed checkpoint (") and \
            "ucp loads DeepSpeed checkpoints from local folders only" in message and needle in message, message
    assert engine_source(trainer_on_s3, None) == location(trainer_on_s3)  # control: a ucp checkpoint is taken
    converted = f"s3://{BUCKET}/raw-hf-converted"  # the fix the message names works as written
    assert cli_main(["convert", "--input", raw, "--output", converted, "--workers", "2", "--quiet"]) == 0
    assert trainer_folder(converted, "/elsewhere") == location(converted)
    with pytest.raises(UnsupportedStorageError, match="takes local .* folders only so far; URLs: s3:// .*"
                                                      r"ucp.accelerate.load_state \(the ucp checkpoint"):
        engine_source(f"s3://{BUCKET}/raw-accelerate", trainer_on_s3)  # Accelerate's own files: local only
    with pytest.raises(UnsupportedStorageError, match="gs://bucket/run1: fsspec's gs:// filesystem is not installed "
                                                      r"\(.*gcsfs.*\); ucp reads local folders, s3:// URLs"):
        trainer_folder("gs://bucket/run1", "/elsewhere")  # not taken for a local folder named gs: (no gcsfs here)



def test_accelerate_loads_the_engine_from_s3_as_from_the_local_conversion(s3, accelerate_from_conversion, ckpt_root):
    """ucp.accelerate.load_state(accelerator, STATE_DIR, checkpoint="s3://...") on 1 process at ZeRO-3 (saved on 2
    at ZeRO-2): the same losses and samples, to the bit, as with the same conversion in a local folder (which
    test_trainer.py checks against the uninterrupted run); the engine is read by ranged GETs. The conversion given
    alone as an s3:// input_dir is taken for the engine's checkpoint (this run needs scheduler.bin beside it, and
    is refused for that in test_trainer.py's local case)."""
    from ucp.accelerate import engine_source

    url = f"s3://{BUCKET}/accelerate"
    s3.proxy.reset()
    assert cli_main(["convert", "--input", str(accelerate_source(ckpt_root) / "state"), "--output", url,
                     "--workers", "2", "--quiet"]) == 0
    assert engine_source(url, None) == location(url) and isinstance(location(url), ObjectPath)
    s3.proxy.reset()
    run = accelerate_resume(accelerate_source(ckpt_root) / "state", 1, 3, ckpt_root, url)
    resumed = losses(run / "losses.json")
    assert resumed["first_step"] == SAVE_STEP + 1
    assert resumed == losses(accelerate_from_conversion / "losses.json")
    assert "RNG states were saved by 2 processes and cannot be mapped to 1" in (run / "train.log").read_text()
    data = [r for r in s3.proxy.seen if r.method == "GET" and "/data-" in r.path]
    assert data and all(r.range_begin is not None for r in data)
