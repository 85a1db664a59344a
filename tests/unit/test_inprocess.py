"""ucp.elastic.run's pure parts: the job's store from ucp-torchrun's arguments, which errors are a lost peer, the
"detect_s" key, and the in-process report line. The mechanism itself runs under real torchrun agents in
tests/integration/test_inprocess_restart.py."""
from __future__ import annotations

import pytest

from ucp.elastic import inprocess
from ucp.elastic.restart import RestartReport
from ucp.elastic.shares import ElasticSection
from ucp.elastic.torchrun import job_store_env
from ucp.errors import ConfigError


def test_the_job_store_is_the_c10d_rendezvous_endpoint():
    args = ["--nnodes", "1:3", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:5555", "--rdzv-id=job",
            "train.py", "--rdzv-id", "not-torchrun's"]
    assert job_store_env(args) == {"UCP_ELASTIC_STORE": "127.0.0.1:5555", "UCP_ELASTIC_RUN": "job"}
    assert job_store_env(["--rdzv_backend", "c10d", "--rdzv_endpoint", "head", "--rdzv_id", "j", "t.py"]) == {
        "UCP_ELASTIC_STORE": "head:29400", "UCP_ELASTIC_RUN": "j"}
    # control: no c10d endpoint, no job store (ucp.elastic.run then refuses to start, below)
    assert job_store_env(["--standalone", "--nproc-per-node=2", "t.py"]) == {}
    assert job_store_env(["--rdzv-backend=etcd", "--rdzv-endpoint=h:1", "--rdzv-id=j", "t.py"]) == {}


def test_run_without_the_job_store_is_one_line(monkeypatch):
    monkeypatch.delenv(inprocess.STORE_ENV, raising=False)
    with pytest.raises(ConfigError) as err:
        inprocess.run(lambda: None)
    assert str(err.value) == (
        "ucp.elastic.run: UCP_ELASTIC_STORE='', UCP_ELASTIC_RUN='' in the environment: launch with ucp-torchrun and "
        "--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=ID (the survivors of a fault meet in that store)")


def test_a_lost_peer_is_told_from_other_errors():
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:1234. This is typically caused by a remote worker crashing.")
    assert inprocess._peer_fault(gloo).startswith("RuntimeError: [/pytorch/third_party/gloo")
    try:
        try:
            raise gloo
        except RuntimeError as inner:
            raise ValueError("the save failed") from inner
    except ValueError as outer:
        assert inprocess._peer_fault(outer) is not None   # through the cause
    assert inprocess._peer_fault(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None  # control
    assert inprocess._peer_fault(ValueError("Connection closed by peer")) is None   # not a runtime/socket error


@pytest.mark.parametrize("value", [0, -1, "5", True, None])
def test_detect_s_must_be_a_positive_number(value):
    with pytest.raises(ConfigError) as err:
        ElasticSection.from_config({"global_batch": 8, "micro_batch": 1, "detect_s": value})
    assert str(err.value) == (f'"ucp": {{"elastic": {{"detect_s": {value!r}}}}}: must be a number of seconds > 0 '
                              "(how long a rank may send no heartbeat before it is taken for hung; default 15)")
    assert ElasticSection.from_config({"global_batch": 8, "micro_batch": 1}).detect_s == 15   # the default


def test_the_in_process_report_line():
    report = RestartReport(old_world=4, new_world=3, checkpoint="/dev/shm/ucp/global_step7", checkpoint_step=7,
                           steps_redone=0, detection_s=1.94, startup_s=0.81, load_s=0.3, first_step_s=0.5,
                           regroup_s=2.5)
    assert report.line() == ("ucp: in-process restart 4 -> 3 ranks: loaded /dev/shm/ucp/global_step7 (step 7), 0 "
                             "steps redone; fault to first step 6.0 s = detection 1.9 s + regroup 2.5 s + engine "
                             "0.8 s + load 0.3 s + first step 0.5 s")


def test_after_an_in_process_restart_no_checkpoint_ends_the_rank(monkeypatch, capsys):
    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(inprocess.os, "_exit", exit_)
    assert inprocess.started(None, False) is None   # a first start: nothing to load is a fresh start (control)
    restart = inprocess.Restart(3, 2, 0.0, 0.0)
    monkeypatch.setattr(inprocess, "_restart", restart)
    assert inprocess.started(None, True) is restart   # handed over once, for the report
    assert inprocess.started(None, True) is None
    monkeypatch.setattr(inprocess, "_restart", restart)
    with pytest.raises(SystemExit) as ended:
        inprocess.started(None, False)
    assert ended.value.code == 1
    assert capsys.readouterr().err == (
        "ucp: in-process restart failed: no complete checkpoint to continue from (neither the memory tier nor the "
        "save folder has one); exiting with 1 so that the launcher restarts the processes\n")
