"""A CLI error stays one line whatever another package warns at import (issue #43, part 6); ucp's own warnings show.

The case: the deprecated `pynvml` package (DLRover's k8s extra installs it; so do many GPU machines) warns with a
two-line `FutureWarning` whenever it is imported, and `import torch` imports it. The tests put a `pynvml` that
does what the deprecated package does at import (the same warning, the same text) on PYTHONPATH, so that the real
`import torch` inside a real `ucp` command raises it.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest

import ucp.checkpoint
import ucp.cli.main
import ucp.converters
from ucp.cli.warnings_route import warnings_routed

UCP = [sys.executable, "-m", "ucp.cli.main"]
PYNVML_MSG = ("The pynvml package is deprecated. Please install nvidia-ml-py instead. If you did not install pynvml "
              "directly, please report this to the maintainers of the package that installed pynvml for you.")


@pytest.fixture(scope="module")
def pynvml_env(tmp_path_factory) -> dict[str, str]:
    """An environment whose `import pynvml` warns as the deprecated package does."""
    root = tmp_path_factory.mktemp("deprecated_pynvml")
    (root / "pynvml").mkdir()
    (root / "pynvml" / "__init__.py").write_text(
        f"import warnings\nwarnings.warn({PYNVML_MSG!r}, FutureWarning, stacklevel=2)\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *os.environ.get("PYTHONPATH", "").split(
        os.pathsep)]).rstrip(os.pathsep)}


def test_the_deprecated_pynvml_makes_import_torch_print_two_lines(pynvml_env, tmp_path):
    """Negative control: in this environment a plain `import torch` prints the warning, two lines."""
    out = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, cwd=tmp_path,
                         env=pynvml_env, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].endswith(f"FutureWarning: {PYNVML_MSG}"), out.stderr


def test_a_cli_error_stays_one_line_when_a_package_warns_at_import(pynvml_env, tmp_path):
    (tmp_path / "IN").mkdir()
    line = ("ucp inspect: error: IN: no 'latest' file, no model-states files and no checkpoint-N folders here; pass "
            "--tag (tags present: none)\n")
    out = subprocess.run([*UCP, "inspect", "IN"], capture_output=True, text=True, cwd=tmp_path, env=pynvml_env,
                         timeout=120)
    assert (out.returncode, out.stderr) == (2, line)
    # --debug shows it: so the command did import torch, and the warning was set aside, not lost
    out = subprocess.run([*UCP, "--debug", "inspect", "IN"], capture_output=True, text=True, cwd=tmp_path,
                         env=pynvml_env, timeout=120)
    assert f"FutureWarning: {PYNVML_MSG}" in out.stderr and out.stderr.endswith(line), out.stderr


def test_ucp_own_warnings_are_note_lines_and_others_are_set_aside(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger="ucp")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with warnings_routed(debug=False):
            for module in (ucp.checkpoint, ucp.cli.main, ucp.converters):  # the package and a folder mapped under it
                warnings.warn_explicit(f"from {module.__name__}", UserWarning, module.__file__, 1)
            warnings.warn_explicit("from a plugin", FutureWarning, str(tmp_path / "plugin.py"), 1)
            warnings.warn_explicit("from <string>", UserWarning, "<string>", 1)
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ucp", "WARNING", "from ucp.checkpoint"), ("ucp", "WARNING", "from ucp.cli.main"),
        ("ucp", "WARNING", "from ucp.converters")]
    assert capsys.readouterr().err == ""


def test_debug_shows_other_packages_warnings_on_stderr(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown_before = warnings.showwarning
        with warnings_routed(debug=True):
            warnings.warn_explicit("from a plugin", FutureWarning, str(tmp_path / "plugin.py"), 7)
        assert warnings.showwarning is shown_before  # the command's end puts Python's own back
    assert capsys.readouterr().err == f"{tmp_path / 'plugin.py'}:7: FutureWarning: from a plugin\n"
    assert logging.getLogger("py.warnings").handlers == []
