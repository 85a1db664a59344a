"""S3-compatible object storage through boto3, the only module that imports it (on first use of an s3:// URL).

Credentials and the endpoint come from the standard AWS chain (environment, `AWS_ENDPOINT_URL`, config files,
instance roles); they are never logged, nor put into an error or an index (an s3:// URL carrying some is refused:
`locations`). Every request has the connect and read timeouts of `net.timeout_s()` and goes through ucp's network
policy (`net.retrying`; botocore's own retries are off, as they give a silent endpoint the patience of a throttled
one): throttling (503 SlowDown), 5xx answers and cut connections are tried `net.attempts()` times, no answer
`net.timeout_attempts()` times, with botocore's standard backoff between; a body cut or stalled halfway is asked
for again from where it stopped (`net.fill`). Reads are ranged
GETs, each range cut into parts of `part_bytes()` that run concurrently, at most `max_in_flight()` at once per process;
uploads of more than that are multipart, their parts in parallel, and a failed one is aborted so that
no parts are left behind.
"""
from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ucp.errors import CorruptCheckpointError, StorageAccessError, UcpError
from ucp.storage import net
from ucp.storage.fileio import oversized
from ucp.storage.object_path import ObjectPath

PART_BYTES = 8 << 20  # ranged GETs and multipart parts are cut this large, unless $UCP_S3_PART_BYTES says
_ACCESS_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                 "InvalidToken", "AllAccessDisabled", "AuthorizationHeaderMalformed"}
_OPENING_BUCKET = "opening its bucket"
_MISSING_KEY_CODES = {"NoSuchKey", "404", "NotFound"}
# What botocore's standard retry mode retries besides connection errors (botocore.retries.standard).
_RETRY_CODES = {"RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete", "Throttling",
                "ThrottlingException", "ThrottledException", "RequestThrottledException", "TooManyRequestsException",
                "ProvisionedThroughputExceededException", "TransactionInProgressException", "RequestLimitExceeded",
                "BandwidthLimitExceeded", "LimitExceededException", "RequestThrottled", "SlowDown",
                "EC2ThrottledException"}
_RETRY_STATUS = {429, 500, 502, 503, 504}
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/")
_lock = threading.Lock()
# One client and pool per process (a forked worker makes its own) and per endpoint and credentials in the
# environment (and network settings), so a process that changes them gets a new client.
_state: dict[tuple[object, ...], tuple[Any, ThreadPoolExecutor]] = {}
T = TypeVar("T")


def max_in_flight() -> int:
    """How many requests a process has in flight at most ($UCP_S3_MAX_IN_FLIGHT, default 8)."""
    return max(1, int(os.environ.get("UCP_S3_MAX_IN_FLIGHT", "8")))


def part_bytes() -> int:
    """How large ranged GETs and multipart parts are cut ($UCP_S3_PART_BYTES, default 8 MiB; AWS takes parts of
    at least 5 MiB but the last)."""
    return max(1, int(os.environ.get("UCP_S3_PART_BYTES", PART_BYTES)))


def _client_and_pool() -> tuple[Any, ThreadPoolExecutor]:
    with _lock:
        env = os.environ.get
        key = (os.getpid(), env("AWS_ENDPOINT_URL"), env("AWS_ACCESS_KEY_ID"), env("AWS_PROFILE"), net.timeout_s())
        if key not in _state:
            import boto3
            from botocore.config import Config

            rank = os.environ.get("RANK")
            config = Config(retries={"mode": "standard", "max_attempts": 1},  # retried by `_call` (`net`)
                            connect_timeout=net.timeout_s(), read_timeout=net.timeout_s(),
                            max_pool_connections=max_in_flight(),
                            user_agent_extra="ucp" + (f" ucp-rank/{rank}" if rank is not None else ""),
                            # ucp checks every byte against its own CRC-32s; no second checksum per request
                            request_checksum_calculation="when_required",
                            response_checksum_validation="when_required")
            client = boto3.session.Session().client("s3", config=config)
            _state[key] = (client, ThreadPoolExecutor(max_in_flight(), thread_name_prefix="ucp-s3"))
        return _state[key]


def _client() -> Any:
    return _client_and_pool()[0]


