"""The plan model: the shared vocabulary of conversion, the DeepSpeed hook, export and the converters.

* `plan`: the plan types converters produce (`ConversionPlan`, `ParamPlan`, `StateSource`, fragments);
* `primitives`, `assemble`: Extract, Union and StripPad, and a tensor materialized from its fragments;
* `balance`: numel-balanced bins of parameters (one bin a worker, a data file);
* `index_builder`: the typed index a conversion or an asynchronous save builds from what its writers report.

Pure functions and frozen types over `ucp.patterns` and `ucp.format`; the drivers that run them
(`ucp.convert`, `ucp.deepspeed`, `ucp.export`) and the converters that fill them sit above.
"""
