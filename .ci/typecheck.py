"""mypy on the `ucp` package as it installs (`make test` runs it; configuration in pyproject.toml).

setup.cfg maps `converters/`, `patterns/` and `cli/` under `ucp`, which mypy cannot see from the source tree,
and an editable install reaches them through an import hook, which mypy does not run. So this script lays the
package out as it installs, as links under build/typecheck/ (kept, so mypy's cache stays valid between runs),
runs mypy there and reports the paths of the repository's own files.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "typecheck"
MAPPED = {"converters": "converters", "patterns": "patterns", "cli": "cli"}  # setup.cfg's package_dir, under ucp


def lay_out() -> None:
    """build/typecheck/ucp: a link to every entry of ucp/, and to each folder setup.cfg maps under it."""
    package = TREE / "ucp"
    if package.exists():
        shutil.rmtree(package)
    package.mkdir(parents=True)
    links = {entry.name: entry for entry in (ROOT / "ucp").iterdir() if entry.name != "__pycache__"}
    links.update({name: ROOT / folder for name, folder in MAPPED.items()})
    for name, target in links.items():
        (package / name).symlink_to(target)


def repository_path(line: str) -> str:
    """A mypy output line with build/typecheck's path replaced by the repository's."""
    for name, folder in MAPPED.items():
        if line.startswith(f"ucp/{name}/"):
            return folder + line[len(f"ucp/{name}"):]
    return line


def main() -> int:
    from mypy import api

    lay_out()
    os.chdir(TREE)
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "pyproject.toml"),
                                      "--cache-dir", str(TREE / ".mypy_cache"), "-p", "ucp", *sys.argv[1:]])
    sys.stdout.write("".join(repository_path(line) for line in stdout.splitlines(keepends=True)))
    sys.stderr.write(stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
