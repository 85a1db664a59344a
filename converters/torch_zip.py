"""Read the structure of a `torch.save` zip file without loading its tensors.

DeepSpeed writes every shard with `torch.save`. Loading one with `torch.load` pulls every tensor
into memory and executes whatever classes the pickle names. Here the pickle is parsed with an
allow-list: tensors come back as `LazyTensor` records (which stored bytes they live in, at which
absolute file offset), and classes outside the allow-list (DeepSpeed's enums, loss scalers,
named tuples) come back as inert `Opaque` objects that only record their arguments and state.
Nothing from the file is ever imported or run, and neither `deepspeed` nor `torch` need be
installed: dtypes are their names (`DtypeName`), devices `Device` records, sizes tuples.
"""
from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ucp.errors import CorruptCheckpointError
from ucp.format.dtypes import NUMPY_DTYPES, as_values, to_torch
from ucp.format.index import DTYPE_SIZES
from ucp.storage.fileio import ReadCounter, open_regular, pread_into

if TYPE_CHECKING:
    import torch


class DtypeName(str):
    """A torch dtype named in a pickle (`torch.float32` is "float32"), told apart from plain strings."""


@dataclass(frozen=True)
class Device:
    """A `torch.device` named in a pickle."""

    type: str
    index: int | None = None

    def __repr__(self) -> str:  # as torch prints it, which metadata copied as text shows
        index = "" if self.index is None else f", index={self.index}"
        return f"device(type='{self.type}'{index})"


def _device(spec, index=None) -> Device:
    kind, _, number = str(spec).partition(":")
    return Device(kind, int(number) if number else index)


_STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool",
}
# torch's dtype attributes, by the names a pickle may use (its aliases included)
_DTYPE_ATTRS = {**{name: name for name in DTYPE_SIZES}, "float": "float32", "double": "float64", "half": "float16",
                "long": "int64", "int": "int32", "short": "int16"}


@dataclass(frozen=True)
class LazyStorage:
    key: str
    dtype: DtypeName
    numel: int


@dataclass(frozen=True)
class LazyTensor:
    """A tensor found in a torch zip file: where its elements are, not the elements themselves."""

    path: str
    storage: LazyStorage
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    data_offset: int  # absolute byte offset of the storage's first element in the file

    @property
    def dtype(self) -> DtypeName:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.storage.dtype]

    def byte_offset(self, element: int = 0) -> int:
        """Absolute file offset of flat element `element` of this (contiguous) tensor."""
        return self.data_offset + (self.storage_offset + element) * self.itemsize

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


class Opaque:
    """Stand-in for a class outside the allow-list; keeps what the pickle gave it."""

    _qualname = "?"
    # Class-level defaults: copyreg may build instances without calling __init__.
    args: tuple = ()
    kwargs: dict = {}
    state = None

    def __init__(self, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs
        self.state = None

    def __setstate__(self, state):
        self.state = state

    def __getattr__(self, name):
        # Dataclass-like objects pickle their fields as a state dict; expose them as attributes.
        state = self.state
        if isinstance(state, dict) and name in state:
            return state[name]
        raise AttributeError(name)

    @property
    def value(self):
        """The first constructor argument: an enum's value, for instance."""
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"<{self._qualname} {self.args or self.state!r}>"


_opaque_classes: dict[str, type] = {}


def _opaque_class(module: str, name: str) -> type:
    qualname = f"{module}.{name}"
    if qualname not in _opaque_classes:
        _opaque_classes[qualname] = type(name, (Opaque,), {"_qualname": qualname})
    return _opaque_classes[qualname]


def _rebuild_parameter(data, requires_grad, backward_hooks, *args):
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    return func(*args)


_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("torch", "Size"): tuple,
    ("torch", "device"): _device,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: str, entries: dict[str, ZipEntry]):
        super().__init__(io.BytesIO(data))
        self._path = path
        self._entries = entries

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self._rebuild_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return DtypeName(_STORAGE_DTYPES[name])
        if module == "torch" and name in _DTYPE_ATTRS:
            return DtypeName(_DTYPE_ATTRS[name])
        return _opaque_class(module, name)

    def persistent_load(self, pid):
        if not isinstance(pid, tuple) or not pid or pid[0] != "storage":
            raise CorruptCheckpointError(f"{self._path}: unexpected persistent id {pid!r}")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, DtypeName):
            raise CorruptCheckpointError(f"{self._path}: unsupported storage type {dtype!r}")
        return LazyStorage(str(key), dtype, int(numel))

    def _rebuild_tensor(self, storage, storage_offset, size, stride, *rest):
        if not isinstance(storage, LazyStorage):
            raise CorruptCheckpointError(f"{self._path}: a tensor names no storage ({storage!r}); the file is damaged, "
                                         "copy it again")
        if storage.key not in self._entries:
            raise CorruptCheckpointError(f"{self._path}: tensor storage {storage.key} is missing from the "
                                         "archive; the file is truncated or damaged, copy it again")
        t = LazyTensor(self._path, storage, int(storage_offset), tuple(int(s) for s in size),
                       tuple(int(s) for s in stride), self._entries[storage.key].start)
        _check_bounds(t, self._entries[storage.key])
        return t


