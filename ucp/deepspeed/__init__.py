"""Resume a DeepSpeed engine from any checkpoint under its own layout, and save into the atomic format.

The public interface is `initialize` (`ucp.deepspeed.hook`), `load` (`ucp.deepspeed.loading.load`), `save` and `wait`
(`ucp.deepspeed.life`, the owner of an engine's checkpoint life), and `finish`, which ends a training process with its
exit code (`ucp.deepspeed.finish`). The top of the package holds the start (`hook`; `config`, the one reading of
the `"ucp"` section that every room takes its parts from; `elastic`, `auto_resume`), the life and the exit; what they
run lives in four rooms, each saying in its `__init__` what it owns and may import: `engine` (what each rank of an
engine holds), `saving`, `loading` and `memory` (the host-memory tier).
The rooms are not named `save` and `load`, which are this package's public functions.
"""
from ucp.deepspeed.finish import finish
from ucp.deepspeed.hook import CheckpointMismatchError, LoadStats, SaveStats, initialize, load, save, wait

__all__ = ["CheckpointMismatchError", "LoadStats", "SaveStats", "finish", "initialize", "load", "save", "wait"]
