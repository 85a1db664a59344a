"""The `"ucp"` section of a DeepSpeed config: read and checked once, before any engine is built.

`ucp.deepspeed.initialize` reads the whole section once (`read_section`) into one typed value, `Section`: every key
checked, every refusal one line naming the key and the fix (`ConfigError`), before `deepspeed.initialize` runs;
the rest of the start takes its parts from that value (the load's arguments, the `"save"` section with its
`"memory"` tier, the `"elastic"` section, the `"hmp"` batch and the explicit layout) and never reads the raw dict
again. `ucp.transformers.train` and `ucp.accelerate.load_state` check the section through `ucp_options` too.

The lowest module of `ucp.deepspeed` but for `ucp.deepspeed.engine` (whose parsers of the layout and of the
`"hmp"` section it calls): every room of the package may import it.
"""
from __future__ import annotations

import difflib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucp.deepspeed.engine.hmp_sync import hmp_batch
from ucp.deepspeed.engine.placement import as_layout
from ucp.elastic.shares import ElasticBatch, ElasticSection, zero_stage
from ucp.errors import ConfigError, UnsupportedStorageError
from ucp.format.folder import local_path
from ucp.hmp.layout import Layout
from ucp.storage.locations import Location, location, url_scheme

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
    """A checked copy of `config["ucp"]` ({} when there is none): its keys and the load's options."""
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
class MemoryEvery:
    """The `"memory"` section of `"ucp": {"save": ...}`: a memory save after every `every`-th step, each node
    keeping copies of `replicas` other nodes' pieces, in `dir` (expanded on each node); `job` is the identity
    of the disk save folder (its absolute path, or its URL), recorded in every manifest
    (`ucp.deepspeed.memory.tier`)."""

    every: int
    replicas: int
    dir: str
    job: str

    @classmethod
    def from_config(cls, options: object, save_dir: str) -> MemoryEvery:
        example = '{"every": 50, "replicas": 1}'
        if not isinstance(options, dict):
            raise ConfigError(f'"ucp": {{"save": {{"memory": {options!r}}}}}: must be an object such as {example}')
        unknown = set(options) - {"every", "replicas", "dir"}
        if unknown:
            raise ConfigError(f'"ucp": {{"save": {{"memory": ...}}}}: unknown key {sorted(unknown)[0]!r}; known: '
                              '"every", "replicas", "dir"')
        every, replicas = options.get("every"), options.get("replicas", 1)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f'"ucp": {{"save": {{"memory": {{"every": {every!r}}}}}}}: must be a positive number '
                              f"of optimizer steps, e.g. {example}")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ConfigError(f'"ucp": {{"save": {{"memory": {{"replicas": {replicas!r}}}}}}}: must be the number of '
                              "other nodes that keep a copy of each node's pieces, 0 or more (1 survives the loss "
                              "of any one node)")
        job = save_dir if url_scheme(save_dir) else os.path.realpath(save_dir)  # s3://...: the same on every node
        folder = options.get("dir")
        if folder is None:
            folder = f"/dev/shm/ucp-{hashlib.sha256(job.encode()).hexdigest()[:12]}"
        try:
            if not isinstance(folder, (str, os.PathLike)):
                raise TypeError(folder)
            local_path(folder)
        except (TypeError, UnsupportedStorageError):
            raise ConfigError(f'"ucp": {{"save": {{"memory": {{"dir": {folder!r}}}}}}}: must be a local folder in '
                              'host memory, e.g. "/dev/shm/ucp-myjob"') from None
        if not os.fspath(folder).startswith(("/", "$")):  # "", "shm/x", "~": the working or home directory
            raise ConfigError(f'"ucp": {{"save": {{"memory": {{"dir": {os.fspath(folder)!r}}}}}}}: must be an '
                              'absolute path of a folder of its own, e.g. "/dev/shm/ucp-myjob" ("~" is not '
                              'expanded; "$VARS" are)')
        return cls(every, replicas, os.fspath(folder), job)

    @property
    def path(self) -> Path:
        """This node's memory folder; one that expands to a relative path (an unset `$VAR`) is refused."""
        expanded = os.path.expandvars(self.dir)
        if not os.path.isabs(expanded):
            raise ConfigError(f'"ucp": {{"save": {{"memory": {{"dir": {self.dir!r}}}}}}}: expands to {expanded!r} '
                              "on this node, not an absolute path; set the variables it names")
        return Path(expanded).resolve()