def _error(exc: Exception, path: ObjectPath, doing: str) -> UcpError:
    """One line naming `path` and the fix for a failed request; never the credentials (nor the request's text,
    which can carry the access key id)."""
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    chain = ("give credentials for the bucket through the standard AWS chain (AWS_ACCESS_KEY_ID and "
             "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/credentials or an instance role)")
    if isinstance(exc, NoCredentialsError):
        return StorageAccessError(f"{path}: no AWS credentials found while {doing}; {chain}")
    if isinstance(exc, (ReadTimeoutError, ConnectTimeoutError, ConnectionClosedError)):  # after `net`'s retries
        return net.gave_up(path, doing, exc)
    if isinstance(exc, EndpointConnectionError):
        return StorageAccessError(f"{path}: cannot reach the object store while {doing}; check AWS_ENDPOINT_URL "
                                  "(or the AWS config's endpoint_url) and the network")
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", "?"))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
        if code == "NoSuchBucket" or doing == _OPENING_BUCKET and status == 404:  # a HEAD's 404 has no code
            return StorageAccessError(f"{path}: bucket '{path.bucket}' does not exist; create it, or correct the "
                                      "URL (and AWS_ENDPOINT_URL if the store is not AWS)")
        if code in _ACCESS_CODES or status == 403:
            return StorageAccessError(f"{path}: access refused ({code}) while {doing}; {chain}")
        return StorageAccessError(f"{path}: {doing} failed ({code}, HTTP {status}); check the object store, then "
                                  "run the command again")
    return StorageAccessError(f"{path}: {doing} failed ({type(exc).__name__}); check the object store and "
                              "the network, then run the command again")


def _retryable(exc: BaseException) -> bool:
    """What botocore's standard mode would retry: a connection that failed, was cut or got no answer; throttling
    and server errors."""
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in _RETRY_CODES or status in _RETRY_STATUS
    return isinstance(exc, (BotoConnectionError, HTTPClientError))


def _call(path: ObjectPath, doing: str, request: Callable[[], T]) -> T:
    """`request()` under the network policy (`net.retrying`); a failure as one line."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return net.retrying(path, doing, request, _retryable)
    except (BotoCoreError, ClientError) as exc:
        raise _error(exc, path, doing) from None


def _missing(exc: Exception) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(exc, ClientError) and str(exc.response.get("Error", {}).get("Code")) in _MISSING_KEY_CODES


def size(path: ObjectPath) -> int | None:
    """The object's size, or None when there is no such object (a missing bucket raises)."""
    head = _unless_missing(path, "reading its size",
                           lambda: _client().head_object(Bucket=path.bucket, Key=path.key))
    return None if head is None else int(head["ContentLength"])


def _unless_missing(path: ObjectPath, doing: str, request: Callable[[], T]) -> T | None:
    """`request()`, or None when the object it asks for does not exist (a missing bucket raises its one line)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return net.retrying(path, doing, request, _retryable)
    except ClientError as exc:
        if _missing(exc):
            _check_bucket(path)
            return None
        raise _error(exc, path, doing) from None
    except BotoCoreError as exc:
        raise _error(exc, path, doing) from None


def _check_bucket(path: ObjectPath) -> None:
    """Raise the one-line error of a missing or refused bucket (a HEAD of a missing key does not say which)."""
    _call(path, _OPENING_BUCKET, lambda: _client().head_bucket(Bucket=path.bucket))


def read_object(path: ObjectPath, limit: int | None = None) -> bytes | None:
    """The whole object (refused unread when larger than `limit`: its size comes with the answer's headers,
    before its body), or None when there is none. A body cut short is asked for again from where it stopped."""
    got = _unless_missing(path, "reading it", lambda: _client().get_object(Bucket=path.bucket, Key=path.key))
    if got is None:
        return None
    nbytes = int(got["ContentLength"])
    if limit is not None and nbytes > limit:
        got["Body"].close()
        raise oversized(path, nbytes, limit)
    data = bytearray(nbytes)
    first = [got["Body"]]

    def request(begin: int, end: int) -> Iterator[bytes]:
        return _chunks(first.pop()) if first else _ranged_body(path, begin, end)

    net.fill(path, memoryview(data), 0, request, _transient)
    return bytes(data)


def _ranged_body(path: ObjectPath, begin: int, end: int) -> Iterator[bytes]:
    """The body of one ranged GET of bytes [begin, end), in chunks. A store that ignores the range, or an object
    that ends before `end`, is refused; a body that is cut or stalls ends the chunks early (`net.fill` asks for
    the rest)."""
    got = _call(path, f"reading bytes [{begin}, {end})",
                lambda: _client().get_object(Bucket=path.bucket, Key=path.key, Range=f"bytes={begin}-{end - 1}"))
    answered = _CONTENT_RANGE.match(str(got.get("ContentRange", "")))
    if answered is None or int(answered.group(1)) != begin:
        got["Body"].close()
        raise StorageAccessError(f"{path}: the object store ignores Range requests (it answered a ranged read of "
                                 f"bytes [{begin}, {end}) with other bytes); use an S3-compatible store that serves "
                                 "them")
    if int(answered.group(2)) + 1 < end:
        got["Body"].close()
        raise CorruptCheckpointError(f"{path}: ends at byte {int(answered.group(2)) + 1}, expected at least {end}; "
                                     "the object is truncated, upload it again")
    return _chunks(got["Body"])


def _chunks(body: Any) -> Iterator[bytes]:
    """The chunks of a response body as they arrive, the body closed at the end (or when abandoned)."""
    try:
        while data := body.read(1 << 20):
            yield data
    finally:
        body.close()


def _transient(exc: BaseException) -> bool:
    """Whether a body read failed on the way (cut, reset, stalled past the read timeout), not on the object."""
    from botocore.exceptions import (
        ConnectionClosedError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )
    from urllib3.exceptions import HTTPError as Urllib3Error

    return isinstance(exc, (IncompleteReadError, ResponseStreamingError, ReadTimeoutError, ConnectionClosedError,
                            Urllib3Error, ConnectionError, TimeoutError))


def _get_range(path: ObjectPath, view: memoryview, offset: int) -> None:
    """Fill `view` with bytes [offset, offset + len(view)) of the object by ranged GETs: one, and one more for
    what is missing each time a body is cut (`net.fill`)."""
    net.fill(path, view, offset, lambda begin, end: _ranged_body(path, begin, end), _transient)


def stat(path: ObjectPath) -> tuple[int, int | None] | None:
    """The object's size and modification time (ns) from one HEAD, or None when there is no such object."""
    head = _unless_missing(path, "reading its size", lambda: _client().head_object(Bucket=path.bucket, Key=path.key))
    if head is None:
        return None
    return int(head["ContentLength"]), int(head["LastModified"].timestamp() * 1_000_000_000)


