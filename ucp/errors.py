"""Named errors. Every message names the file or parameter at fault and the fix, and never a credential: a URL
in a message is shown as `redact` shows it (also `ObjectPath`'s `str`, the CLI's lines, an index's source).

A URL can hold credentials in its user info (`s3://KEY:SECRET@bucket/x`, `http://user:SECRET@host/x`) and in
its query (a signed URL's `X-Amz-Signature`, `X-Amz-Credential`, `X-Amz-Security-Token`; Azure's `sig`; generic
`token`, `signature`, `key`, `password` parameters). Those are replaced by `***`; everything else, the part that
tells the user which file is meant, stays.
"""
from __future__ import annotations

import re

MASK = "***"
# scheme://USERINFO@ : the user info runs to the netloc's last "@" (a password may hold an unescaped "@").
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")
# ?NAME=VALUE or &NAME=VALUE where NAME says it is a secret; the value runs to the next parameter or space.
_SECRET_PARAM = re.compile(r"([?&;][^=&?#;\s]*(?:sig|token|credential|secret|passw|pwd|key|auth)[^=&?#;\s]*=)"
                           r"[^&#;\s]*", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` (a URL, or a message naming any number of them) with every URL's user info and secret query
    values replaced by `***`. Text without a URL comes back unchanged."""
    if "://" not in text and "?" not in text:
        return text
    return _SECRET_PARAM.sub(lambda m: m.group(1) + MASK, _USERINFO.sub(lambda m: m.group(1) + MASK + "@", text))


class UcpError(Exception):
    """Base class for every error ucp raises on bad input or a bad state on disk. Its message is redacted as it
    is made, whoever wrote it (a URL quoted as the user typed it included)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class CheckpointNotFoundError(UcpError):
    """The path holds no checkpoint ucp can read (missing tag, missing files)."""


class CorruptCheckpointError(UcpError):
    """A file exists but its contents are truncated, damaged or inconsistent."""


class IncompleteCheckpointError(UcpError):
    """A ucp directory has no committed index: a conversion or save never finished."""


class AmbiguousPatternError(UcpError):
    """A parameter's distribution pattern cannot be decided from what the checkpoint records."""


class OutputExistsError(UcpError):
    """The output directory already holds a different checkpoint."""


class UnsupportedLayoutError(UcpError):
    """The checkpoint uses a layout this version of ucp does not convert."""


class UnsupportedStorageError(UcpError):
    """A location ucp cannot read or write: an object-storage URL (s3://, gs://, ...) where a local path goes."""


class StorageAccessError(UcpError):
    """An object store refused or failed a request: no or wrong credentials, a missing bucket, an unreachable
    endpoint, or errors that outlasted the retries."""


class SaveError(UcpError):
    """An asynchronous save did not commit; the previous checkpoint stays the latest."""


class ConfigError(UcpError):
    """The "ucp" section of a DeepSpeed config has a missing or bad key."""


class ExportError(UcpError):
    """An export cannot be written: its tensors do not fit the model, or the output's disk filled up."""


class CheckpointMismatchError(UcpError):
    """The checkpoint does not fit the model or optimizer it is being loaded into (the DeepSpeed hook,
    `ucp.hmp.load_slices`)."""

    @classmethod
    def shape(cls, name: str, saved: object, model: object, checkpoint: object) -> CheckpointMismatchError:
        """Parameter `name` has shape `saved` in `checkpoint` and `model` in the model: named with the likely cause."""
        return cls(f"{name}: the checkpoint holds shape {saved}, the model {model} ({checkpoint}); was it saved from "
                   "another model or configuration (sizes, vocabulary, tied weights)? Build the model it trained")


class RendezvousError(UcpError):
    """The ranks of a job could not meet: no store of this rendezvous round was announced in time
    (`ucp.elastic.init_distributed`)."""
