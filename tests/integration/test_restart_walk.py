"""The walk of one elastic restart through `ucp.deepspeed` and `ucp.elastic` (docs/ARCHITECTURE.md, "One restart
of an elastic job"), recorded from a real restart of the torchrun example (2 ranks, then 1) by
`tests/support/restart_walk.py`: each module is entered once, in the order the documentation gives, but for the
one value type the documentation names with its reason. The same run follows the config through the start (issue
#41): the raw `"ucp"` section is read once, by `ucp.deepspeed.config.read_section` (with `ucp.elastic.shares`, the
reader of its `"elastic"` part), and every other module takes its parts from that typed value."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tests.support.launch import run_torchrun

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "elastic" / "torchrun" / "train.py"
WALKER = ROOT / "tests" / "support" / "restart_walk.py"
# In the order of docs/ARCHITECTURE.md's count.
ORDER = ["hook", "config", "elastic.ranks", "elastic.layout_choice", "elastic", "elastic.rendezvous", "auto_resume",
         "elastic.resume", "loading.load", "elastic.inprocess", "life", "saving.cadence", "saving.saver",
         "saving.snapshot", "saving.metadata", "saving.stores", "saving.index", "elastic.retention", "elastic.restart"]
# Entered again, for the reason docs/ARCHITECTURE.md gives: the batch (`ElasticBatch`), a value that the layout's
# choice, the hook and DeepSpeed's batch keys each ask.
AGAIN = {"elastic.shares": 3}


def test_one_restart_enters_each_module_once(tmp_path):
    save = tmp_path / "save"
    run_torchrun(EXAMPLE, ["--save-dir", save, "--steps", 2], 2, tmp_path / "first.log")
    walk_file = tmp_path / "walk.json"
    run_torchrun(WALKER, [walk_file, EXAMPLE, "--save-dir", save, "--steps", 3], 1, tmp_path / "restart.log")
    walk = json.loads(walk_file.read_text())
    walk = [m for i, m in enumerate(walk) if i == 0 or walk[i - 1] != m]  # the script between start and step
    again = {m: n for m, n in Counter(walk).items() if n > 1}
    assert again == AGAIN, walk
    firsts = [m for i, m in enumerate(walk) if m not in walk[:i] and m != "elastic.shares"]
    assert firsts == ORDER, walk
    assert len(walk) == 22 and len(set(walk)) == 20, walk
    # The raw section goes from initialize's arguments to the one reading and nowhere else. Before #41 it also went
    # to elastic.ranks (layout, _key, _cost_model_inputs, _expert_parallel, _heterogeneous), elastic.layout_choice
    # (allowed_sizes) and, with a memory tier, deepspeed.memory_files.
    raw = json.loads((tmp_path / "walk-raw.json").read_text())
    assert {r.rpartition(".")[0] for r in raw} == {"ucp.deepspeed.hook", "ucp.deepspeed.config", "ucp.elastic.shares"}
    assert [r for r in raw if r.startswith("ucp.deepspeed.hook.")] == ["ucp.deepspeed.hook.initialize"], raw