def _check_bounds(t: LazyTensor, entry: ZipEntry) -> None:
    """Refuse what `torch.load` refuses: a storage whose zip entry holds another number of bytes than it
    declares, and a tensor reaching outside its storage (a negative offset, size or stride, or elements past
    its end), which would read the bytes of a neighbouring entry."""
    itemsize = DTYPE_SIZES[t.storage.dtype]
    if t.storage.numel < 0 or t.storage.numel * itemsize != entry.end - entry.start:
        raise CorruptCheckpointError(f"{t.path}: tensor storage {t.storage.key} declares {t.storage.numel} "
                                     f"{t.storage.dtype} elements, its zip entry {entry.name} holds "
                                     f"{entry.end - entry.start} bytes; the file is damaged, copy it again")
    if min((t.storage_offset, *t.shape, *t.stride), default=0) < 0 or len(t.shape) != len(t.stride):
        raise CorruptCheckpointError(f"{t.path}: a tensor of storage {t.storage.key} has storage offset "
                                     f"{t.storage_offset}, sizes {list(t.shape)} and strides {list(t.stride)}, which "
                                     "torch.load refuses; the file is damaged, copy it again")
    last = t.storage_offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride))
    if t.numel and last >= t.storage.numel:
        raise CorruptCheckpointError(f"{t.path}: a tensor reads elements [{t.storage_offset}, {last + 1}) of "
                                     f"storage {t.storage.key}, which holds {t.storage.numel}; the file is damaged, "
                                     "copy it again")


_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
# The largest data.pkl read: the metadata of a rank file (names, shapes, slice maps of ~10^6
# parameters) is far smaller; the tensors themselves live outside the pickle.
MAX_PICKLE_BYTES = 1 << 30


@dataclass(frozen=True)
class ZipEntry:
    """The stored bytes of one tensor storage in a torch zip file: [start, end), and the CRC-32 the zip
    directory records for them (0 when the writer skipped it: torch's `compute_crc32=False`)."""

    name: str  # the entry's name in the archive, e.g. "archive/data/3"
    start: int
    end: int
    crc32: int


def load_lazy(path: str | os.PathLike) -> object:
    """The object a `torch.save` file holds, with every tensor replaced by a `LazyTensor`."""
    path = str(path)
    data, entries = _open(path, with_pickle=True)
    try:
        return _Unpickler(data, path, entries).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            OverflowError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{path}: its pickle is damaged ({exc}); copy the file again") from None


def storage_entries(path: str | os.PathLike) -> dict[str, ZipEntry]:
    """The zip entries of a `torch.save` file's tensor storages, by storage key (what `LazyStorage.key` names)."""
    return _open(str(path), with_pickle=False)[1]


def archive_digest(path: str | os.PathLike) -> tuple | None:
    """Every entry's name, size and CRC-32 from the zip directory of `path` (no data is read): equal for two
    files with equal bytes; None where the writer recorded no CRC-32s (`compute_crc32=False`)."""
    fd = open_regular(str(path))
    try:
        with os.fdopen(fd, "rb", closefd=False) as raw, zipfile.ZipFile(raw) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: cannot be read as a torch.save file ({exc}); it is truncated "
                                     "or damaged, copy it again from the training job") from None
    finally:
        os.close(fd)
    if any(i.CRC == 0 and i.file_size for i in infos):
        return None
    return tuple((i.filename, i.file_size, i.CRC) for i in infos)


