"""The load of a checkpoint into a live engine under the engine's own layout: the pipeline (`load`), where the bytes
come from (`source`: a ucp index or a DeepSpeed plan; `flat_runs`: a ZeRO partition as runs of its source files),
which rank reads what (`readers`, pure), the check's exchange of parts to owner ranks (`exchange`), and the boxes
of a Megatron-style mpu's TP shards (`mpu`, the inverse of `ucp.deepspeed.saving.mpu`).

Named `loading` because `ucp.deepspeed.load` is the public function. It may import `ucp.deepspeed.engine`,
`ucp.deepspeed.saving` (the reading of an mpu that a save and a load share), `ucp.deepspeed.config` and the layers
below `ucp.deepspeed`; never `memory` or the top of the package (tests/unit/test_architecture.py)."""
