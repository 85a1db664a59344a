"""`ucp convert --splits K` on real DeepSpeed checkpoints: same tensors, split-major bytes, and a resume
through the DeepSpeed hook identical to one from the plain conversion."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import ucp
from support.checkpoints import TinySpec, ucp_resume
from ucp.convert.split_policy import SplitPolicy
from ucp.errors import OutputExistsError

# The tiny model's tensors (tests/support/train_tiny.py) given Megatron-style dims: l1 column-parallel,
# l2 row-parallel, embedding and head vocab-parallel; biases of l2 and the rest whole.
RULES = {r"^l1\.(weight|bias)$": 0, r"^l2\.weight$": 1, r"^(emb|head)\.weight$": 0, r"^head\.bias$": 0}
SOURCE = TinySpec(stage=2)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def converted(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint(SOURCE)
    root = tmp_path_factory.mktemp("splits")
    rules = root / "rules.json"
    rules.write_text(json.dumps(RULES))
    plain, split = root / "plain", root / "split"
    for out, extra in ((plain, []), (split, ["--splits", "3", "--split-rules", str(rules)])):
        subprocess.run([sys.executable, "-m", "ucp.cli.main", "convert", "--input", str(src), "--output", str(out),
                        "--workers", "2", "--quiet", *extra], check=True, capture_output=True, text=True)
    return src, plain, split


def test_split_conversion_holds_the_same_tensors(converted):
    _, plain, split = converted
    a, b = ucp.open_checkpoint(plain), ucp.open_checkpoint(split)
    assert b.index.global_split == 3 and a.index.global_split == 1
    assert b.index.params["l2.weight"].states["exp_avg"].splits == (1, 3)
    assert b.index.params["l2.bias"].states["fp32"].splits is None
    assert b.verify() == []
    for name in a.names:
        for state in a.states(name):
            assert torch.equal(a.tensor(name, state), b.tensor(name, state)), (name, state)
    # Row-parallel states really are stored in another order (negative control for the check above).
    e = b.index.params["l2.weight"].states["fp32"]
    raw = torch.from_file(str(split / e.file), size=e.end, dtype=torch.uint8)[e.begin:]
    assert not torch.equal(raw.view(torch.float32).reshape(5, 9), a.tensor("l2.weight"))


def test_another_split_layout_is_another_conversion(converted, tmp_path):
    from ucp.convert import convert

    src, plain, _ = converted
    with pytest.raises(OutputExistsError, match="already holds a different checkpoint"):
        convert(src, plain, splits=SplitPolicy(3, tuple(RULES.items())), progress=False)


def test_split_option_errors(converted, tmp_path):
    src, _, _ = converted
    out = subprocess.run([sys.executable, "-m", "ucp.cli.main", "convert", "--input", str(src), "--output",
                          str(tmp_path / "x"), "--split-rules", "r.json"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip() == "ucp convert: error: --split-rules needs --splits K"
    out = subprocess.run([sys.executable, "-m", "ucp.cli.main", "convert", "--input", str(src), "--output",
                          str(tmp_path / "y"), "--splits", "2", "--format", "deepspeed"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--splits works with --format ucp only" in out.stderr


def test_deepspeed_hook_resumes_a_split_checkpoint_like_the_plain_one(converted, ckpt_root):
    _, plain, split = converted
    target = TinySpec(stage=3, world_size=3)
    a = ucp_resume(plain, target, 2, SOURCE.steps, ckpt_root)
    b = ucp_resume(split, target, 2, SOURCE.steps, ckpt_root)
    assert b.losses == a.losses
