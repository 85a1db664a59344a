"""The Hugging Face model behind a checkpoint: its `config.json`, the files that travel with it, its tied
weights, and (where transformers is installed) the state-dict keys and shapes its architecture loads.

The config comes from `--config`, else from the checkpoint's extra files: `ucp convert` carries a
Trainer's `checkpoint-N/config.json` (and tokenizer files) into the ucp checkpoint, and a DeepSpeed
save folder read directly offers the same files (see docs/FORMAT.md, "Extra files").
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ucp.errors import CheckpointNotFoundError, ExportError, UnsupportedLayoutError

CONFIG_NAME = "config.json"
# Files `save_pretrained` and tokenizers write beside config.json, copied into an export when present.
COMPANION_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class ModelConfig:
    path: Path                    # where the config.json was read, for messages
    values: dict                  # its contents
    companions: dict[str, bytes] = field(default_factory=dict)   # generation config, tokenizer files


@dataclass(frozen=True)
class ModelKeys:
    """What the architecture loads: `expected` state-dict keys and shapes (tied copies left out; None
    where transformers is not installed), and `tied`, each tied copy's name -> the name it copies (None
    where it cannot be known without transformers)."""

    architecture: str
    expected: dict[str, tuple[int, ...]] | None
    tied: dict[str, str | None]


def find_config(ckpt, given: str | os.PathLike | None = None) -> ModelConfig | None:
    """The config `given` (a config.json or a folder holding one, with the companion files beside it),
    else the one among the checkpoint's extra files (with theirs), else None."""
    if given is not None:
        path = Path(given)
        path = path / CONFIG_NAME if path.is_dir() else path
        if not path.is_file():
            raise CheckpointNotFoundError(f"{path}: no such file; --config takes a config.json or the folder "
                                          "holding one")
        companions = {n: (path.parent / n).read_bytes() for n in COMPANION_FILES if (path.parent / n).is_file()}
        return ModelConfig(path, _parse(path.read_bytes(), path), companions)
    carried = set(ckpt.extra_files)
    if CONFIG_NAME not in carried:
        return None
    path = ckpt.extra_file_path(CONFIG_NAME)
    companions = {n: ckpt.extra_file(n) for n in COMPANION_FILES if n in carried}  # checked against the index
    return ModelConfig(path, _parse(ckpt.extra_file(CONFIG_NAME), path), companions)


def require_config(ckpt, given: str | os.PathLike | None = None) -> ModelConfig:
    found = find_config(ckpt, given)
    if found is None:
        raise CheckpointNotFoundError(f"{ckpt.path}: no {CONFIG_NAME} among the files the checkpoint carries; pass "
                                      "--config with the model's config.json or the folder holding it")
    return found


def model_keys(config: ModelConfig) -> ModelKeys:
    """The keys the config's architecture loads, from a model built on the meta device (no memory, no
    weights), or, without transformers, the config's word-embedding tie alone."""
    try:
        import transformers
    except ImportError:
        # Only an explicit tie: the default differs between model classes (GPT-2 ties, Llama does not).
        explicit: dict[str, str | None] = {"lm_head.weight": None}
        return ModelKeys(_architecture_name(config), None,
                         explicit if config.values.get("tie_word_embeddings") is True else {})
    import torch

    _check_counts(config)
    hf_config, build = _hf_config(config, transformers), _model_class(config, transformers)
    try:
        with torch.device("meta"):
            model = build(hf_config)
    except UnsupportedLayoutError:
        raise
    except Exception as exc:  # transformers' and torch's own errors on hostile values (a size of -1, 0 heads)
        raise ExportError(f"{config.path}: {_architecture_name(config)} cannot be built from it "
                          f"({type(exc).__name__}: {_first_line(exc)}); pass --config with the model's config.json") \
            from None
    first: dict[int, str] = {}
    tied: dict[str, str | None] = {}
    expected: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        source = first.setdefault(id(tensor), name)
        if source != name:  # a second name for the same tensor: save_pretrained stores it once
            tied[name] = source
        else:
            expected[name] = tuple(tensor.shape)
    return ModelKeys(type(model).__name__, expected, tied)


def check_tensors(ckpt_path, shapes: dict[str, tuple[int, ...]], keys: ModelKeys, config: ModelConfig) -> None:
    """Refuse tensors that `from_pretrained` would not load into the architecture, naming the first."""
    if keys.expected is None:
        return
    fix = f"is {config.path} the config of this model? Pass the right one with --config"
    for name, shape in shapes.items():
        if name not in keys.expected:
            raise ExportError(f"{ckpt_path}: tensor '{name}' is not in {keys.architecture}'s state dict "
                              f"(from_pretrained would drop it); {fix}")
        if keys.expected[name] != shape:
            raise ExportError(f"{ckpt_path}: tensor '{name}' has shape {list(shape)}, {keys.architecture} expects "
                              f"{list(keys.expected[name])} (from_pretrained refuses it); {fix}")
    for name in keys.expected:
        if name not in shapes:
            raise ExportError(f"{ckpt_path}: no tensor '{name}', which {keys.architecture} needs (from_pretrained "
                              f"would leave it uninitialised); {fix}")


