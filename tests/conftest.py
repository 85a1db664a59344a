"""Session fixtures that build real DeepSpeed checkpoints on CPU (see tests/support/).

Set ``UCP_TEST_CACHE=/some/dir`` to keep built checkpoints across pytest sessions; entries are
keyed by a fingerprint of tests/support/train_tiny.py and the torch/deepspeed versions.
"""

import os
import subprocess
from pathlib import Path

os.environ["DS_ACCELERATOR"] = "cpu"
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/ucp-tests/torch_extensions"))

import pytest  # noqa: E402

from support.checkpoints import (  # noqa: E402
    TinySpec,
    build_checkpoint,
    read_tag,
    run_ds_to_universal,
    source_fingerprint,
    tag_dir,
)


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> Path:
    """Folder holding every checkpoint built in this session."""
    cache = os.environ.get("UCP_TEST_CACHE")
    if cache:
        root = Path(cache).expanduser().resolve() / source_fingerprint()
        root.mkdir(parents=True, exist_ok=True)
        return root
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="session")
def tiny_checkpoint(ckpt_root):
    """Factory: ``tiny_checkpoint(TinySpec(...)) -> save_dir`` (contains ``latest`` and ``<tag>/``)."""
    memo: dict[TinySpec, Path] = {}

    def make(spec: TinySpec) -> Path:
        if spec not in memo:
            memo[spec] = build_checkpoint(spec, ckpt_root)
        return memo[spec]

    return make


@pytest.fixture(scope="session")
def tiny_conversion(tiny_checkpoint, tmp_path_factory):
    """Factory: ``tiny_conversion(TinySpec(...)) -> folder``, ``ucp convert --workers 2`` of the tiny checkpoint
    (once per session; tests copy it before damaging it)."""
    from ucp.convert import convert

    memo: dict[TinySpec, Path] = {}

    def make(spec: TinySpec) -> Path:
        if spec not in memo:
            memo[spec] = convert(tiny_checkpoint(spec), tmp_path_factory.mktemp("ucp") / spec.name, workers=2,
                                 progress=False).output
        return memo[spec]

    return make


@pytest.fixture(scope="session")
def ds_universal(ckpt_root, tiny_checkpoint):
    """Factory: ``ds_universal(TinySpec(...)) -> out_dir`` of DeepSpeed's ds_to_universal.py.

    ``out_dir = <ckpt_root>/<spec.name>/ds_universal/<tag>``; ``out_dir.parent`` holds
    ``latest_universal``, so stock DeepSpeed resumes with
    ``load_checkpoint(out_dir.parent, tag=out_dir.name)`` and ``checkpoint.load_universal``.
    """
    memo: dict[TinySpec, Path] = {}

    def make(spec: TinySpec) -> Path:
        if spec not in memo:
            save_dir = tiny_checkpoint(spec)
            out = ckpt_root / spec.name / "ds_universal" / read_tag(save_dir)
            memo[spec] = run_ds_to_universal(tag_dir(save_dir), out)
        return memo[spec]

    return make


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 16 KiB tmpfs, smaller than any checkpoint or export of the tests: a disk that fills up (mounting
    needs root; skipped elsewhere, with the reason)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()}); needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)
