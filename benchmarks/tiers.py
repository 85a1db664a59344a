#!/usr/bin/env python
"""Benchmark: where checkpoints live — a local disk against S3 (moto's server on 127.0.0.1), issue #22.

    python benchmarks/tiers.py [--params 100] [--ranks 2] [--part-mib 8] [--in-flight 8] [--s3fs] [--crt]

Writes a synthetic ucp checkpoint of `--params` million parameters (fp32 weights and two Adam moments, so
12 bytes a parameter; `write_tensors`), then measures:

* save: the local write (`write_tensors`, CRC-32s included), and the upload of that committed folder to
  s3://bench/run (`ucp.convert.object_output.upload`: data objects multipart, parts in parallel, index last),
  which is what `ucp convert --output s3://` adds to a local conversion;
* load: each of `--ranks` simulated ZeRO ranks reads its run of every state (`ucp.format.box_read.read_boxes`,
  checked), from the local folder and from s3://; bytes and HTTP requests per rank (botocore's own events, each
  attempt counted), and MB/s. The local figure reads from the page cache (the folder was just written), so it
  is the upper bound of a local disk; the S3 one is moto's Python server on the same 2 cores.
* the choice of client, which the issue asks to make by measurement: rank 0's coalesced ranges read without
  checks by ucp's boto3 reader (`s3.read_many`), and with --s3fs (pip install s3fs) through s3fs's
  `cat_ranges`, with --crt (pip install awscrt) through the AWS CRT S3 client (every range one GET it splits
  into parts itself, all in flight at once); with --crt also the data files uploaded by the CRT client
  (multipart above the part size) against ucp's boto3 upload of the same files.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = (4096, 1024)  # one synthetic weight: 4M parameters


def write_checkpoint(folder: Path, params_m: int) -> int:
    from ucp.convert.tensors import write_tensors

    rng = np.random.default_rng(0)
    count = max(1, -(-params_m * 1_000_000 // (SHAPE[0] * SHAPE[1])))  # at least --params million
    tensors = {f"layers.{i}.weight": {s: rng.standard_normal(SHAPE, dtype=np.float32)
                                      for s in ("fp32", "exp_avg", "exp_avg_sq")} for i in range(count)}
    write_tensors(folder, tensors, optimizer={"type": "AdamW", "states": ["exp_avg", "exp_avg_sq"],
                                              "param_groups": [{"hyperparams": {"lr": 1e-4},
                                                                "params": list(tensors)}]}, step=1)
    return count


def rank_wants(index, rank: int, ranks: int) -> dict:
    """What ZeRO rank `rank` of `ranks` reads: its run of every state, flattened."""
    from ucp.format.box_read import BoxWant, full_box

    wants = {}
    for name, entry in index.params.items():
        for state, stored in entry.states.items():
            numel = int(np.prod(stored.shape))
            per = -(-numel // ranks)
            lo, hi = min(numel, rank * per), min(numel, (rank + 1) * per)
            wants[(name, state)] = BoxWant(stored, full_box(stored.shape), (lo, hi))
    return wants


class Requests:
    """HTTP requests (every attempt) and response bytes through ucp's boto3 client, from botocore's events."""

    def __init__(self) -> None:
        from ucp.storage import s3

        self.count = 0
        s3._client().meta.events.register("before-send.s3", self._sent)

    def _sent(self, **kwargs) -> None:
        self.count += 1


def load(root, index, ranks: int, requests: Requests | None) -> list[dict]:
    from ucp.format.box_read import read_boxes
    from ucp.storage.fileio import ReadCounter

    out = []
    for rank in range(ranks):
        counter, before = ReadCounter(), requests.count if requests else 0
        start = time.perf_counter()
        read_boxes(root, rank_wants(index, rank, ranks), index.chunk_bytes, counter)
        seconds = time.perf_counter() - start
        out.append({"rank": rank, "bytes": counter.bytes, "seconds": seconds, "reads": counter.calls,
                    "requests": (requests.count - before) if requests else 0})
    return out


def s3fs_rank0(url: str, index, ranks: int, endpoint: str) -> tuple[int, float]:
    """Rank 0's exact byte ranges (as ucp plans and coalesces them) read with s3fs's cat_ranges."""
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    ranges = rank0_ranges(index, ranks)
    start = time.perf_counter()
    data = fs.cat_ranges([f"{url}/{r.file}" for r in ranges], [r.begin for r in ranges], [r.end for r in ranges])
    return sum(len(d) for d in data), time.perf_counter() - start


def rank0_ranges(index, ranks: int) -> list:
    """Rank 0's byte ranges, as ucp plans and coalesces them."""
    from ucp.format.box_read import _plan
    from ucp.format.byte_ranges import coalesce

    return [r for r, _ in coalesce([_plan(k, w).range for k, w in rank_wants(index, 0, ranks).items()])]


