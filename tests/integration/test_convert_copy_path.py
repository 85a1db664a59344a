"""The local conversion (`ucp.convert.bin_copy`: numpy, blocks copied by offset, no torch) and the Ray backend's
reducer (`ucp.convert.driver.stream_bin`) write exactly the bytes of the torch path (Union/StripPad on torch tensors,
streamed by `StreamingWriter`), for every source family of the suite. And `ucp convert` imports no torch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support.checkpoints import TinySpec
from support.fragments import torch_fragment
from support.parallel import build_family
from test_convert_autotp import AUTOTP
from ucp.convert.driver import WriteBin, bin_slots, source_fingerprint, stream_bin, write_bin
from ucp.convert.split_policy import SplitPolicy, apply_split_policy
from ucp.converters.dispatch import plan_deepspeed
from ucp.format.folder import tensor_key
from ucp.format.index import FORMAT_NAME
from ucp.format.safetensors_stream import StreamingWriter
from ucp.format.splits import to_split_major
from ucp.plan.assemble import assemble, materialize
from ucp.plan.balance import plan_bins
from ucp.plan.index_builder import WrittenFile

TINY = [TinySpec(stage=0), TinySpec(stage=1), TinySpec(stage=2), TinySpec(stage=3),
        TinySpec(stage=1, dtype="bf16", world_size=3), TinySpec(stage=3, dtype="bf16", world_size=3),
        TinySpec(stage=1, dtype="bf16", tie="tied"), TinySpec(stage=2, tie="tied")]


def torch_path_bin(task: WriteBin) -> WrittenFile:
    """The bin as the torch path writes it: fragments read as torch tensors, Union/StripPad/cast and split-major
    by torch, the file streamed tensor by tensor by `StreamingWriter` (the writer of `ucp export`); its record."""
    writer = StreamingWriter(str(Path(task.output) / task.file_name), bin_slots(task.params),
                             metadata={"format": FORMAT_NAME}, chunk_bytes=task.chunk_bytes)
    stored = {}
    for p in task.params:
        for state, source in p.states.items():
            tensor = assemble(source, [torch_fragment(f) for f in source.fragments], name=p.name, strict=task.strict)
            if p.splits is not None:
                tensor = to_split_major(tensor, *p.splits)
            stored[tensor_key(p.name, state)] = writer.write(tensor_key(p.name, state), tensor)
    writer.close()
    return WrittenFile(task.file_name, writer.size, task.chunk_bytes, stored)


def ray_path_bin(task: WriteBin) -> WrittenFile:
    """The bin as the Ray backend's reducer writes it (`stream_bin`: states assembled in memory), in this process."""
    return stream_bin(task, lambda nbytes: None,
                      lambda p, source: materialize(source, name=p.name, strict=task.strict))


def assert_same_bytes(save_dir: Path, tmp_path: Path, *, strict: bool = False, splits: SplitPolicy | None = None,
                      chunk_bytes: int = 1 << 20) -> None:
    plan = plan_deepspeed(save_dir)
    if splits is not None:
        plan = apply_split_policy(plan, splits)
    fingerprint = source_fingerprint(plan, chunk_bytes)
    for i, params in enumerate(plan_bins(plan, 2)):
        name = f"data-{i}.safetensors"
        ours, theirs = tmp_path / "copy", tmp_path / "torch"
        ours.mkdir(exist_ok=True)
        theirs.mkdir(exist_ok=True)
        task = WriteBin(str(ours), name, tuple(params), strict, fingerprint, chunk_bytes)
        got = write_bin(task, lambda nbytes: None)
        want = torch_path_bin(WriteBin(str(theirs), name, tuple(params), strict, fingerprint, chunk_bytes))
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
        assert got.sources and got.file == want
        (ours / name).unlink()
        assert ray_path_bin(task) == want and (ours / name).read_bytes() == (theirs / name).read_bytes(), name
        assert len(want.tensors) == len(bin_slots(tuple(params)))


@pytest.mark.slow
@pytest.mark.parametrize("spec", TINY, ids=lambda s: s.name)
def test_copy_path_writes_the_torch_paths_bytes(spec, tiny_checkpoint, tmp_path):
    assert_same_bytes(tiny_checkpoint(spec), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("run", [name for name, _ in AUTOTP.runs])
def test_copy_path_writes_the_torch_paths_bytes_for_autotp(run, ckpt_root, tmp_path):
    assert_same_bytes(build_family(AUTOTP, ckpt_root) / run / "ckpt", tmp_path)


@pytest.mark.slow
def test_strict_split_major_and_small_chunks_too(tiny_checkpoint, tmp_path):
    """--strict (replicas compared), --splits (split-major, assembled in memory), chunks smaller than the pieces."""
    splits = SplitPolicy(2, ((r"l1\.weight", 1), (r"l2\.weight", 0), (".*", None)))
    assert_same_bytes(tiny_checkpoint(TinySpec(stage=1, dtype="bf16", world_size=3)), tmp_path, strict=True,
                      splits=splits, chunk_bytes=4096 + 8)


def test_negative_control_another_dtype_is_other_bytes(tiny_checkpoint, tmp_path):
    """The comparison can fail: storing the fp32 masters as bfloat16 on the copy path changes the file."""
    import dataclasses

    plan = plan_deepspeed(tiny_checkpoint(TinySpec(stage=1)))
    params = tuple(dataclasses.replace(p, states={s: dataclasses.replace(src, dtype="bfloat16")
                                                  for s, src in p.states.items()}) for p in plan.params[:2])
    fingerprint = source_fingerprint(plan)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_bin(WriteBin(str(tmp_path / "a"), "d.safetensors", params, False, fingerprint), lambda n: None)
    torch_path_bin(WriteBin(str(tmp_path / "b"), "d.safetensors", tuple(plan.params[:2]), False, fingerprint))
    assert (tmp_path / "a" / "d.safetensors").read_bytes() != (tmp_path / "b" / "d.safetensors").read_bytes()


# A convert that imports torch fails: the import is refused in the driver and, inherited through fork, in
# every pool worker. --format deepspeed, which writes torch.save files, fails the probe (negative control).
PROBE = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if {refuse} and (name == "torch" or name.startswith("torch.")):
            raise ImportError("torch imported by ucp convert")
sys.meta_path.insert(0, NoTorch())
from ucp.cli.main import main
code = main(["convert", "--input", {source!r}, "--output", {output!r}, "--workers", "2", "--quiet", *{extra!r}])
print("torch loaded:", "torch" in sys.modules)
sys.exit(code)
"""


@pytest.mark.parametrize("spec", [TinySpec(stage=2), TinySpec(stage=3, dtype="bf16", world_size=3)],
                         ids=lambda s: s.name)
def test_convert_imports_no_torch_in_the_driver_or_the_workers(spec, tiny_checkpoint, tmp_path):
    code = PROBE.format(refuse=True, source=str(tiny_checkpoint(spec)), output=str(tmp_path / "out"), extra=[])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "torch loaded: False"


def test_negative_control_the_probe_refuses_a_convert_that_imports_torch(tiny_checkpoint, tmp_path):
    code = PROBE.format(refuse=True, source=str(tiny_checkpoint(TinySpec(stage=2))), output=str(tmp_path / "out"),
                        extra=["--format", "deepspeed"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0 and "torch imported by ucp convert" in done.stderr
    code = PROBE.format(refuse=False, source=str(tiny_checkpoint(TinySpec(stage=2))), output=str(tmp_path / "ds"),
                        extra=["--format", "deepspeed"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "torch loaded: True"
