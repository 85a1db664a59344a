"""Where an asynchronous save puts every byte: each data file's header and each tensor's byte range.

Every rank knows every tensor's name, shape and stored dtype, so every rank computes the same
arrangement without talking, then writes the elements it holds straight to their final offsets in the
shared data files (ranks write disjoint byte ranges). Rank 0 combines the per-piece CRCs the ranks
report into each whole tensor's CRC-32 (`whole_crcs`), then commits the index.

Callers pass the tensors state-major (every `fp32`, then each optimizer moment, then frozen weights
and buffers), each state in the engine's flat parameter order: then the run of a flat ZeRO-1/2
partition a rank holds lands in one contiguous byte range and goes out in one large write.

Pure: no I/O.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ucp.errors import SaveError
from ucp.format.crc import CHUNK_BYTES, join_segments
from ucp.format.folder import data_file_name
from ucp.format.safetensors_stream import TensorSlot, encode_header


@dataclass(frozen=True)
class SaveFile:
    name: str
    header: bytes  # written at offset 0 by one rank
    size: int      # bytes of the whole file


@dataclass(frozen=True)
class Span:
    """Bytes [begin, end) of `file` hold one whole tensor."""

    file: str
    begin: int
    end: int


@dataclass(frozen=True)
class SaveFiles:
    files: tuple[SaveFile, ...]
    spans: dict[str, Span]  # safetensors key -> where the tensor lies

    def piece(self, key: str, start: int, numel: int, itemsize: int) -> Span:
        """Where elements [start, start + numel) of the flattened tensor `key` lie."""
        whole = self.spans[key]
        begin = whole.begin + start * itemsize
        end = begin + numel * itemsize
        if start < 0 or end > whole.end:
            raise ValueError(f"{key}: elements [{start}, {start + numel}) lie outside the tensor "
                             f"({(whole.end - whole.begin) // itemsize} elements)")
        return Span(whole.file, begin, end)


def arrange_files(slots: Sequence[TensorSlot], max_file_bytes: int,
                metadata: dict[str, str] | None = None) -> SaveFiles:
    """Pack `slots` in order into data files of about `max_file_bytes` each (at least one tensor per file)."""
    if not slots:
        raise ValueError("a checkpoint needs at least one tensor")
    bundles: list[list[TensorSlot]] = [[]]
    size = 0
    for slot in slots:
        if bundles[-1] and size + slot.nbytes > max_file_bytes:
            bundles.append([])
            size = 0
        bundles[-1].append(slot)
        size += slot.nbytes
    files = []
    spans = {}
    for i, bundle in enumerate(bundles):
        name = data_file_name(i, len(bundles))
        header = encode_header(bundle, metadata)
        cursor = len(header)
        for slot in bundle:
            spans[slot.key] = Span(name, cursor, cursor + slot.nbytes)
            cursor += slot.nbytes
        files.append(SaveFile(name, header, cursor))
    return SaveFiles(tuple(files), spans)


@dataclass(frozen=True)
class WrittenPiece:
    """What a rank reports of one piece it wrote: where, and the CRC-32 of its bytes in segments
    (lo, hi, crc32) cut at chunk boundaries (`ucp.format.crc.segment_crcs`)."""

    key: str
    begin: int
    end: int
    segments: tuple[tuple[int, int, int], ...]


_SAME_MODEL = ("; the ranks arranged the files differently: every rank must save the same model, with the same "
               "parameters, shapes and optimizer states")


def whole_crcs(files: SaveFiles, pieces: Iterable[WrittenPiece]) -> dict[str, tuple[int, list[int]]]:
    """Each tensor's CRC-32 and chunk CRC-32s, combined from the pieces the ranks wrote; they must tile it."""
    by_key: dict[str, list[WrittenPiece]] = {}
    for piece in pieces:
        by_key.setdefault(piece.key, []).append(piece)
    crcs = {}
    for key, span in files.spans.items():
        cursor, segments = span.begin, list[tuple[int, int, int]]()
        for piece in sorted(by_key.pop(key, []), key=lambda p: p.begin):
            if piece.begin != cursor:
                raise SaveError((f"{span.file}: {key}: no rank wrote bytes [{cursor}, {piece.begin})"
                                 if piece.begin > cursor else
                                 f"{span.file}: {key}: two ranks wrote byte {piece.begin}") + _SAME_MODEL)
            segments += piece.segments
            cursor = piece.end
        if cursor != span.end:
            raise SaveError(f"{span.file}: {key}: no rank wrote bytes [{cursor}, {span.end}){_SAME_MODEL}")
        try:
            crcs[key] = join_segments(segments, span.begin, span.end, CHUNK_BYTES)
        except ValueError as exc:
            raise SaveError(f"{span.file}: {key}: {exc}{_SAME_MODEL}") from None
    if by_key:
        raise SaveError(f"a rank wrote '{next(iter(by_key))}', which the save's files do not hold{_SAME_MODEL}")
    return crcs


# -- object storage: each data file one multipart upload, each part uploaded by one rank ---------------------

@dataclass(frozen=True)
class Part:
    """Part `number` (from 1) of data file `file`: bytes [begin, end), uploaded by the rank at `uploader` in
    the saving group (the one that holds most of its bytes; every rank knows the headers)."""

    file: str
    number: int
    begin: int
    end: int
    uploader: int


def plan_parts(files: Sequence[SaveFile], runs: Sequence[Sequence[tuple[str, int, int]]], part_bytes: int
               ) -> list[Part]:
    """Cut every file into parts of `part_bytes` (the last smaller) and give each part to the rank that holds
    most of its bytes (the first such; the first rank for a part of header bytes only). `runs[i]` are the
    disjoint (file, begin, end) byte ranges the group's i-th rank wrote. Every rank computes the same plan."""
    held: dict[str, list[tuple[int, int, int]]] = {}
    for rank, mine in enumerate(runs):
        for name, begin, end in mine:
            held.setdefault(name, []).append((begin, end, rank))
    parts = []
    for f in files:
        owned = [[0] * len(runs) for _ in range(-(-f.size // part_bytes))]
        for begin, end, rank in held.get(f.name, []):
            for i in range(begin // part_bytes, (end - 1) // part_bytes + 1 if end > begin else 0):
                owned[i][rank] += min(end, (i + 1) * part_bytes) - max(begin, i * part_bytes)
        for i, counts in enumerate(owned):
            parts.append(Part(f.name, i + 1, i * part_bytes, min(f.size, (i + 1) * part_bytes),
                              counts.index(max(counts))))
    return parts


def bytes_to_send(parts: Sequence[Part], mine: Sequence[tuple[str, int, int]], me: int, part_bytes: int
                  ) -> list[tuple[int, str, int, int]]:
    """(uploader, file, begin, end) of each of this rank's byte ranges (`mine`) that lies in a part another
    rank uploads: what this rank sends that rank before the upload."""
    by_file: dict[str, list[Part]] = {}
    for p in parts:
        by_file.setdefault(p.file, []).append(p)
    out = []
    for name, begin, end in mine:
        for i in range(begin // part_bytes, (end - 1) // part_bytes + 1 if end > begin else 0):
            part = by_file[name][i]
            if part.uploader != me:
                out.append((part.uploader, name, max(begin, part.begin), min(end, part.end)))
    return out