def boto3_rank0(url, index, ranks: int) -> tuple[list[bytearray], float]:
    """Rank 0's ranges read by ucp's boto3 reader into buffers, without the checks `load` includes."""
    from ucp.storage import s3

    ranges = rank0_ranges(index, ranks)
    buffers = [bytearray(r.end - r.begin) for r in ranges]
    start = time.perf_counter()
    s3.read_many([(url / r.file, r.begin, memoryview(b)) for r, b in zip(ranges, buffers)])
    return buffers, time.perf_counter() - start


class Crt:
    """The AWS CRT S3 client (awscrt.s3.S3Client, what boto3's CRT transfer manager drives), path-style
    requests to the moto endpoint without TLS; credentials from the standard chain (the environment here)."""

    def __init__(self, host: str, port: int, part_bytes: int):
        from awscrt.auth import AwsCredentialsProvider
        from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
        from awscrt.s3 import S3Client, S3RequestTlsMode

        group = EventLoopGroup()
        bootstrap = ClientBootstrap(group, DefaultHostResolver(group))
        self.host = f"{host}:{port}"
        self.client = S3Client(bootstrap=bootstrap, region="us-east-1", tls_mode=S3RequestTlsMode.DISABLED,
                               credential_provider=AwsCredentialsProvider.new_default_chain(bootstrap),
                               part_size=part_bytes, multipart_upload_threshold=part_bytes)

    def _request(self, method: str, key: str, headers: list, **kwargs):
        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.s3 import S3RequestType

        kind = S3RequestType.GET_OBJECT if method == "GET" else S3RequestType.PUT_OBJECT
        request = HttpRequest(method, f"/{key}", HttpHeaders([("Host", self.host), *headers]))
        return self.client.make_request(type=kind, request=request, **kwargs)

    def read_rank0(self, bucket_key: str, index, ranks: int) -> tuple[list[bytearray], float]:
        ranges = rank0_ranges(index, ranks)
        buffers = [bytearray(r.end - r.begin) for r in ranges]

        def filler(buffer: bytearray, begin: int):
            def on_body(chunk, offset, **kwargs) -> None:  # offset: in the object, not the range
                buffer[offset - begin:offset - begin + len(chunk)] = chunk
            return on_body

        start = time.perf_counter()
        requests = [self._request("GET", f"{bucket_key}/{r.file}", [("Range", f"bytes={r.begin}-{r.end - 1}")],
                                  on_body=filler(buffer, r.begin)) for r, buffer in zip(ranges, buffers)]
        for request in requests:
            request.finished_future.result()
        return buffers, time.perf_counter() - start

    def upload(self, folder: Path, bucket_key: str, names) -> float:
        start = time.perf_counter()
        requests = [self._request("PUT", f"{bucket_key}/{name}",
                                  [("Content-Length", str((folder / name).stat().st_size)),
                                   ("Content-Type", "application/octet-stream")], send_filepath=str(folder / name))
                    for name in names]
        for request in requests:
            request.finished_future.result()
        return time.perf_counter() - start