def _architecture_name(config: ModelConfig) -> str:
    return str((config.values.get("architectures") or [config.values.get("model_type", "?")])[0])[:100]


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


# Layers and experts are modules built one by one, even on the meta device: a count beyond any real model's
# (the deepest have ~130 layers, the widest MoE 256 experts a layer) would build for hours.
MAX_LAYERS = 1024
MAX_EXPERTS = 1024
MAX_EXPERT_MODULES = 1 << 16  # layers x experts
_COUNT = re.compile(r"(^|_)(?P<what>layers?|experts)$")


def _check_counts(config: ModelConfig) -> None:
    """Refuse layer and expert counts (`num_hidden_layers`, `n_layer`, `num_local_experts`, ..., nested configs
    too) that no model has, before anything is built."""
    found = {"layer": 1, "expert": 1}

    def walk(values: dict) -> None:
        for key, value in values.items():
            if isinstance(value, dict):
                walk(value)
            m = _COUNT.search(str(key))
            if m is None or not isinstance(value, int) or isinstance(value, bool):
                continue
            what = "layer" if m.group("what").startswith("layer") else "expert"
            limit = MAX_LAYERS if what == "layer" else MAX_EXPERTS
            if not 0 <= value <= limit:
                raise ExportError(f"{config.path}: {key}={value} is not a count of {what}s a model has (0 to "
                                  f"{limit}); pass --config with the model's config.json")
            found[what] = max(found[what], value)

    walk(config.values)
    if found["layer"] * found["expert"] > MAX_EXPERT_MODULES:
        raise ExportError(f"{config.path}: {found['layer']} layers of {found['expert']} experts are more expert "
                          f"modules than any model has ({MAX_EXPERT_MODULES}); pass --config with the model's "
                          "config.json")


def _model_class(config: ModelConfig, transformers):
    """A callable building the model from its config: the class `architectures` names, else AutoModelForCausalLM."""
    archs = config.values.get("architectures") or []
    if not isinstance(archs, list) or not isinstance(archs[0] if archs else "", str):
        raise UnsupportedLayoutError(f"{config.path}: 'architectures' must be a list of model class names, such as "
                                     "[\"LlamaForCausalLM\"]; pass --config with the model's config.json")
    if not archs:
        def build(hf_config):
            try:
                return transformers.AutoModelForCausalLM.from_config(hf_config)
            except ValueError:
                raise UnsupportedLayoutError(f"{config.path}: no 'architectures' and no causal LM for model_type "
                                             f"'{hf_config.model_type}'; add \"architectures\" to it or pass "
                                             "--config with the model's config.json") from None
        return build
    cls = getattr(transformers, archs[0], None)
    if cls is None:
        raise UnsupportedLayoutError(f"{config.path}: unknown architecture '{archs[0][:100]}' (transformers "
                                     f"{transformers.__version__} has no such class); pass --config with the "
                                     "config.json of a model transformers knows")
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise UnsupportedLayoutError(f"{config.path}: architecture '{archs[0]}' is not a model class of transformers "
                                     "(a model's config names its own, such as LlamaForCausalLM); pass --config "
                                     "with the model's config.json")
    return getattr(cls, "_from_config")  # PreTrainedModel's build from a config, without weights


def _hf_config(config: ModelConfig, transformers):
    model_type = config.values.get("model_type")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        raise UnsupportedLayoutError(f"{config.path}: unknown model_type '{str(model_type)[:100]}' (transformers "
                                     f"{transformers.__version__} does not know it); pass --config with the "
                                     "config.json of a model transformers knows")
    try:
        return transformers.CONFIG_MAPPING[model_type].from_dict(config.values)
    except Exception as exc:  # a config class's own checks of hostile values
        raise ExportError(f"{config.path}: not a valid {model_type} config ({type(exc).__name__}: "
                          f"{_first_line(exc)}); pass --config with the model's config.json") from None


def _parse(raw: bytes, path: Path) -> dict:
    try:
        values = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{path}: not a JSON config ({exc}); pass --config with the model's config.json") from None
    if not isinstance(values, dict):
        raise ExportError(f"{path}: not a JSON object; pass --config with the model's config.json")
    return values
