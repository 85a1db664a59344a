"""What `pip install ucp` (not editable) installs: every module of the source tree, under `ucp`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# setup.cfg's package_dir: where each folder of the repository lands in the installed package.
FOLDERS = {"ucp": "ucp", "converters": "ucp/converters", "patterns": "ucp/patterns", "cli": "ucp/cli"}


def test_a_regular_install_holds_every_module_of_the_source_tree(tmp_path):
    # setuptools' own build step, as a wheel gets its files (an editable install maps folders and hides a package
    # missing from setup.cfg's list).
    subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
                    "--build-lib", str(tmp_path)], cwd=ROOT, check=True, capture_output=True)
    built = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.py")}
    assert "ucp/format/crc.py" in built  # the probe sees the build
    source = {f"{installed}/{p.relative_to(ROOT / folder).as_posix()}"
              for folder, installed in FOLDERS.items() for p in (ROOT / folder).rglob("*.py")
              if "__pycache__" not in p.parts}
    assert sorted(source - built) == []
