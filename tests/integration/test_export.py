"""`ucp export`: transformers folders and PyTorch DCP checkpoints from DeepSpeed ZeRO-2/3 checkpoints of tiny,
tied Hugging Face models (Llama, GPT-2) trained on 2 CPU ranks (support/train_hf_model.py).

The references are what the live DeepSpeed engine held at save time: its fp32 masters and Adam moments,
its logits on a probe batch, and the losses of the steps it trained after saving.
"""
from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ucp
from support.checkpoints import SUPPORT_DIR
from support.launch import run_torchrun
from support.parallel import Family, build_family
from support.s3_proxy import BUCKET
from support.train_hf_model import OPTIMIZER, load_dcp, probe_ids
from ucp.cli.main import main
from ucp.convert import convert
from ucp.converters.deepspeed.slices import load_dict
from ucp.converters.torch_zip import read_tensor
from ucp.errors import CheckpointNotFoundError, ExportError, OutputExistsError, UnsupportedLayoutError
from ucp.export import to_dcp, to_hf

# dcp.load outside a process group says it assumes one process, which is what these tests do.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

AFTER = 3  # steps the llama ZeRO-2 run trains after saving: the losses a resumed job must continue
# DeepSpeed's own Adam (no torch_adam: FusedAdam, whose CPU op DeepSpeed compiles at first use) with the
# hyper-parameters of the other runs; and the two settings under which torch's AdamW computes another update.
DS_ADAM = {key: value for key, value in OPTIMIZER["params"].items() if key != "torch_adam"}
HF = Family.of("hf-tied", "train_hf_model.py", 2, {
    "llama-z2": {"model": "llama", "stage": 2, "after": AFTER},
    "llama-z3": {"model": "llama", "stage": 3},
    "gpt2-z2": {"model": "gpt2", "stage": 2},
    "llama-z2-bf16": {"model": "llama", "stage": 2, "dtype": "bf16"},
    "ds-adamw": {"model": "llama", "stage": 2, "after": AFTER, "optimizer": {"type": "AdamW", "params": DS_ADAM}},
    "ds-adam-l2": {"model": "llama", "stage": 2,
                   "optimizer": {"type": "Adam", "params": {**DS_ADAM, "adam_w_mode": False}}},
    "ds-no-bias-correction": {"model": "llama", "stage": 2,
                              "optimizer": {"type": "AdamW", "params": {**DS_ADAM, "bias_correction": False}}},
}, steps=3)
SUPPORT = SUPPORT_DIR


@pytest.fixture(scope="module")
def runs(ckpt_root) -> Path:
    return build_family(HF, ckpt_root)


def live(run_dir: Path) -> dict:
    return torch.load(run_dir / "state.pt", map_location="cpu", weights_only=False)


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    # The runs trained with eager attention, which config.json does not record (from_pretrained would take sdpa,
    # whose logits differ in the last bit).
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")


@pytest.mark.parametrize("run", ["llama-z2", "llama-z3", "gpt2-z2"])
def test_hf_export_loads_the_live_masters_ties_and_logits(runs, run, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", "--input", str(runs / run / "ckpt"), "--output", str(out), "--to", "hf", "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert "lm_head.weight" not in f.keys()  # the tied copy is stored once, as save_pretrained does
    model = load_hf(out)
    ref = live(runs / run)
    params = dict(model.named_parameters())
    assert set(params) == set(ref["params"])  # named_parameters lists a tied weight once
    for name, states in ref["params"].items():
        assert torch.equal(params[name], states["fp32"]), name
    assert model.lm_head.weight is model.get_input_embeddings().weight
    with torch.no_grad():
        logits = model(input_ids=probe_ids(model.config.vocab_size)).logits
    assert torch.equal(logits, ref["logits"])
    # Negative control: one weight off by one ulp changes the logits, so the check above can fail.
    with torch.no_grad():
        w = model.get_input_embeddings().weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(float("inf")))
        assert not torch.equal(model(input_ids=probe_ids(model.config.vocab_size)).logits, ref["logits"])


