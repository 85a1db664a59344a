"""Where a Python warning raised during a `ucp` command goes: ucp's own are a note line, other packages' are set aside.

torch, a plugin, or a package someone else installed may warn while being imported: with the deprecated `pynvml`
(which DLRover's k8s extra installs, and many GPU machines have) every `import torch` prints a two-line
`FutureWarning`. Printed, it stands between the user and the answer, and a command's one-line error becomes three
lines the user can do nothing about. Such a warning goes to the `py.warnings` log (the logger
`logging.captureWarnings` uses), which is shown on stderr with --debug only. A warning raised from ucp's own code
(the file it names lies in one of ucp's source folders) is shown as a note line, `ucp COMMAND: MESSAGE`, as ucp's
logged warnings are.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import TextIO

FOREIGN = logging.getLogger("py.warnings")

# The package and the folders setup.cfg maps under it: an editable install leaves them apart on disk.
_PACKAGES = ("ucp", "ucp.cli", "ucp.converters", "ucp.patterns")


def ucp_source_folders() -> tuple[str, ...]:
    """The folders ucp's modules lie in, each ending in a separator (so `/x/ucp` does not take `/x/ucp_other`)."""
    folders: list[str] = []
    for name in _PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            folders.extend(os.path.join(os.path.realpath(f), "") for f in spec.submodule_search_locations)
    return tuple(folders)


def is_ucp_file(filename: str, folders: tuple[str, ...]) -> bool:
    """Whether the file a warning names is one of ucp's modules (a warning from `<string>` or `sys` is not)."""
    return os.path.isabs(filename) and os.path.realpath(filename).startswith(folders)


@contextlib.contextmanager
def warnings_routed(debug: bool) -> Iterator[None]:
    """Route the warnings raised inside the block (Python's filters still decide which are raised at all)."""
    folders = ucp_source_folders()
    shown_before = warnings.showwarning
    propagate_before = FOREIGN.propagate

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        if is_ucp_file(filename, folders):
            logging.getLogger("ucp").warning("%s", message)
        else:
            FOREIGN.warning("%s", warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"))

    handler: logging.Handler = logging.StreamHandler(sys.stderr) if debug else logging.NullHandler()
    FOREIGN.addHandler(handler)
    FOREIGN.propagate = False  # a handler some import put on the root logger must not print them either
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown_before
        FOREIGN.removeHandler(handler)
        FOREIGN.propagate = propagate_before
