"""Resume a DeepSpeed engine from any checkpoint under its own layout, and save into the atomic format.

The public interface is `initialize` (`ucp.deepspeed.hook`), `load` (`ucp.deepspeed.engine_load`), `save` and `wait`
(`ucp.deepspeed.life`, the owner of an engine's checkpoint life), and `finish`, which
ends a training process with its exit code (`ucp.deepspeed.finish`); the package
also holds what the hook needs: the validated `"ucp"` config section, engine-family targets, AutoTP
boxes, placement by an explicit layout, where the bytes come from, and the asynchronous saver.
"""
from ucp.deepspeed.finish import finish
from ucp.deepspeed.hook import CheckpointMismatchError, LoadStats, SaveStats, initialize, load, save, wait

__all__ = ["CheckpointMismatchError", "LoadStats", "SaveStats", "finish", "initialize", "load", "save", "wait"]