def cut_parts(nbytes: int) -> Iterator[tuple[int, int]]:
    """[begin, end) of each part of `nbytes` bytes, cut at `part_bytes()` (also the fsspec backend's reads)."""
    step = part_bytes()
    for begin in range(0, nbytes, step):
        yield begin, min(nbytes, begin + step)


def read_many(reads: Sequence[tuple[ObjectPath, int, memoryview]]) -> None:
    """Fill each (object, offset, buffer): every range cut into parts, all parts concurrently (bounded)."""
    pool = _client_and_pool()[1]
    jobs = [pool.submit(_get_range, path, view[lo:hi], offset + lo)
            for path, offset, view in reads for lo, hi in cut_parts(len(view))]
    wait_all(jobs)


def wait_all(jobs: list[Future[Any]]) -> list[Any]:
    """The results of `jobs`, in order; the first failure is raised once all have ended (none left running). The
    jobs not yet started when one fails are cancelled: a store that stopped answering is not asked again by every
    queued part, each waiting its own timeouts."""
    failure = None
    results = []
    for job in jobs:
        try:
            results.append(job.result())
        except BaseException as exc:  # noqa: BLE001  # raised below, once every job has ended
            if failure is None:
                for queued in jobs:
                    queued.cancel()
            failure = failure or exc
    if failure is not None:
        raise failure
    return results


def list_names(folder: ObjectPath) -> list[str]:
    """The names of the objects directly under prefix `folder`."""
    prefix = f"{folder.key}/" if folder.key else ""
    pages = _client().get_paginator("list_objects_v2").paginate(Bucket=folder.bucket, Prefix=prefix, Delimiter="/")
    names: list[str] = []
    for page in _call(folder, "listing it", lambda: list(pages)):
        names += [item["Key"][len(prefix):] for item in page.get("Contents", [])]
    return names


def put_bytes(path: ObjectPath, data: bytes) -> None:
    _call(path, "writing it", lambda: _client().put_object(Bucket=path.bucket, Key=path.key, Body=data))


def delete(path: ObjectPath) -> None:
    _call(path, "deleting it", lambda: _client().delete_object(Bucket=path.bucket, Key=path.key))


def list_folders(folder: ObjectPath) -> list[str]:
    """The names of the sub-prefixes directly under prefix `folder` (the "folders" a listing with "/" shows)."""
    prefix = f"{folder.key}/" if folder.key else ""
    pages = _client().get_paginator("list_objects_v2").paginate(Bucket=folder.bucket, Prefix=prefix, Delimiter="/")
    names: list[str] = []
    for page in _call(folder, "listing it", lambda: list(pages)):
        names += [item["Prefix"][len(prefix):].rstrip("/") for item in page.get("CommonPrefixes", [])]
    return names


def remove_folder(folder: ObjectPath) -> None:
    """Nothing: a prefix is gone with its last object (S3 has no folders)."""


