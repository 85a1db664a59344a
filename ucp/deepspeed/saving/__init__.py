"""The asynchronous save of a live engine into the atomic format: the saver and the save in flight (`saver`),
when a step saves (`cadence`), what training waits for (`snapshot`, `metadata`), who writes which box of each full
tensor (`plan`, pure; `layout`, the engine's side of it; `mpu`, a Megatron TP shard's boxes; `hmp`, which
replica's ranks write under a heterogeneous layout), where every byte goes (`files`), the writer thread (`writer`,
`stores`; `uploads` to object storage), and the index and its commit (`index`).

Named `saving` because `ucp.deepspeed.save` is the public function. It may import `ucp.deepspeed.engine`,
`ucp.deepspeed.config` and the layers below `ucp.deepspeed`; never `loading`, `memory` or the top of the package
(tests/unit/test_architecture.py)."""
