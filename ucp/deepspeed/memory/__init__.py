"""The host-memory tier with peer copies: its saves (`tier`), its restore at any size (`resume`), its folders and
which node copies a job may use (`files`), the typed manifest of a copy (`manifest`), and the whole copies an
elastic layout's spares keep (`spare`). The plans (which node holds what, who fills whom) are pure and live in
`ucp.elastic.memory_plan`.

It rides on the disk save's saver and writer, so it may import `ucp.deepspeed.saving`, `ucp.deepspeed.engine`,
`ucp.deepspeed.config` and the layers below `ucp.deepspeed`; never `loading` or the top of the package
(tests/unit/test_architecture.py)."""