def check_same(client, bucket: str, key: str, reference: Path) -> None:
    """The object a client uploaded holds the local file's bytes (a benchmark that moved wrong bytes is void)."""
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    if body != reference.read_bytes():
        raise SystemExit(f"s3://{bucket}/{key}: differs from {reference} after the upload")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=100, help="millions of parameters (default 100)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--part-mib", type=int, default=8)
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument("--s3fs", action="store_true", help="also read rank 0's ranges with s3fs")
    p.add_argument("--crt", action="store_true", help="also read rank 0's ranges and upload the data files with "
                                                      "the AWS CRT S3 client (awscrt)")
    args = p.parse_args()
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", UCP_S3_PART_BYTES=str(args.part_mib << 20),
                      UCP_S3_MAX_IN_FLIGHT=str(args.in_flight))
    import boto3

    from ucp.convert.object_output import upload
    from ucp.format.folder import read_index
    from ucp.storage.locations import location

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    try:
        with tempfile.TemporaryDirectory(prefix="ucp-tiers-") as tmp:
            folder = Path(tmp) / "run"
            start = time.perf_counter()
            count = write_checkpoint(folder, args.params)
            local_save = time.perf_counter() - start
            index = read_index(folder)
            total = sum(f.nbytes for f in index.files.values())
            requests = Requests()
            url = location("s3://bench/run")
            start = time.perf_counter()
            upload(folder, url, index)
            s3_save, save_requests = time.perf_counter() - start, requests.count
            mb = total / 1e6
            print(f"checkpoint: {count * SHAPE[0] * SHAPE[1] / 1e6:.0f}M parameters, {mb:.0f} MB in "
                  f"{len(index.files)} data files; parts of {args.part_mib} MiB, {args.in_flight} in flight")
            print(f"save  local disk : {local_save:6.2f} s  {mb / local_save:7.1f} MB/s (write_tensors, CRC-32s)")
            print(f"save  s3 upload  : {s3_save:6.2f} s  {mb / s3_save:7.1f} MB/s  {save_requests} requests")
            s3_index = read_index(url)
            for name, root, counted in (("local disk", folder, None), ("s3", url, requests)):
                for r in load(root, s3_index if root is url else index, args.ranks, counted):
                    print(f"load  {name:<11}: rank {r['rank']}: {r['bytes'] / 1e6:7.1f} MB in {r['seconds']:6.2f} s "
                          f"{r['bytes'] / 1e6 / r['seconds']:7.1f} MB/s, {r['reads']} coalesced reads, "
                          f"{r['requests']} requests")
            if args.s3fs or args.crt:
                read, seconds = boto3_rank0(url, index, args.ranks)
                nbytes = sum(len(b) for b in read)
                print(f"load  boto3      : rank 0: {nbytes / 1e6:7.1f} MB in {seconds:6.2f} s "
                      f"{nbytes / 1e6 / seconds:7.1f} MB/s (ucp's read_many, no checks)")
            if args.s3fs:
                nbytes, seconds = s3fs_rank0("s3://bench/run", index, args.ranks, endpoint)
                print(f"load  s3fs       : rank 0: {nbytes / 1e6:7.1f} MB in {seconds:6.2f} s "
                      f"{nbytes / 1e6 / seconds:7.1f} MB/s (cat_ranges, no checks)")
            if args.crt:
                crt = Crt(host, port, args.part_mib << 20)
                crt_read, seconds = crt.read_rank0("bench/run", index, args.ranks)
                if crt_read != read:
                    raise SystemExit("the CRT client read other bytes than boto3 for rank 0's ranges")
                print(f"load  crt        : rank 0: {nbytes / 1e6:7.1f} MB in {seconds:6.2f} s "
                      f"{nbytes / 1e6 / seconds:7.1f} MB/s (awscrt S3Client, no checks)")
                names = sorted(index.files)
                seconds = crt.upload(folder, "bench/crt", names)
                check_same(boto3.client("s3", endpoint_url=endpoint), "bench", f"crt/{names[0]}", folder / names[0])
                data_mb = sum(index.files[n].nbytes for n in names) / 1e6
                print(f"save  crt upload : {seconds:6.2f} s  {data_mb / seconds:7.1f} MB/s (data files only; "
                      f"boto3's upload above also writes the index)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