def _open(path: str, with_pickle: bool) -> tuple[bytes, dict[str, ZipEntry]]:
    """The bytes of `data.pkl` (when asked for) and the storages' entries of the torch zip file `path`.

    The file is opened without blocking and must be a regular file (`open_regular`): a FIFO or a device
    (`/dev/zero`) planted where a rank file belongs is refused, never waited on or read without end.
    """
    fd = open_regular(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as raw:
            return _read_archive(raw, path, os.fstat(fd).st_size, with_pickle)
    except (zipfile.BadZipFile, EOFError, OSError, KeyError, ValueError, OverflowError) as exc:
        raise CorruptCheckpointError(f"{path}: cannot be read as a torch.save file ({exc}); it is truncated "
                                     "or damaged, copy it again from the training job") from None
    finally:
        os.close(fd)


def _read_archive(raw, path: str, size: int, with_pickle: bool) -> tuple[bytes, dict[str, ZipEntry]]:
    with zipfile.ZipFile(raw) as archive:
        infos = archive.infolist()
        names = collections.Counter(i.filename for i in infos)
        twice = sorted(name for name, count in names.items() if count > 1)
        if twice:  # which one a reader takes is up to the reader: torch.load and zipfile disagree
            raise CorruptCheckpointError(f"{path}: its zip archive holds {names[twice[0]]} entries named "
                                         f"'{twice[0]}', which torch.save never writes; the file was tampered with "
                                         "or damaged, copy it again from the training job")
        pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
        if len(pkl) != 1:
            raise CorruptCheckpointError(f"{path}: not a torch.save zip archive (no data.pkl)")
        prefix = pkl[0].filename[: -len("data.pkl")]
        data = _read_pickle(archive, pkl[0], path, size) if with_pickle else b""
        entries = {}
        for info in infos:
            if not info.filename.startswith(prefix + "data/"):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise CorruptCheckpointError(f"{path}: compressed tensor data is not supported")
            offset = _data_start(raw, info, path)
            if offset + info.file_size > size:
                raise CorruptCheckpointError(f"{path}: truncated ({size} bytes, tensor data runs "
                                             f"to {offset + info.file_size}); copy the file again")
            entries[info.filename[len(prefix) + len("data/"):]] = ZipEntry(
                info.filename, offset, offset + info.file_size, info.CRC)
    return data, entries


def _read_pickle(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: str, file_size: int) -> bytes:
    """The bytes of `data.pkl`, bounded: torch.save stores it uncompressed, so a compressed one (which
    could inflate a small file into gigabytes) or one larger than its file is refused unread."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise CorruptCheckpointError(f"{path}: its data.pkl is compressed, which torch.save never does; the file "
                                     "was not written by torch.save, copy it again from the training job")
    if info.file_size > min(file_size, MAX_PICKLE_BYTES):
        raise CorruptCheckpointError(f"{path}: its data.pkl claims {info.file_size} bytes, more than "
                                     f"{'the file holds' if info.file_size > file_size else 'a checkpoint pickle'}"
                                     "; the file is damaged, copy it again")
    return archive.read(info)


def _data_start(raw, info: zipfile.ZipInfo, path: str) -> int:
    raw.seek(info.header_offset)
    header = raw.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{path}: damaged zip entry {info.filename}; copy the file again")
    fields = _LOCAL_HEADER.unpack(header)
    name_len, extra_len = fields[9], fields[10]
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


def read_array(t: LazyTensor, start: int = 0, numel: int | None = None,
               counter: ReadCounter | None = None) -> np.ndarray:
    """Elements [start, start+numel) of contiguous lazy tensor `t`, read with one positional read, held as
    `ucp.format.dtypes.NUMPY_DTYPES[t.dtype]` (bfloat16 as its raw words)."""
    if not t.is_contiguous():
        raise CorruptCheckpointError(f"{t.path}: non-contiguous tensor storage is not supported")
    numel = t.numel - start if numel is None else numel
    if start < 0 or numel < 0 or start + numel > t.numel:
        raise CorruptCheckpointError(f"{t.path}: read of elements [{start}, {start + numel}) "
                                     f"past a tensor of {t.numel}")
    flat = pread_into(t.path, np.empty(numel, dtype=NUMPY_DTYPES[t.dtype]), t.byte_offset(start), counter)
    return flat.reshape(t.shape) if numel == t.numel else flat


def read_values(t: LazyTensor) -> np.ndarray:
    """The whole of `t` as numbers numpy computes with (bfloat16 upcast to float32, exactly)."""
    return as_values(read_array(t), t.dtype)


def read_tensor(t: LazyTensor) -> torch.Tensor:
    """The whole of `t` as a torch tensor (for the places where conversion meets torch)."""
    return to_torch(read_array(t), t.dtype)


def as_python(obj):
    """Plain JSON-able Python for metadata (tensors become lists only when tiny; Opaque becomes repr)."""
    if isinstance(obj, dict):
        return {str(k): as_python(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_python(v) for v in obj]
    if isinstance(obj, DtypeName):
        return str(obj)
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, LazyTensor):
        if obj.numel == 1:
            return read_values(obj).item()
        return {"tensor": list(obj.shape), "dtype": str(obj.dtype)}
    if isinstance(obj, Opaque):
        if obj.state is not None:
            return as_python(obj.state)
        return as_python(obj.value) if len(obj.args) == 1 else repr(obj)
    return repr(obj)

