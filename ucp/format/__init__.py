"""What the bytes of a checkpoint mean: the typed index, safetensors streaming, checksums, boxes and split-major
storage, dtypes, the folder's commit, and the checked reads that every loader shares (docs/ARCHITECTURE.md).
Where the bytes live is `ucp.storage`'s: the format reads and writes through its layer and never imports a
backend."""
