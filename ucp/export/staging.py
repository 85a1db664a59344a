"""Where an export is written: a hidden folder beside the output, renamed onto it as the last step.

The rename is the commit point (as DCP's metadata rename and Orbax's finalize are): an export
that fails or fills the disk leaves nothing; one that is killed leaves at most an empty folder under
the output's name and the hidden `.<name>.partial` (removed by the next export to the same output).
While it writes, an export holds the output folder locked (`writing_alone`), so a second export to
the same output is refused instead of removing the first one's files.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ucp.errors import ExportError, OutputExistsError
from ucp.format.folder import fsync_dir
from ucp.storage.fileio import writing_alone
from ucp.storage.layer import abort_uploads, is_remote, list_folders, list_names, upload_file
from ucp.storage.locations import Location, ObjectPath

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or "5GB" / "500MB" / "2GiB" (GB = 10**9 bytes, as transformers reads it)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size, re.IGNORECASE)
    if m is None or float(m.group(1)) <= 0:
        raise ExportError(f"--max-shard-size {size!r}: expected a positive size such as 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def check_output(output: Path) -> None:
    """Refuse an output that exists, unless it is an empty folder."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise OutputExistsError(f"{output}: already exists; choose a new --output or remove it first")


@contextmanager
def staged_output(output: Location, last: str) -> Iterator[Path]:
    """A fresh hidden folder beside `output` to write into; renamed to `output` when the body returns. For an
    s3:// `output`, a local staging folder uploaded when the body returns, file `last` (the one a reader opens
    first) after every other, so an export cut short is not taken for a complete one."""
    if is_remote(output):
        with _staged_upload(output, last) as staging:
            yield staging
        return
    check_output(output)
    created = not output.exists()
    with writing_alone(output):  # creates the output as an empty folder, the commit replaces it
        check_output(output)  # another export may have committed between the check and the lock
        try:
            yield from _staged(output)
        except BaseException:
            if created:
                with contextlib.suppress(OSError):
                    output.rmdir()  # the empty folder the lock made (a commit never fails after its rename)
            raise


@contextmanager
def _staged_upload(output: ObjectPath, last: str) -> Iterator[Path]:
    if list_names(output) or list_folders(output):
        raise OutputExistsError(f"{output}: already holds objects; choose a new --output or remove them first (an "
                                f"export cut short leaves its files without {last})")
    abort_uploads(output)  # the open uploads of an export killed outright
    with tempfile.TemporaryDirectory(prefix="ucp-export-", dir=os.environ.get("UCP_STAGING_DIR")) as staging:
        yield Path(staging)
        names = sorted(p.name for p in Path(staging).iterdir() if p.name != last)
        for name in [*names, last]:
            upload_file(Path(staging) / name, output / name)


def _staged(output: Path) -> Iterator[Path]:
    staging = output.parent / f".{output.name}.partial"
    if staging.exists():  # left by an export that was killed
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        yield staging
        fsync_dir(staging)
        os.replace(staging, output)  # replaces an empty folder too
        fsync_dir(output.parent)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if exc.errno in _FULL:  # an OSError still, so that the CLI says the system refused (exit 3)
            raise OSError(exc.errno, f"{os.strerror(exc.errno).lower()} while writing {exc.filename or 'the export'} "
                                     "(nothing was exported)", str(output)) from None
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
