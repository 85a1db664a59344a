"""Where the bytes of a checkpoint live, apart from what they mean (`ucp.format`): a location is a local `Path` or
an `ObjectPath` (`locations`, `object_path`); every read and write goes through one storage layer (`layer`), each
of whose functions is one call on the location's `Store` (`store`, the protocol every backend implements). The
stores: local files (`local`, over the positional file I/O of `fileio`) and every store reached by requests
(`remote`), over a backend module per scheme: `s3` (the only module that imports boto3) and `fsspec` (every other
protocol, the only module that imports fsspec), with the network policy they share (`net`).

It imports nothing of ucp but `ucp.errors`. The format reads and writes through `layer`, `locations`, `store` and
`fileio`, and never imports a backend (`local`, `remote`, `s3`, `fsspec`): tests/unit/test_architecture.py."""
