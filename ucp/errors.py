"""Named errors. Every message names the file or parameter at fault and the fix."""


class UcpError(Exception):
    """Base class for every error ucp raises on bad input or a bad state on disk."""


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


class RendezvousError(UcpError):
    """The ranks of a job could not meet: no store of this rendezvous round was announced in time
    (`ucp.elastic.init_distributed`)."""
