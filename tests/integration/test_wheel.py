"""The package as users get it (issue #41, part 6): `python -m build`'s sdist and wheel of the distribution
`ucp-checkpoint` pass `twine check`, hold what a build and an install need and nothing at the top level but `ucp`,
and the wheel, installed into an empty venv, runs `ucp demo` (exit 0 and the resumed losses matching: what
`make demo` shows)."""
from __future__ import annotations

import contextlib
import email.parser
import fcntl
import hashlib
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.launch import ds_env, run_logged

REPO = Path(__file__).resolve().parents[2]
DIST = "ucp-checkpoint"  # PyPI's `ucp` is an unrelated project; the import name stays `ucp`
# The Makefile's pin: pip then takes the CPU build this machine's wheels hold, not a multi-GB CUDA one.
TORCH = "torch==2.13.0"
CACHE = Path("~/.cache/ucp-tests").expanduser()
# setup.cfg's package_dir: where each folder of the repository lands in the installed package.
FOLDERS = {"ucp": "ucp", "converters": "ucp/converters", "patterns": "ucp/patterns", "cli": "ucp/cli"}


def source_modules() -> list[str]:
    return sorted(p.relative_to(REPO).as_posix() for folder in FOLDERS for p in (REPO / folder).rglob("*.py")
                  if "__pycache__" not in p.parts)


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """The sdist, and the wheel `python -m build` makes from it (so the wheel proves the sdist builds)."""
    out = tmp_path_factory.mktemp("dist")
    run_logged([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)], out / "build.log", timeout=600)
    return {"sdist": next(out.glob("*.tar.gz")), "wheel": next(out.glob("*.whl"))}


def test_the_distributions_are_named_ucp_checkpoint_and_pass_twine_check(dists):
    assert dists["wheel"].name.startswith("ucp_checkpoint-") and dists["sdist"].name.startswith("ucp_checkpoint-")
    with zipfile.ZipFile(dists["wheel"]) as whl:
        meta_name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(whl.read(meta_name).decode())
    assert metadata["Name"] == DIST
    subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dists.values())], check=True,
                   capture_output=True, timeout=300)


def test_the_sdist_holds_what_a_build_needs(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"README.md", "setup.cfg", "pyproject.toml", "PKG-INFO"} <= names
    assert sorted(set(source_modules()) - names) == []


def test_the_wheel_installs_ucp_alone_at_the_top_level(dists):
    with zipfile.ZipFile(dists["wheel"]) as whl:
        names = whl.namelist()
    assert sorted({n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}) == ["ucp"]
    installed = {f"{FOLDERS[m.split('/')[0]]}/{m.split('/', 1)[1]}" for m in source_modules()}
    assert sorted(installed - set(names)) == []


def pip(python: Path, args: list[str], log: Path, env: dict[str, str]) -> None:
    run_logged([python, "-m", "pip", "--disable-pip-version-check", *args], log, timeout=900, env=env)


@contextlib.contextmanager
def wheel_venv(wheel: Path, log: Path, env: dict[str, str]) -> Iterator[Path]:
    """A venv without the system's packages holding `TORCH` and the wheel with the `deepspeed` extra, and nothing
    else; yields its folder.

    The venv (with the ops DeepSpeed compiles in it at its first run, minutes on 2 busy cores) is kept in
    ~/.cache/ucp-tests for the next run, keyed by what decides its contents: the Python, the torch pin and the
    wheel's requirements (any change makes a new one). A later run reinstalls only the wheel. One run at a time
    uses it (a lock), so an op `lock` file there is a killed run's, and removed.
    """
    with zipfile.ZipFile(wheel) as whl:
        metadata = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = sorted(line for line in metadata.splitlines() if line.startswith("Requires-Dist:"))
    key = hashlib.sha256("\n".join([sys.version, TORCH, *requires]).encode()).hexdigest()[:16]
    CACHE.mkdir(parents=True, exist_ok=True)
    root = CACHE / f"wheel-venv-{key}"
    python = root / "venv" / "bin" / "python"
    with open(CACHE / "wheel-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for old in CACHE.glob("wheel-venv-*/"):
            if old != root:
                shutil.rmtree(old)
        if (root / "complete").exists():
            pip(python, ["install", "--quiet", "--no-deps", "--force-reinstall", str(wheel)], log, env)
        else:
            shutil.rmtree(root, ignore_errors=True)
            venv.create(root / "venv", with_pip=True)
            pip(python, ["install", "--quiet", "--no-compile", TORCH, f"{wheel}[deepspeed]"], log, env)
            (root / "complete").touch()
        pip(python, ["check"], log, env)
        for stale in (root / "torch_extensions").glob("*/lock"):
            stale.unlink()
        yield root


@pytest.mark.slow
def test_the_wheel_runs_the_demo_in_an_empty_venv(dists, tmp_path):
    env = {k: v for k, v in ds_env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    log = tmp_path / "wheel.log"
    with wheel_venv(dists["wheel"], log, env) as root:
        # the venv's own ops, apart from the suite's (one folder for both would rebuild them in turn)
        env["TORCH_EXTENSIONS_DIR"] = str(root / "torch_extensions")
        where = subprocess.run([root / "venv" / "bin" / "python", "-c", "import ucp; print(ucp.__file__)"],
                               capture_output=True, text=True, env=env, cwd=tmp_path, check=True, timeout=120)
        assert Path(where.stdout.strip()).is_relative_to(root / "venv"), where.stdout
        run_logged([root / "venv" / "bin" / "ucp", "demo", "--workdir", tmp_path / "demo"], log, timeout=900,
                   env=env, cwd=tmp_path)
    text = log.read_text()
    assert "largest relative difference" in text and "terminate called" not in text, text[-3000:]
