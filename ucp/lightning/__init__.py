"""Lightning with DeepSpeed at any world size: `ucp.lightning.DeepSpeedStrategy` (`ucp.lightning.strategy`).

Importing this package imports `lightning`; `import ucp` does not.
"""
from ucp.lightning.data_order import per_process_batch
from ucp.lightning.strategy import DeepSpeedStrategy

__all__ = ["DeepSpeedStrategy", "per_process_batch"]
