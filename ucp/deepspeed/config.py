"""The `"ucp"` section of a DeepSpeed config: parsed and checked before any engine is built.

Every ucp entry point that takes a DeepSpeed config (`ucp.deepspeed.initialize`,
`ucp.transformers.train`, `ucp.accelerate.load_state`) reads the section through `ucp_options`, so a
typo is one clear `ConfigError` before `deepspeed.initialize` runs, never a `TypeError` after it.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass

from ucp.deepspeed.memory_files import MemoryEvery, overlap_problem
from ucp.errors import ConfigError
from ucp.format.locations import Location, location, url_scheme

CONFIG_KEY = "ucp"
AUTO = "auto"  # "load": resume from the save folder's newest committed checkpoint, or start fresh
# Keys that `ucp.deepspeed.load` takes, with the types each accepts.
LOAD_OPTIONS: dict[str, tuple[type, ...]] = {
    "bypass": (bool,),
    "load_optimizer_states": (bool,),
    "load_lr_scheduler_states": (bool,),
    "strict": (bool,),
    "check_first": (bool,),
    "layout": (dict, str, os.PathLike),
    "check_keep_bytes": (int,),
}
KNOWN_KEYS = ("load", "save", "elastic", "hmp", *LOAD_OPTIONS)


def ucp_options(config: dict | None) -> dict:
    """A checked copy of `config["ucp"]` ({} when there is none)."""
    if not isinstance(config, dict) or CONFIG_KEY not in config:
        return {}
    section = config[CONFIG_KEY]
    if not isinstance(section, dict):
        raise ConfigError(f'"ucp": {section!r}: must be an object such as {{"load": "/ckpt/ucp"}}')
    for key, value in section.items():
        if key not in KNOWN_KEYS:
            close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
            hint = f'did you mean "{close[0]}"? ' if close else ""
            raise ConfigError(f'"ucp": unknown key "{key}"; {hint}known keys: {", ".join(KNOWN_KEYS)}')
        if key == "load" and not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f'"ucp": {{"load": {value!r}}}: must be the path of a checkpoint, or "auto"')
        if key in LOAD_OPTIONS and not isinstance(value, LOAD_OPTIONS[key]):
            kinds = " or ".join(t.__name__ for t in LOAD_OPTIONS[key])
            raise ConfigError(f'"ucp": {{"{key}": {value!r}}}: must be {kinds}')
        if key == "check_keep_bytes" and (isinstance(value, bool) or value < 0):
            raise ConfigError(f'"ucp": {{"check_keep_bytes": {value!r}}}: must be a number of bytes, 0 or more')
    return dict(section)


@dataclass(frozen=True)
class SaveOptions:
    """The `"save"` section: save into `dir` after every `every`-th optimizer step (`ucp.deepspeed.save_cadence`
    says when), and keep the newest `keep` committed checkpoints there (all when None;
    `ucp.elastic.retention.prune`); with `memory`, save into the host-memory tier too
    (`ucp.deepspeed.memory_tier`). Read here with the rest of the section, before DeepSpeed runs."""

    dir: Location
    every: int
    keep: int | None = None
    memory: MemoryEvery | None = None

    @classmethod
    def from_config(cls, options: object) -> SaveOptions:
        if not isinstance(options, dict) or not isinstance(options.get("dir"), (str, os.PathLike)):
            raise ConfigError(f'"ucp": {{"save": {options!r}}}: needs "dir", the folder to save into, e.g. '
                              '{"dir": "/ckpt/ucp", "every": 100}')
        for key in ("every", "keep"):
            value = options.get(key)
            if key == "keep" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                what = "optimizer steps" if key == "every" else "checkpoints to keep (at least 1)"
                raise ConfigError(f'"ucp": {{"save": {{"{key}": {value!r}}}}}: must be a positive number of {what}')
        unknown = set(options) - {"dir", "every", "keep", "memory"}
        if unknown:
            raise ConfigError(f'"ucp": {{"save": ...}}: unknown key {sorted(unknown)[0]!r}; known: "dir", "every", '
                              '"keep", "memory"')
        folder = location(options["dir"])  # a URL no storage takes is refused in one line, before training
        refuse_unpromised_dir(os.fspath(options["dir"]))
        memory = MemoryEvery.from_config(options["memory"], os.fspath(options["dir"])) if "memory" in options else None
        problem = overlap_problem(memory.path, memory.job) if memory is not None and "$" not in memory.dir else None
        if problem is not None:  # "$VARS": checked on each node (memory_files.checked_folder)
            raise ConfigError(problem)
        return cls(folder, options["every"], options.get("keep"), memory)


def refuse_unpromised_dir(folder: str) -> None:
    """Refuse a save `"dir"` the docs do not promise, which would save into (and prune) a folder the user did not
    mean: `""` or `"."` (the working directory itself), `"~..."` and `"$VAR..."` (never expanded: a folder
    literally named so in the working directory)."""
    if url_scheme(folder):
        return
    if os.path.normpath(folder or ".") == "." or folder.startswith("~") or "$" in folder:
        raise ConfigError(f'"ucp": {{"save": {{"dir": {folder!r}}}}}: must name a folder of its own, e.g. '
                          '"/ckpt/ucp" (an absolute path, or a relative one below the working directory; "", "." '
                          'and unexpanded "~" or "$VAR" are refused)')


def without_ucp(config: dict) -> dict:
    """A copy of `config` without its `"ucp"` section (DeepSpeed never sees ucp's keys)."""
    return {k: v for k, v in config.items() if k != CONFIG_KEY}


def load_options(options: dict) -> dict:
    """The keyword arguments of `ucp.deepspeed.load` among checked `options`."""
    return {k: v for k, v in options.items() if k in LOAD_OPTIONS}


@dataclass(frozen=True)
class Section:
    """`ucp.deepspeed.initialize`'s reading of a DeepSpeed config, all at once before DeepSpeed runs: the checked
    `"ucp"` options, their `"save"` section, the keyword arguments of `ucp.deepspeed.load` among them, and the
    config DeepSpeed is given (without the section; None when the options do not come from a dict)."""

    options: dict
    save: SaveOptions | None
    load: dict
    deepspeed: dict | None


def read_section(config: dict | None) -> Section:
    """`config`'s `"ucp"` section, read and checked (`ucp_options`, `SaveOptions`)."""
    options = ucp_options(config)
    save = SaveOptions.from_config(options["save"]) if "save" in options else None
    deepspeed = without_ucp(config) if options and isinstance(config, dict) else None
    return Section(options, save, load_options(options), deepspeed)
