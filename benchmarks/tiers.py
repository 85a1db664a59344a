#!/usr/bin/env python
"""Benchmark: where checkpoints live — a local disk against S3 (moto's server on 127.0.0.1), issue #22.

    python benchmarks/tiers.py [--params 100] [--ranks 2] [--part-mib 8] [--in-flight 8] [--s3fs]

Writes a synthetic ucp checkpoint of `--params` million parameters (fp32 weights and two Adam moments, so
12 bytes a parameter; `write_tensors`), then measures:

* save: the local write (`write_tensors`, CRC-32s included), and the upload of that committed folder to
  s3://bench/run (`ucp.convert.object_output.upload`: data objects multipart, parts in parallel, index last),
  which is what `ucp convert --output s3://` adds to a local conversion;
* load: each of `--ranks` simulated ZeRO ranks reads its run of every state (`ucp.format.box_read.read_boxes`,
  checked), from the local folder and from s3://; bytes and HTTP requests per rank (botocore's own events, each
  attempt counted), and MB/s. The local figure reads from the page cache (the folder was just written), so it
  is the upper bound of a local disk; the S3 one is moto's Python server on the same 2 cores.
* with --s3fs (pip install s3fs): the same ranges of rank 0 read through s3fs's `cat_ranges`, for the choice of
  client the issue asks to make by measurement.
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
    count = max(1, params_m * 1_000_000 // (SHAPE[0] * SHAPE[1]))
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
        from ucp.format import object_store

        self.count = 0
        object_store._client().meta.events.register("before-send.s3", self._sent)

    def _sent(self, **kwargs) -> None:
        self.count += 1


def load(root, index, ranks: int, requests: Requests | None) -> list[dict]:
    from ucp.format.box_read import read_boxes
    from ucp.format.fileio import ReadCounter

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

    from ucp.format.box_read import _plan
    from ucp.format.byte_ranges import coalesce

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    ranges = [r for r, _ in coalesce([_plan(k, w).range for k, w in rank_wants(index, 0, ranks).items()])]
    start = time.perf_counter()
    data = fs.cat_ranges([f"{url}/{r.file}" for r in ranges], [r.begin for r in ranges], [r.end for r in ranges])
    return sum(len(d) for d in data), time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=100, help="millions of parameters (default 100)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--part-mib", type=int, default=8)
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument("--s3fs", action="store_true", help="also read rank 0's ranges with s3fs")
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
    from ucp.format.locations import location

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
            if args.s3fs:
                nbytes, seconds = s3fs_rank0("s3://bench/run", index, args.ranks, endpoint)
                print(f"load  s3fs       : rank 0: {nbytes / 1e6:7.1f} MB in {seconds:6.2f} s "
                      f"{nbytes / 1e6 / seconds:7.1f} MB/s (cat_ranges, no checks)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