@dataclass(frozen=True)
class SaveOptions:
    """The `"save"` section: save into `dir` after every `every`-th optimizer step (`ucp.deepspeed.saving.cadence`
    says when), and keep the newest `keep` committed checkpoints there (all when None;
    `ucp.elastic.retention.prune`); with `memory`, save into the host-memory tier too
    (`ucp.deepspeed.memory.tier`). Read here with the rest of the section, before DeepSpeed runs."""

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
        if problem is not None:  # "$VARS": checked on each node (memory.files.checked_folder)
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


def overlap_problem(folder: Path, job: str) -> str | None:
    """Why memory folder `folder` may not be used beside save folder `job`: the same folder, inside it or holding
    it (each tier removes its own checkpoints by the same names), or None."""
    if url_scheme(job):
        return None
    mem, disk = os.path.realpath(folder), os.path.realpath(job)
    if mem == disk or mem.startswith(disk.rstrip("/") + "/") or disk.startswith(mem.rstrip("/") + "/"):
        return (f'"ucp": {{"save": {{"memory": {{"dir": ...}}}}}}: {folder} is the save "dir" {job}, inside it or '
                'holds it; the memory tier needs a folder of its own, e.g. "/dev/shm/ucp-myjob"')
    return None


def without_ucp(config: dict) -> dict:
    """A copy of `config` without its `"ucp"` section (DeepSpeed never sees ucp's keys)."""
    return {k: v for k, v in config.items() if k != CONFIG_KEY}


def load_options(options: dict) -> dict:
    """The keyword arguments of `ucp.deepspeed.load` among checked `options`."""
    return {k: v for k, v in options.items() if k in LOAD_OPTIONS}


@dataclass(frozen=True)
class Section:
    """`ucp.deepspeed.initialize`'s one reading of a DeepSpeed config, all at once before DeepSpeed runs.

    `load`: the `"load"` key (a checkpoint's path, or `AUTO`; None without one); `load_options`: the keyword
    arguments of `ucp.deepspeed.load` among the keys, the layout as a `Layout`; `save`: the `"save"` section, its
    `"memory"` tier included; `layout`: the explicit `"layout"`; `hmp`: the `"hmp"` section's batch over that
    layout's replicas; `elastic`: the `"elastic"` section; `zero_stage`: DeepSpeed's ZeRO stage (the elastic cost
    model's input); `deepspeed`: the config DeepSpeed is given (without the section; None when the options do not
    come from a dict)."""

    load: str | os.PathLike[str] | None
    load_options: dict[str, Any]
    save: SaveOptions | None
    layout: Layout | None
    hmp: ElasticBatch | None
    elastic: ElasticSection | None
    zero_stage: int
    deepspeed: dict | None

    @property
    def memory_tier(self) -> bool:
        return self.save is not None and self.save.memory is not None


def read_section(config: dict | None) -> Section:
    """`config`'s `"ucp"` section, read and checked: its keys (`ucp_options`), `"save"` (`SaveOptions`), `"load"`
    `"auto"` with its save folder, the explicit layout and its `"hmp"` batch, then `"elastic"` (`ElasticSection`)."""
    options = ucp_options(config)
    save = SaveOptions.from_config(options["save"]) if "save" in options else None
    if options.get("load") == AUTO and save is None:
        raise ConfigError('"ucp": {"load": "auto"} resumes from the save folder: '
                          'add "save": {"dir": ..., "every": ...}')
    layout = hmp = None
    if "hmp" in options:  # heterogeneous model parallelism: the gradient sync between backward and step
        if "layout" not in options:
            raise ConfigError('"ucp": {"hmp": ...} trains on an explicit layout: add "layout" (the JSON that '
                              "`Layout.to_json()` or `ucp plan --json` writes)")
        if "elastic" in options:
            raise ConfigError('"ucp": {"hmp": ...} with "elastic": an elastic job chooses its layout at each start; '
                              'give "elastic": {..., "heterogeneous": true} without "hmp" and "layout"')
        layout = as_layout(options["layout"])
        hmp = hmp_batch(options["hmp"], layout)
    elastic = ElasticSection.from_config(options["elastic"]) if "elastic" in options else None
    if elastic is not None and elastic.heterogeneous and "layout" in options:
        raise ConfigError('"ucp": {"elastic": {"heterogeneous": true}} chooses the layout at each start: leave out '
                          '"layout"')
    if "layout" in options and layout is None:
        layout = as_layout(options["layout"])
    deepspeed = without_ucp(config) if options and isinstance(config, dict) else None
    stage = zero_stage(config)
    loads = load_options(options)
    if layout is not None:
        loads["layout"] = layout
    return Section(options.get("load"), loads, save, layout, hmp, elastic, stage, deepspeed)