def list_tree(folder: ObjectPath) -> list[str]:
    """The names, relative to prefix `folder` ("a/b"), of every object under it at any depth."""
    prefix = f"{folder.key}/" if folder.key else ""
    pages = _client().get_paginator("list_objects_v2").paginate(Bucket=folder.bucket, Prefix=prefix)
    return [item["Key"][len(prefix):] for page in _call(folder, "listing it", lambda: list(pages))
            for item in page.get("Contents", [])]


def copy(source: ObjectPath, target: ObjectPath) -> None:
    """Copy an object inside the store (server side; multipart when large)."""
    _call(source, f"copying it to {target}",
          lambda: _client().copy({"Bucket": source.bucket, "Key": source.key}, target.bucket, target.key))


def start_upload(path: ObjectPath) -> str:
    """Open a multipart upload of `path`; its id (the object appears only once `complete_upload` is called)."""
    return str(_call(path, "starting a multipart upload",
                     lambda: _client().create_multipart_upload(Bucket=path.bucket, Key=path.key))["UploadId"])


def upload_parts(source: Path, path: ObjectPath, upload: str, parts: Sequence[tuple[int, int, int]]
                 ) -> list[dict[str, Any]]:
    """Upload each (part number, begin, end) of local file `source` as that part of `upload`, in parallel;
    the parts' {"PartNumber", "ETag"} for `complete_upload`."""
    pool = _client_and_pool()[1]
    return wait_all([pool.submit(_upload_part, source, path, upload, number, lo, hi) for number, lo, hi in parts])


def complete_upload(path: ObjectPath, upload: str, parts: Sequence[dict[str, Any]]) -> None:
    ordered = sorted(parts, key=lambda p: int(p["PartNumber"]))
    _call(path, "completing its multipart upload",
          lambda: _client().complete_multipart_upload(Bucket=path.bucket, Key=path.key, UploadId=upload,
                                                      MultipartUpload={"Parts": ordered}))


def abort_upload(path: ObjectPath, upload: str) -> None:
    _call(path, "aborting its multipart upload",
          lambda: _client().abort_multipart_upload(Bucket=path.bucket, Key=path.key, UploadId=upload))


def upload_file(source: Path, path: ObjectPath) -> None:
    """Upload `source` to `path`; a file of more than `part_bytes()` goes up as a multipart upload, its parts in
    parallel, completed only when every part is up and aborted on any failure (no orphaned parts)."""
    nbytes = source.stat().st_size
    if nbytes <= part_bytes():
        put_bytes(path, source.read_bytes())
        return
    client, pool = _client_and_pool()
    upload = _call(path, "starting a multipart upload",
                   lambda: client.create_multipart_upload(Bucket=path.bucket, Key=path.key))["UploadId"]
    try:
        jobs = [pool.submit(_upload_part, source, path, upload, number, lo, hi)
                for number, (lo, hi) in enumerate(cut_parts(nbytes), start=1)]
        parts = wait_all(jobs)
        _call(path, "completing its multipart upload",
              lambda: client.complete_multipart_upload(Bucket=path.bucket, Key=path.key, UploadId=upload,
                                                       MultipartUpload={"Parts": parts}))
    except BaseException:
        try:
            client.abort_multipart_upload(Bucket=path.bucket, Key=path.key, UploadId=upload)
        except Exception:  # noqa: BLE001  # the upload's own error says what went wrong; a bucket lifecycle rule
            pass           # (AbortIncompleteMultipartUpload) removes what an abort that fails too leaves
        raise


def abort_uploads(prefix: ObjectPath) -> int:
    """Abort the multipart uploads open under `prefix` (what a writer killed outright leaves); how many."""
    client = _client()
    got = _call(prefix, "listing its open uploads",
                lambda: client.list_multipart_uploads(Bucket=prefix.bucket,
                                                      Prefix=f"{prefix.key}/" if prefix.key else ""))
    uploads = got.get("Uploads", [])
    for u in uploads:
        _call(prefix, "aborting an open upload",
              lambda: client.abort_multipart_upload(Bucket=prefix.bucket, Key=u["Key"], UploadId=u["UploadId"]))
    return len(uploads)


def _upload_part(source: Path, path: ObjectPath, upload: str, number: int, lo: int, hi: int) -> dict[str, Any]:
    with open(source, "rb") as f:
        data = os.pread(f.fileno(), hi - lo, lo)
    got = _call(path, f"uploading part {number}",
                lambda: _client().upload_part(Bucket=path.bucket, Key=path.key, UploadId=upload,
                                              PartNumber=number, Body=data))
    return {"PartNumber": number, "ETag": got["ETag"]}