def test_hf_export_of_a_ucp_checkpoint_in_bfloat16_shards(runs, tmp_path):
    """A ucp checkpoint carries the Trainer-style config.json as an extra file; bf16 files hold the masters cast."""
    atomic = tmp_path / "ucp"
    convert(runs / "llama-z2" / "ckpt", atomic, workers=1, progress=False)
    assert "config.json" in ucp.open_checkpoint(atomic).extra_files
    out = tmp_path / "hf"
    result = to_hf(atomic, out, dtype="bfloat16", max_shard_size="4KB", progress=False)
    assert len(result.files) > 1 and result.files[0] == f"model-00001-of-{len(result.files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    ref = live(runs / "llama-z2")["params"]
    assert set(index["weight_map"]) == set(ref)
    assert index["metadata"]["total_size"] == sum(t["fp32"].numel() * 2 for t in ref.values())
    for name, states in ref.items():
        with safe_open(out / index["weight_map"][name], "pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert torch.equal(f.get_tensor(name), states["fp32"].to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = load_hf(out)
    assert model.dtype == torch.bfloat16 and model.lm_head.weight is model.get_input_embeddings().weight
    assert torch.equal(model.model.norm.weight, ref["model.norm.weight"]["fp32"].to(torch.bfloat16))


def test_hf_export_reading_ahead_on_threads_writes_the_same_bytes(runs, tmp_path):
    for workers in (1, 3):
        to_hf(runs / "gpt2-z2" / "ckpt", tmp_path / f"w{workers}", workers=workers, max_shard_size="8KB",
              progress=False)
    files = sorted(p.name for p in (tmp_path / "w1").iterdir())
    assert len(files) > 3 and files == sorted(p.name for p in (tmp_path / "w3").iterdir())
    for name in files:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w3" / name).read_bytes(), name


def test_hf_export_copies_generation_config_and_tokenizer_files(runs, tmp_path):
    """From the files a checkpoint carries (a Trainer's checkpoint-N, and its ucp conversion), or beside --config."""
    extras = {"generation_config.json": b'{"max_new_tokens": 5}\n',
              "tokenizer_config.json": b'{"model_max_length": 64}\n'}
    trainer_folder = tmp_path / "checkpoint-3"
    shutil.copytree(runs / "llama-z2" / "ckpt", trainer_folder)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(trainer_folder / "config.json", model_dir)
    for folder in (trainer_folder, model_dir):
        for name, data in extras.items():
            (folder / name).write_bytes(data)
    convert(trainer_folder, tmp_path / "ucp", workers=1, progress=False)
    to_hf(trainer_folder, tmp_path / "from-deepspeed", progress=False)
    to_hf(tmp_path / "ucp", tmp_path / "from-ucp", progress=False)
    to_hf(runs / "llama-z2" / "ckpt" / "global_step3", tmp_path / "from-config", config=model_dir, progress=False)
    for out in ("from-deepspeed", "from-ucp", "from-config"):
        assert {n: (tmp_path / out / n).read_bytes() for n in extras} == extras, out


@pytest.mark.parametrize("run, via_ucp", [("llama-z2", False), ("llama-z3", False), ("llama-z2-bf16", False),
                                          ("llama-z3", True)])
def test_dcp_export_loads_every_parameter_and_moment_in_one_process(runs, run, via_ucp, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    source = runs / run / "ckpt"
    if via_ucp:  # from a ucp checkpoint instead of the DeepSpeed one
        convert(source, tmp_path / "ucp", workers=1, progress=False)
        source = tmp_path / "ucp"
    out = tmp_path / "dcp"
    assert main(["export", "--input", str(source), "--output", str(out), "--to", "dcp", "--quiet"]) == 0
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(runs / run / "ckpt"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, betas=(0.5, 0.5), weight_decay=0.0)
    ref = live(runs / run)["params"]
    # Negative control: the fresh model does not hold the masters, so the comparison below can fail.
    assert not torch.equal(model.model.embed_tokens.weight, ref["model.embed_tokens.weight"]["fp32"])
    load_dcp(model, optimizer, out)
    params = dict(model.named_parameters())
    assert model.lm_head.weight is model.get_input_embeddings().weight
    for name, states in ref.items():
        assert torch.equal(params[name], states["fp32"]), name
        held = optimizer.state[params[name]]
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(held[moment], states[moment]), (name, moment)
        assert torch.equal(held["step"], torch.tensor(3.0)), name
    (group,) = optimizer.param_groups
    assert (group["lr"], list(group["betas"]), group["eps"], group["weight_decay"]) == (1e-2, [0.9, 0.95], 1e-8, 0.1)


def test_exports_of_a_bf16_run_hold_the_fp32_masters_and_not_the_bf16_tied_copy(runs, tmp_path):
    import torch.distributed.checkpoint as dcp

    ckpt = runs / "llama-z2-bf16" / "ckpt"
    ref = live(runs / "llama-z2-bf16")["params"]
    model = load_hf(to_hf(ckpt, tmp_path / "hf", progress=False).output)
    params = dict(model.named_parameters())
    for name, states in ref.items():
        assert torch.equal(params[name], states["fp32"]), name
    assert model.lm_head.weight is model.get_input_embeddings().weight
    to_dcp(ckpt, tmp_path / "dcp", progress=False)
    master = ref["model.embed_tokens.weight"]["fp32"]
    head = {"model": {"lm_head.weight": torch.empty_like(master)}}
    dcp.load(head, checkpoint_id=tmp_path / "dcp")
    assert torch.equal(head["model"]["lm_head.weight"], master)
    # The checkpoint records lm_head.weight as an alias of the master; the module's own copy of it in
    # DeepSpeed's files (negative control) is the bf16 one, which the export must not take.
    assert ucp.open_checkpoint(ckpt).aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    model_file = next((ckpt / (ckpt / "latest").read_text().strip()).glob("mp_rank_00_model_states.pt"))
    bf16_copy = read_tensor(load_dict(model_file)["module"]["lm_head.weight"]).float()
    assert torch.equal(bf16_copy, master.to(torch.bfloat16).float()) and not torch.equal(bf16_copy, master)


def test_fsdp2_job_resumes_a_dcp_export_with_the_losses_of_the_uninterrupted_run(runs, tmp_path):
    out = tmp_path / "dcp"
    to_dcp(runs / "llama-z2" / "ckpt", out, progress=False)
    result = tmp_path / "fsdp2.json"
    run_torchrun(SUPPORT / "fsdp2_resume.py", ["--dcp", str(out), "--config", str(runs / "llama-z2" / "ckpt"),
                                               "--from-step", str(HF.steps), "--steps", str(AFTER),
                                               "--out", str(result)], 2, tmp_path / "fsdp2.log")
    got = json.loads(result.read_text())
    expected = live(runs / "llama-z2")["losses_after"]
    # Equal to the bit: FSDP2 computes what DeepSpeed ZeRO-2 did (fp32, same batches, torch's AdamW, no gradient
    # clipping, two ranks' gradients averaged, which is exact), from the exported weights, moments and steps.
    assert got["losses"] == expected
    # Negative control: the same job without the export trains to other losses from the first step.
    assert abs(got["fresh_losses"][0] - expected[0]) > 1e-2


def test_dcp_export_of_deepspeeds_own_adam_resumes_in_torch_adamw(runs, tmp_path):
    """DeepSpeed's own AdamW keeps other param-group keys than torch's (bias_correction, no amsgrad, ...); the
    export holds torch.optim.AdamW's, so an FSDP2 job loads it and trains on with the uninterrupted run's losses."""
    ckpt = runs / "ds-adamw" / "ckpt"
    assert ucp.open_checkpoint(ckpt).optimizer["param_groups"][0]["hyperparams"].keys() == {
        "lr", "bias_correction", "betas", "eps", "weight_decay", "step"}  # FusedAdam's, not torch's
    out = tmp_path / "dcp"
    assert main(["export", "--input", str(ckpt), "--output", str(out), "--to", "dcp", "--quiet"]) == 0
    result = tmp_path / "fsdp2.json"
    run_torchrun(SUPPORT / "fsdp2_resume.py", ["--dcp", str(out), "--config", str(ckpt), "--from-step",
                                               str(HF.steps), "--steps", str(AFTER), "--out", str(result)],
                 2, tmp_path / "fsdp2.log")
    got = json.loads(result.read_text())
    expected = live(runs / "ds-adamw")["losses_after"]
    # Not to the bit: DeepSpeed's CPU Adam kernel computes the same update as torch's AdamW in another order
    # (vectorised, fused multiply-adds), about an ulp per element and step; three steps on, the losses agree to
    # ~1e-7 (fp32).
    assert got["losses"] == pytest.approx(expected, rel=1e-6)
    assert abs(got["fresh_losses"][0] - expected[0]) > 1e-2  # negative control: without the export


@pytest.mark.parametrize("run, key, allowed", [("ds-adam-l2", "adam_w_mode", "torch.optim.Adam"),
                                               ("ds-no-bias-correction", "bias_correction", "saved")])
def test_dcp_export_refuses_torch_adamw_where_the_update_differs(runs, run, key, allowed, tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = runs / run / "ckpt"
    out = tmp_path / "dcp"
    assert_one_line_error(["export", "--input", str(ckpt), "--output", str(out), "--to", "dcp"], capsys, key,
                          f"--optimizer {allowed}")
    assert not out.exists()
    assert main(["export", "--input", str(ckpt), "--output", str(out), "--to", "dcp", "--optimizer", allowed,
                 "--quiet"]) == 0
    if allowed == "torch.optim.Adam":  # L2 weight decay, as torch's Adam computes it
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt))
        optimizer = torch.optim.Adam(model.parameters(), weight_decay=0.5, decoupled_weight_decay=True)
        load_dcp(model, optimizer, out)
        (group,) = optimizer.param_groups
        assert (group["weight_decay"], group["decoupled_weight_decay"], group["amsgrad"]) == (0.1, False, False)


# ---- bad input: one-line errors, and nothing that looks like a finished export -------------------------------


def copy_checkpoint(runs: Path, tmp_path: Path, config: dict | None) -> Path:
    """A copy of the llama ZeRO-2 save folder whose config.json is `config` (None: no config.json)."""
    ckpt = tmp_path / "checkpoint-3"
    shutil.copytree(runs / "llama-z2" / "ckpt", ckpt)
    if config is None:
        (ckpt / "config.json").unlink()
    else:
        (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


def assert_one_line_error(argv: list[str], capsys, *words: str, code: int = 2) -> None:
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ucp export: error: "), err
    for word in words:
        assert word in err, err


def test_missing_config_is_refused(runs, tmp_path, capsys):
    ckpt = copy_checkpoint(runs, tmp_path, None)
    out = tmp_path / "hf"
    with pytest.raises(CheckpointNotFoundError, match="no config.json among the files the checkpoint carries; "
                                                      "pass --config"):
        to_hf(ckpt, out, progress=False)
    assert_one_line_error(["export", "--input", str(ckpt), "--output", str(out), "--to", "hf"], capsys,
                          str(ckpt), "--config")
    assert not out.exists()


def test_unknown_architecture_without_config_is_refused(runs, tmp_path, capsys):
    config = json.loads((runs / "llama-z2" / "ckpt" / "config.json").read_text())
    ckpt = copy_checkpoint(runs, tmp_path, {**config, "architectures": ["NoSuchForCausalLM"]})
    out = tmp_path / "hf"
    with pytest.raises(UnsupportedLayoutError, match="unknown architecture 'NoSuchForCausalLM'.*--config"):
        to_hf(ckpt, out, progress=False)
    ckpt = copy_checkpoint(runs, tmp_path / "b", {**config, "model_type": "no-such-model", "architectures": []})
    assert_one_line_error(["export", "--input", str(ckpt), "--output", str(out), "--to", "hf"], capsys,
                          "unknown model_type 'no-such-model'", "--config")
    assert not out.exists()


def test_a_config_of_another_architecture_is_refused_naming_the_tensor(runs, tmp_path):
    out = tmp_path / "hf"
    with pytest.raises(ExportError, match="tensor 'model.embed_tokens.weight' is not in GPT2LMHeadModel's state dict"):
        to_hf(runs / "llama-z2" / "ckpt", out, config=runs / "gpt2-z2" / "ckpt" / "config.json", progress=False)
    config = json.loads((runs / "llama-z2" / "ckpt" / "config.json").read_text())
    (tmp_path / "wide.json").write_text(json.dumps({**config, "intermediate_size": 32}))
    with pytest.raises(ExportError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \[24, 16\], "
                                          r"LlamaForCausalLM expects \[32, 16\]"):
        to_hf(runs / "llama-z2" / "ckpt", out, config=tmp_path / "wide.json", progress=False)
    assert not out.exists()


@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_an_existing_output_is_refused_and_left_alone(runs, tmp_path, capsys, to):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        (to_hf if to == "hf" else to_dcp)(runs / "llama-z2" / "ckpt", out, progress=False)
    assert_one_line_error(["export", "--input", str(runs / "llama-z2" / "ckpt"), "--output", str(out), "--to", to],
                          capsys, str(out), "already exists")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_a_full_disk_mid_export_leaves_nothing_that_looks_complete(runs, small_tmpfs, capsys, to):
    out = small_tmpfs / "export"
    assert_one_line_error(["export", "--input", str(runs / "llama-z2" / "ckpt"), "--output", str(out), "--to", to,
                           "--quiet"], capsys, "no space left on device", "--output", code=3)  # the system refused
    assert list(small_tmpfs.iterdir()) == []  # no output, and the staging folder is gone


@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_an_export_to_s3_is_the_local_export_with_the_file_its_reader_opens_uploaded_last(runs, s3, tmp_path,
                                                                                         capsys, to):
    """`ucp export --output s3://` (moto's server, tests/integration/test_s3.py): the objects are the local
    export's files, byte for byte, and `config.json` (transformers) or `.metadata` (DCP) goes up last, so an
    export cut short is never read as complete; a second export to the prefix is refused and changes nothing."""
    ckpt, prefix = runs / "llama-z2" / "ckpt", f"export-{to}"
    local = (to_hf if to == "hf" else to_dcp)(ckpt, tmp_path / "local", progress=False).output
    s3.proxy.reset()
    argv = ["export", "--to", to, "--input", str(ckpt), "--output", f"s3://{BUCKET}/{prefix}", "--quiet"]
    assert main(argv) == 0
    names = sorted(p.name for p in local.iterdir())
    listed = s3.client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")["Contents"]
    assert sorted(o["Key"] for o in listed) == [f"{prefix}/{n}" for n in names]
    for name in names:
        stored = s3.client.get_object(Bucket=BUCKET, Key=f"{prefix}/{name}")["Body"].read()
        if name == ".metadata":  # DCP's metadata records the folder it was written in (storage_meta): all else
            stored, expected = (dataclasses.replace(pickle.loads(b), storage_meta=None)
                                for b in (stored, (local / name).read_bytes()))
            assert stored == expected
        else:
            assert stored == (local / name).read_bytes(), name
    writes = [r for r in s3.proxy.seen if r.method in ("PUT", "POST")]
    assert writes[-1].path == f"/{BUCKET}/{prefix}/{'config.json' if to == 'hf' else '.metadata'}"
    assert_one_line_error(argv, capsys, f"s3://{BUCKET}/{prefix}", "already holds objects")
    assert len(s3.client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")["Contents"]) == len(names)
