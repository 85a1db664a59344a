"""Decoder-only transformer shapes from a Hugging Face `config.json` (Llama, Qwen2, Mistral keys): pure, no torch.

`ModelConfig` gives what planning needs (parameters and FLOPs per layer) and the model's
parameter table (`ParamSpec`s under Hugging Face names, with Megatron's TP partition dims), which
layouts cut into per-rank slices.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

from ucp.errors import UcpError
from ucp.hmp.layout import ParamSpec
from ucp.storage.json_file import read_json_file, shown

_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
MAX_LAYERS = 4096  # the deepest models have ~130; the search's time grows with layers
MAX_SIZE = 1 << 31  # widths, heads and vocabularies
MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few KiB


class ModelConfigError(UcpError):
    """A model config lacks a key the planner needs, or holds an impossible value."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    qkv_bias: bool = False        # Qwen2 has biases on q, k, v
    tie_embeddings: bool = False

    @classmethod
    def from_hf(cls, config: dict, name: str = "model") -> ModelConfig:
        """From the dict of a Hugging Face `config.json`."""
        missing = [k for k in _REQUIRED if k not in config]
        if missing:
            raise ModelConfigError(f"{name}: config has no '{missing[0]}'; a Llama/Qwen2/Mistral config.json needs "
                                   f"{', '.join(_REQUIRED)} (and num_key_value_heads for GQA)")
        sizes = {key: config[key] for key in _REQUIRED}
        sizes["num_key_value_heads"] = config.get("num_key_value_heads") or config["num_attention_heads"]
        for key, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ModelConfigError(f"{name}: {key}={shown(value)} must be an integer; is it the model's "
                                       "config.json?")
        flags = {"attention_bias": config.get("attention_bias", config.get("model_type") == "qwen2"),
                 "tie_word_embeddings": config.get("tie_word_embeddings", False)}
        for key, value in flags.items():
            if not isinstance(value, bool):
                raise ModelConfigError(f"{name}: {key}={shown(value)} must be true or false (a JSON boolean, not a "
                                       "string or a number)")
        model = cls(name=name, hidden_size=sizes["hidden_size"], intermediate_size=sizes["intermediate_size"],
                    num_layers=sizes["num_hidden_layers"], num_heads=sizes["num_attention_heads"],
                    num_kv_heads=sizes["num_key_value_heads"], vocab_size=sizes["vocab_size"],
                    qkv_bias=flags["attention_bias"], tie_embeddings=flags["tie_word_embeddings"])
        model.check()
        return model

    def check(self) -> None:
        for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size"):
            limit = MAX_LAYERS if key == "num_layers" else MAX_SIZE
            if not 1 <= getattr(self, key) <= limit:
                raise ModelConfigError(f"{self.name}: {key}={getattr(self, key)} must be in [1, {limit}]; is it the "
                                       "model's config.json?")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"{self.name}: hidden_size {self.hidden_size}, {self.num_heads} heads and "
                                   f"{self.num_kv_heads} KV heads do not divide evenly")

    @cached_property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @cached_property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def param_table(self) -> list[ParamSpec]:
        """Every parameter, Hugging Face names, Megatron partition dims (q/k/v/gate/up/embed/head: 0; o/down: 1)."""
        h, i, v, kv = self.hidden_size, self.intermediate_size, self.vocab_size, self.kv_dim
        table = [ParamSpec("model.embed_tokens.weight", (v, h), 0, -1)]
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            table += [ParamSpec(p + "input_layernorm.weight", (h,), None, n),
                      ParamSpec(p + "self_attn.q_proj.weight", (h, h), 0, n),
                      ParamSpec(p + "self_attn.k_proj.weight", (kv, h), 0, n),
                      ParamSpec(p + "self_attn.v_proj.weight", (kv, h), 0, n)]
            if self.qkv_bias:
                table += [ParamSpec(p + "self_attn.q_proj.bias", (h,), 0, n),
                          ParamSpec(p + "self_attn.k_proj.bias", (kv,), 0, n),
                          ParamSpec(p + "self_attn.v_proj.bias", (kv,), 0, n)]
            table += [ParamSpec(p + "self_attn.o_proj.weight", (h, h), 1, n),
                      ParamSpec(p + "post_attention_layernorm.weight", (h,), None, n),
                      ParamSpec(p + "mlp.gate_proj.weight", (i, h), 0, n),
                      ParamSpec(p + "mlp.up_proj.weight", (i, h), 0, n),
                      ParamSpec(p + "mlp.down_proj.weight", (h, i), 1, n)]
        table.append(ParamSpec("model.norm.weight", (h,), None, self.num_layers))
        if not self.tie_embeddings:
            table.append(ParamSpec("lm_head.weight", (v, h), 0, self.num_layers))
        return table

    # -- sizes for planning ----------------------------------------------------------------------------

    @cached_property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's matrix multiplies (all TP-partitioned)."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.kv_dim
        return 2 * h * h + 2 * kv * h + 3 * h * i

    @cached_property
    def layer_params(self) -> tuple[int, int]:
        """(TP-partitioned, TP-replicated) parameters of one layer."""
        bias = self.hidden_size + 2 * self.kv_dim if self.qkv_bias else 0
        return self.layer_matmul_params + bias, 2 * self.hidden_size

    @cached_property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @cached_property
    def num_params(self) -> int:
        part, repl = self.layer_params
        head = 0 if self.tie_embeddings else self.embedding_params
        return self.num_layers * (part + repl) + self.embedding_params + head + self.hidden_size


def load_model_config(path: str | os.PathLike) -> ModelConfig:
    """Read a Hugging Face `config.json`: a regular file of at most MAX_CONFIG_BYTES (a FIFO would block a read
    forever and a device such as /dev/zero never end, so neither is read), strict JSON, each failure one line."""
    data = read_json_file(path, ModelConfigError, "pass a Hugging Face config.json (examples in examples/models/)",
                          MAX_CONFIG_BYTES)
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object with hidden_size, num_hidden_layers, ...")
    return ModelConfig.from_hf(data, name=os.path.splitext(os.path.basename(path))[0])
