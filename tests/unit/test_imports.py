"""The core must not pull in ray or deepspeed: they are adapters, imported only where used."""
import subprocess
import sys


def imported(modules: str, heavy: tuple[str, ...]) -> list[str]:
    """Which of `heavy` a fresh interpreter has loaded after `import <modules>`."""
    code = f"import sys, {modules}; print('loaded:' + ','.join(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    last = out.stdout.strip().splitlines()[-1]  # what the imports print themselves comes before
    return [m for m in last.removeprefix("loaded:").split(",") if m]


def test_import_ucp_pulls_in_neither_ray_nor_deepspeed():
    assert imported("ucp, ucp.checkpoint, ucp.convert, ucp.convert.driver, ucp.patterns, ucp.plan.primitives, "
                    "ucp.converters.dispatch, ucp.format.index, ucp.hmp.slice_load", ("ray", "deepspeed")) == []


def test_import_ucp_and_the_planning_side_pull_in_no_torch():
    assert imported("ucp, ucp.errors, ucp.hmp, ucp.hmp.layout, ucp.hmp.strategy, ucp.hmp.model_shapes",
                    ("torch", "ray", "deepspeed")) == []


def test_local_checkpoints_import_no_object_store_client():
    """boto3 is imported by ucp.storage.s3 alone, when an s3:// location is first used (issue #22)."""
    assert imported("ucp, ucp.checkpoint, ucp.storage.layer, ucp.format.folder, ucp.format.box_read, "
                    "ucp.convert.driver, ucp.format.checked_read", ("boto3", "botocore", "s3fs", "fsspec")) == []
    assert imported("ucp.storage.s3; ucp.storage.s3._client()", ("boto3",)) == ["boto3"]  # control


def test_local_and_s3_locations_import_no_fsspec():
    """fsspec is imported by ucp.storage.fsspec alone, when a URL of another protocol is first seen."""
    assert imported("ucp.storage.locations; ucp.storage.locations.location('ckpt/run1'); "
                    "ucp.storage.locations.location('file:///ckpt/run1'); "
                    "ucp.storage.locations.location('s3://bucket/run1')", ("fsspec",)) == []
    assert imported("ucp.storage.locations; ucp.storage.locations.location('memory://bucket/run1')",
                    ("fsspec",)) == ["fsspec"]  # control


def test_cli_help_does_not_import_torch():
    code = ("import sys; from ucp.cli.main import build_parser; build_parser().format_help();"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_generic_folder_names_are_not_installed_top_level(tmp_path):
    # Run outside the repository so only what is installed is importable.
    code = ("import importlib.util, pathlib, ucp; root = pathlib.Path(ucp.__file__).resolve().parent.parent;"
            "specs = [importlib.util.find_spec(n) for n in ('cli', 'patterns', 'converters')];"
            "print([s.origin for s in specs if s and s.origin and str(root) in str(s.origin)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "[]"


def test_export_pulls_in_neither_transformers_nor_deepspeed_until_it_checks_an_architecture():
    assert imported("ucp.export, ucp.export.hf, ucp.export.dcp, ucp.export.model_config",
                    ("ray", "deepspeed", "transformers")) == []


def test_conversion_modules_import_no_torch():
    """`ucp convert` (plan, copy, checks, the Ray tasks' writer) runs without torch; torch stays at the engine edge."""
    assert imported("ucp.convert, ucp.convert.driver, ucp.convert.bin_copy, ucp.converters.dispatch, "
                    "ucp.convert.source_check, ucp.convert.tensors, ucp.cli.commands",
                    ("torch",)) == []
    assert imported("ucp.checkpoint", ("torch",)) == ["torch"]  # negative control: the probe sees torch
