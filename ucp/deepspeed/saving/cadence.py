"""When the engine saves: the test of each optimizer step against the `"save"` section (`ucp.deepspeed.config`
reads it; `ucp.deepspeed.life` runs the saves these call for)."""
from __future__ import annotations

from ucp.deepspeed.config import SaveOptions


def disk_due(save: SaveOptions, steps: int, last: int | None) -> bool:
    """Whether the optimizer step that made `steps` calls for a disk save (`last`: the step last saved)."""
    return steps % save.every == 0 and steps != last


def memory_due(save: SaveOptions, steps: int, last: int | None) -> bool:
    """Whether it calls for a save into the memory tier (`last`: the step the tier last saved)."""
    return save.memory is not None and steps % save.memory.every == 0 and steps != last
