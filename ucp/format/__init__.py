"""The atomic checkpoint format on disk: the typed index, safetensors streaming, checksums, file I/O,
split-major storage, and the checked reads that every loader shares (docs/ARCHITECTURE.md)."""
