"""Collectives on Python objects and byte strings, for the load's exchange, saves and the memory tier.

Every function takes the process group to talk over; ``None`` means this rank is alone (a one-rank save, a
job without torch.distributed) and nothing is sent. Pass ``dist.group.WORLD`` for the whole job. Objects
are pickled as torch's ``*_object`` collectives do: they are records this job's own ranks made.
"""
from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def initialized() -> bool:
    """Whether torch.distributed is up in this process."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    """This run's world size: torch.distributed's when it is up, else the launcher's WORLD_SIZE."""
    return dist.get_world_size() if initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def all_gather_objects(value: T, group: Any) -> list[T]:
    """Every rank's `value`, in group order, on every rank of `group`."""
    if group is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def gather_objects(value: T, dst: int, group: Any) -> list[T] | None:
    """Every rank's `value`, in group order, on global rank `dst`; None on the other ranks."""
    if group is None:
        return [value]
    here = dist.get_rank() == dst
    out: list[Any] | None = [None] * dist.get_world_size(group) if here else None
    dist.gather_object(value, out, dst=dst, group=group)
    return out


def broadcast_object(value: T, src: int, group: Any) -> T:
    """Global rank `src`'s `value`, on every rank of `group`."""
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_to_all_bytes(sent: Sequence[bytes], group: Any) -> list[bytes]:
    """Send `sent[i]` to the group's i-th rank; what each rank of the group sent this one, in group order.

    Two all-to-alls: the sizes (8 bytes per peer each way), then the bytes themselves, one flat buffer each way.
    """
    if group is None:
        return list(sent)
    device = host_device(group)
    sizes = torch.tensor([len(s) for s in sent], dtype=torch.int64, device=device)
    got = torch.empty_like(sizes)
    dist.all_to_all_single(got, sizes, group=group)
    got_sizes, sent_sizes = got.tolist(), sizes.tolist()
    flat = b"".join(sent)
    out = torch.frombuffer(bytearray(flat), dtype=torch.uint8) if flat else torch.empty(0, dtype=torch.uint8)
    received = torch.empty(sum(got_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(received, out.to(device), got_sizes, sent_sizes, group=group)
    raw = received.cpu().numpy().tobytes()
    pieces, offset = [], 0
    for size in got_sizes:
        pieces.append(raw[offset:offset + size])
        offset += size
    return pieces


def all_to_all_objects(payloads: Sequence[Any], group: Any) -> list[Any]:
    """Send `payloads[i]` to the group's i-th rank; what each rank of the group sent this one, in group order."""
    if group is None:
        return list(payloads)
    received = all_to_all_bytes([pickle.dumps(p) for p in payloads], group)
    return [pickle.loads(r) for r in received]  # records this job's ranks made, as all_gather_object's


def host_device(group: Any = None) -> torch.device:
    """Where `group`'s collectives take tensors: the CPU under gloo (and a "cpu:gloo,..." mix), else the
    accelerator DeepSpeed runs on (NCCL takes device tensors only)."""
    backend = str(dist.get_backend(group))
    if backend == "gloo" or "cpu:" in backend:
        return torch.device("cpu")
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())
