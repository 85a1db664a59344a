"""The dynamic fp16 loss scale: the fields ucp records in the index and puts back into an engine.

One place for the three sides that meet here: a converter reads a pickled `LossScaler` (or a ZeRO-0
optimizer dict), the async saver reads the live engine's scaler, and the hook restores the saved
fields into the engine's scaler. All of it is plain data; nothing here imports DeepSpeed.
"""
from __future__ import annotations

from typing import Any

FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def live_scaler(optimizer: object) -> object | None:
    """The loss scaler a DeepSpeed optimizer wrapper holds (fp16 engines), or None."""
    return getattr(optimizer, "loss_scaler", None) or getattr(optimizer, "loss_scale_config", None)


def record_of(state: dict[str, Any]) -> dict[str, Any]:
    """The recorded fields of a scaler given as a plain dict of its attributes."""
    return {k: state[k] for k in FIELDS if k in state}


def record_live(scaler: object) -> dict[str, Any]:
    """The recorded fields of a live scaler object, as JSON numbers."""
    return {k: _number(getattr(scaler, k)) for k in FIELDS if hasattr(scaler, k)}


def restore(saved: dict[str, Any], scaler: object) -> None:
    """Set the saved fields on `scaler`, so the dynamic scale continues where training stopped."""
    for key, value in saved.items():
        if key in FIELDS and hasattr(scaler, key):
            setattr(scaler, key, value)


def _number(value: Any) -> Any:
    """A scaler field as a JSON number (DeepSpeed keeps some as 0-dim tensors)."""
    return value.item() if hasattr(value, "item") else value
