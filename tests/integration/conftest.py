"""Integration-tier set-up: DeepSpeed's CPU ops are built before the first job; `s3`, an S3 server for the
tests that read and write object storage."""
import os
from types import SimpleNamespace

import pytest

from support.launch import build_deepspeed_ops
from support.s3_proxy import BUCKET, PART_BYTES, S3Proxy


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops(tmp_path_factory) -> None:
    """Build DeepSpeed's CPU ops once, in one process (see build_deepspeed_ops for why)."""
    build_deepspeed_ops(tmp_path_factory.mktemp("ops") / "build.log")


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server and the proxy in front of it, both on 127.0.0.1, with bucket BUCKET; the environment
    points clients (this process and its children: CLI runs, torchrun ranks) at the proxy. The test extra
    brings boto3 and moto[server]: a missing one fails the tests that use this, it does not skip them."""
    import logging

    import boto3
    import moto.s3.models
    import moto.server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request otherwise
    patch = pytest.MonkeyPatch()
    patch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", PART_BYTES)  # AWS's is 5 MiB, too big for tiny files
    server = moto.server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    proxy = S3Proxy(host, port).start()
    env = {"AWS_ENDPOINT_URL": proxy.url, "AWS_ACCESS_KEY_ID": "test-key-id", "AWS_SECRET_ACCESS_KEY": "test-secret",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
           "UCP_S3_PART_BYTES": str(PART_BYTES)}
    for key, value in env.items():
        patch.setenv(key, value)
    patch.delenv("AWS_PROFILE", raising=False)
    direct = boto3.client("s3", endpoint_url=f"http://{host}:{port}")  # the test's own view, past the proxy
    direct.create_bucket(Bucket=BUCKET)
    try:
        yield SimpleNamespace(proxy=proxy, client=direct, endpoint=f"http://{host}:{port}")
    finally:
        proxy.stop()
        server.stop()
        patch.undo()
