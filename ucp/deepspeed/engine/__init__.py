"""What each rank of a live DeepSpeed engine holds, whatever reads or writes it: one adapter per optimizer family
and pipeline stages (`targets`), AutoTP boxes (`autotp`), native MoE experts under their global names (`moe`),
placement by an explicit layout (`placement`), and training on one (`hmp_sync`: the `"hmp"` key, the gradient
sync across replicas of unequal TP size inside `engine.step`).

The floor under the config, the load and the save (`ucp.deepspeed.config` calls its readers of the layout and of
the `"hmp"` section): it imports only the layers below `ucp.deepspeed` (`ucp.hmp`, `ucp.elastic`, the format, the
converters' declared layouts), never `config`, `saving`, `loading`, `memory` or the modules at the top of
`ucp.deepspeed` (tests/unit/test_architecture.py)."""
