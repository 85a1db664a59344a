"""One planner per DeepSpeed checkpoint family (`zero`, `zero0`, `zero3`, `tp`, `pipe`, `moe`, `megatron`), reading
one slice's ZeRO state (`slices`), and declared TP layouts (`declared`, `lists`). `ucp.converters.dispatch` chooses
among them; what every plan shares is `ucp.converters.plan_common`. The planners import each other where a family
builds on another (ZeRO-3's slices, a pipeline's stages), the rest of `ucp.converters` and the layers below it."""
