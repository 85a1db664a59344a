#!/usr/bin/env python
"""Train a tiny Megatron-DeepSpeed-style GPT with tensor and pipeline parallelism (TP=2 x PP=2) on CPU.

Launched with ``torchrun --nproc_per_node 4 tests/support/train_megatron.py --runs JSON``; ``--runs``
trains several configurations ({stage, dtype, save_dir, dump_state}) one after another in one launch.
A run may also set ``steps``, ``save_after`` (save with DeepSpeed after that many steps and go on
training, instead of saving at the end), ``ucp_save`` (a folder: ``ucp.deepspeed.save`` asynchronously
at ``save_after``, alongside DeepSpeed's own save, and again after the last step; ``ucp_sync`` makes the first
of these synchronous (``async_=False``); with ``ucp_every``
through the ``"ucp": {"save": {"dir", "every"}}`` config instead, which saves every that many steps, and
with ``ucp_memory`` (a folder) keeps the host-memory tier there too, 2 simulated nodes), ``save_bytes_out``
(what each rank's ucp save at ``save_after`` writes, and what it holds, bytes by rank, JSON),
``losses_out`` (every step's loss, JSON), ``param_names_out`` (every stage's trainable parameter names in
optimizer order, stage after stage, as ``ucp convert --param-names`` takes them) and ``refusal_out`` (try
one ucp save right after ``deepspeed.initialize`` and write the error it raises there, instead of training).
A run's ``dump_state`` path gets every rank's fp32 master and Adam moments of its own TP shard at save
time (see support/gather.py), with its stage and TP rank, for the tests to consolidate by hand.
A run may set its layout, ``tp`` and ``pp`` (default 2 x 2; DP is what the 4 ranks leave, and the global
batch of 4 samples is the same at every layout: 2 a micro-batch, accumulated over 2 // DP), and resume
before training: ``ucp_load`` (a ucp checkpoint, through the config's ``"ucp": {"load": ...}``),
``load_from`` (the same through ``ucp.deepspeed.load``; ``swap_tp_boxes`` gives each TP rank the other's
boxes, a negative control; with ``error_out``, the error it raises goes there instead of training), or
``stock_load`` (a DeepSpeed save folder, through ``engine.load_checkpoint``: its error goes to ``error_out``);
a resumed run trains from the loaded step to ``steps``. ``plain`` builds the same layers in a plain module
(``GPTModel``, no PipelineModule: TP ``tp`` x DP, the mpu passed to ``deepspeed.initialize``). ``sync_scale``
all-reduces ``mlp.input_scale``'s gradient over TP (as Megatron does for parameters it keeps equal on every
TP rank), so its copies stay equal and a resume at another layout can continue the losses exactly.

The model is written the way Megatron-DeepSpeed writes its GPT (``GPTModelPipe``), by hand and tiny:

  0  TiedLayerSpec("embed", Embedding)   vocabulary-parallel word embedding (vocabulary 37 padded to
                                         40, a multiple of 4 x TP) + position embedding (replicated
                                         over TP; only the word embedding is synced between stages)
  1  LayerSpec(TransformerLayer)         input_layernorm, self_attention.query_key_value (fused QKV,
  2  LayerSpec(TransformerLayer)         column-parallel; GQA: 4 heads, 2 KV heads, so every TP rank
                                         holds [q 4 rows | k 2 rows | v 2 rows]), self_attention.dense
                                         (row-parallel) + bias, post_attention_layernorm,
                                         mlp.input_scale (see below), mlp.dense_h_to_4h (fused SwiGLU
                                         gate/up, column-parallel: [gate 6 | up 6] per rank),
                                         mlp.dense_4h_to_h (row-parallel) + bias, and a buffer
                                         (causal_mask), equal on every rank and named in no list
  3  LayerSpec(LayerNorm)                final layernorm
  4  TiedLayerSpec("embed", ...)         the output head: the word embedding again (forward_fn), its
                                         logits gathered over TP

``mlp.input_scale`` scales each rank's copy of the MLP input after it entered the TP region, so its
gradient differs per TP rank and nothing synchronises it: its copies drift apart, and the model
declares it "to average" (Partial), as Megatron-DeepSpeed does for replicas that drift.

Tensor parallelism runs on ``ParallelState``, a Megatron-style ``mpu`` built from the
``PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)``. DeepSpeed 0.19 refuses
``deepspeed.initialize(mpu=...)`` for a PipelineModule ("mpu must be None with pipeline parallelism")
and takes ``model.mpu()`` instead, so ``GPTModelPipe.mpu()`` hands it this object.

The model declares ``universal_checkpoint_info`` with the pattern lists of Megatron-DeepSpeed's
``GPTModelPipe.universal_checkpoint_info`` (plus the vocabulary sizes its ``save_checkpoint`` adds).
DeepSpeed 0.19 saves ``getattr(engine.module, "universal_checkpoint_info")`` into every model file,
so the PipelineModule carries the dict under that name (Megatron-DeepSpeed passes the same dict as
client state, which lands under the same key).
"""
import argparse
import json
import os
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB, DIVISIBLE_BY = 37, 4
HIDDEN, HEADS, KV_HEADS, FFN, SEQ = 8, 4, 2, 12, 5
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2  # transformer layers (`use_shape`)
TP, PP = 2, 2  # this run's layout (`use_layout`)
PADDED_VOCAB = -(-VOCAB // (DIVISIBLE_BY * TP)) * DIVISIBLE_BY * TP  # 40: Megatron's _vocab_size_with_padding
SYNC_SCALE = False  # all-reduce mlp.input_scale's gradient over TP (its copies stay equal)
MICRO_BATCH, ACCUMULATION = 2, 2
INIT_SEED = 2024


class ParallelState:
    """A Megatron-style ``mpu``: ranks and process groups of every parallel axis of `topo`.

    Its groups are those of the PipelineModule's grid (`use_groups_of`): DeepSpeed's pipeline engine
    runs one collective with ``engine.mpu``'s group on some ranks and the grid's on others (the loss
    broadcast), so an mpu with process groups of its own, even over the same ranks, deadlocks it.
    Model parallelism, as DeepSpeed counts it, is the whole slice (pipeline x tensor) that one data
    replica spans; its rank numbers the model-states files (``mp_rank_MM``, pipeline-major).
    """

    def __init__(self, topo):
        self.topo = topo
        self.rank = dist.get_rank()
        self.coord = topo.get_coord(self.rank)
        self.grid = None

    def use_groups_of(self, grid) -> None:
        self.grid = grid

    # tensor parallelism
    def get_tensor_model_parallel_group(self):
        return self.grid.slice_proc_group

    def get_tensor_model_parallel_rank(self):
        return self.coord.model

    def get_tensor_model_parallel_world_size(self):
        return self.topo.get_dim("model")

    def get_tensor_model_parallel_src_rank(self):
        return self.grid.slice_group[0]

    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size

    # pipeline parallelism
    def get_pipe_parallel_group(self):
        return self.grid.pp_proc_group

    def get_pipe_parallel_rank(self):
        return self.coord.pipe

    def get_pipe_parallel_world_size(self):
        return self.topo.get_dim("pipe")

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    # data parallelism
    def get_data_parallel_group(self):
        return self.grid.dp_proc_group

    def get_data_parallel_rank(self):
        return self.coord.data

    def get_data_parallel_world_size(self):
        return self.topo.get_dim("data")

    def get_data_parallel_group_ranks(self):
        return self.grid.dp_group

    # model parallelism: the pipeline x tensor slice
    def get_model_parallel_group(self):
        return self.grid.ds_model_proc_group

    def get_model_parallel_rank(self):
        return sorted(self.topo.filter_match(data=self.coord.data)).index(self.rank)

    def get_model_parallel_world_size(self):
        return len(self.topo.filter_match(data=self.coord.data))


MPU: ParallelState | None = None  # set before the model is built; the layers' TP collectives use it


def _tp_all_reduce(x):
    # In fp32: gloo reduces bf16 tensors less reliably than fp32 on some builds.
    out = x.float()
    dist.all_reduce(out, group=MPU.get_tensor_model_parallel_group())
    return out.to(x.dtype)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient (the input of a column-parallel region)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _tp_all_reduce(grad)


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (the output of a row-parallel region); identity backward."""

    @staticmethod
    def forward(ctx, x):
        return _tp_all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x, dtype=torch.float32) for _ in range(TP)]
        dist.all_gather(parts, x.float().contiguous(), group=MPU.get_tensor_model_parallel_group())
        return torch.cat(parts, dim=-1).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(TP, dim=-1)[MPU.get_tensor_model_parallel_rank()].contiguous()


def use_layout(tp: int, pp: int, sync_scale: bool) -> None:
    """Build the next model at TP `tp` x PP `pp`, with `mlp.input_scale`'s copies kept equal or not."""
    global TP, PP, PADDED_VOCAB, SYNC_SCALE
    TP, PP, SYNC_SCALE = tp, pp, sync_scale
    PADDED_VOCAB = -(-VOCAB // (DIVISIBLE_BY * TP)) * DIVISIBLE_BY * TP


def use_shape(vocab: int, hidden: int, heads: int, kv_heads: int, ffn: int, seq: int, layers: int) -> None:
    """Build the next model at this size instead of the tiny one (benchmarks/_elastic_megatron.py); call before
    `use_layout`, which pads the vocabulary for its TP."""
    global VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, SEQ, HEAD_DIM, LAYERS
    VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, SEQ, LAYERS = vocab, hidden, heads, kv_heads, ffn, seq, layers
    HEAD_DIM = HIDDEN // HEADS


def _full(shape, seed, scale=0.3):
    return torch.randn(shape, generator=torch.Generator().manual_seed(INIT_SEED + seed)) * scale


def _rows(full, parts):
    """This TP rank's rows of `full` cut into consecutive `parts` (sub-parameters), each split over TP."""
    rank, out, start = MPU.get_tensor_model_parallel_rank(), [], 0
    for size in parts:
        out.append(full[start:start + size].chunk(TP, dim=0)[rank])
        start += size
    return torch.nn.Parameter(torch.cat(out, dim=0).clone())


def _cols(full):
    return torch.nn.Parameter(full.chunk(TP, dim=1)[MPU.get_tensor_model_parallel_rank()].clone())


class Embedding(torch.nn.Module):
    """Vocabulary-parallel word embedding (rows of the padded vocabulary) plus position embedding."""

    def __init__(self):
        super().__init__()
        self.word_embeddings = torch.nn.Module()
        full = _full((PADDED_VOCAB, HIDDEN), 1)
        full[VOCAB:] = 0  # padding rows, as Megatron initialises them on the last rank
        self.word_embeddings.weight = _rows(full, [PADDED_VOCAB])
        self.position_embeddings = torch.nn.Module()
        self.position_embeddings.weight = torch.nn.Parameter(_full((SEQ, HIDDEN), 2))

    def forward(self, tokens):
        per_rank = PADDED_VOCAB // TP
        start = MPU.get_tensor_model_parallel_rank() * per_rank
        outside = (tokens < start) | (tokens >= start + per_rank)
        local = F.embedding((tokens - start).masked_fill(outside, 0), self.word_embeddings.weight)
        words = _ReduceFromTP.apply(local.masked_fill(outside.unsqueeze(-1), 0))
        return words + self.position_embeddings.weight[:tokens.shape[1]]


def head(embedding: Embedding, hidden):
    """Logits over the padded vocabulary: each rank's vocabulary rows, gathered."""
    return _GatherFromTP.apply(F.linear(_CopyToTP.apply(hidden), embedding.word_embeddings.weight))


class TransformerLayer(torch.nn.Module):

    def __init__(self, number: int):
        super().__init__()
        seed = 10 * number
        self.input_layernorm = torch.nn.LayerNorm(HIDDEN)
        self.post_attention_layernorm = torch.nn.LayerNorm(HIDDEN)
        self.self_attention = torch.nn.Module()
        kv = KV_HEADS * HEAD_DIM
        self.self_attention.query_key_value = torch.nn.Module()
        self.self_attention.query_key_value.weight = _rows(_full((HIDDEN + 2 * kv, HIDDEN), seed), [HIDDEN, kv, kv])
        self.self_attention.dense = torch.nn.Module()
        self.self_attention.dense.weight = _cols(_full((HIDDEN, HIDDEN), seed + 1))
        self.self_attention.dense.bias = torch.nn.Parameter(_full((HIDDEN,), seed + 2, 0.1))
        self.mlp = torch.nn.Module()
        self.mlp.input_scale = torch.nn.Parameter(torch.ones(HIDDEN))
        self.mlp.dense_h_to_4h = torch.nn.Module()
        self.mlp.dense_h_to_4h.weight = _rows(_full((2 * FFN, HIDDEN), seed + 3), [FFN, FFN])
        self.mlp.dense_4h_to_h = torch.nn.Module()
        self.mlp.dense_4h_to_h.weight = _cols(_full((HIDDEN, FFN), seed + 4))
        self.mlp.dense_4h_to_h.bias = torch.nn.Parameter(_full((HIDDEN,), seed + 5, 0.1))
        self.register_buffer("causal_mask", torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1))  # the same on every rank

    def attention(self, x):
        b, s, _ = x.shape
        heads, kv_heads = HEADS // TP, KV_HEADS // TP
        qkv = F.linear(_CopyToTP.apply(x), self.self_attention.query_key_value.weight)
        q, k, v = qkv.split([heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], dim=-1)
        q = q.view(b, s, heads, HEAD_DIM).transpose(1, 2)
        k = k.view(b, s, kv_heads, HEAD_DIM).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
        v = v.view(b, s, kv_heads, HEAD_DIM).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
        scores = (q @ k.transpose(-1, -2)) / HEAD_DIM**0.5
        weights = scores.masked_fill(self.causal_mask[:s, :s], float("-inf")).softmax(-1)
        context = (weights @ v).transpose(1, 2).reshape(b, s, -1)
        dense = self.self_attention.dense
        return _ReduceFromTP.apply(F.linear(context, dense.weight)) + dense.bias

    def feed_forward(self, x):
        scale = _CopyToTP.apply(self.mlp.input_scale) if SYNC_SCALE else self.mlp.input_scale
        x = _CopyToTP.apply(x) * scale
        gate, up = F.linear(x, self.mlp.dense_h_to_4h.weight).chunk(2, dim=-1)
        out = self.mlp.dense_4h_to_h
        return _ReduceFromTP.apply(F.linear(F.silu(gate) * up, out.weight)) + out.bias

    def forward(self, x):
        x = x + self.attention(self.input_layernorm(x))
        return x + self.feed_forward(self.post_attention_layernorm(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits[..., :VOCAB].float().reshape(-1, VOCAB), targets.reshape(-1))


def universal_checkpoint_info(embed: str = "tied_modules.embed") -> dict:
    """What Megatron-DeepSpeed declares for this GPT (``GPTModelPipe.universal_checkpoint_info`` with GQA
    and SwiGLU, plus the vocabulary sizes and version its ``save_checkpoint`` adds); `embed` is where the
    model holds the embedding."""
    from deepspeed.checkpoint import constants as c
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape

    qkv = r"\d+.self_attention.query_key_value.weight"
    kv = KV_HEADS * HEAD_DIM
    return {
        c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        c.ORIGINAL_VOCAB_SIZE: VOCAB,
        c.PADDED_VOCAB_SIZE: PADDED_VOCAB,
        c.VOCABULARY_PARAMETER_PATTERNS: [rf"{embed}.word_embeddings.weight"],
        c.PIPELINE_REPLICATED_PARAMETER_PATTERNS: [rf"{embed}.word_embeddings.weight",
                                                   rf"{embed}.position_embeddings.weight"],
        c.TP_REPLICATED_PARAMETER_PATTERNS: [
            rf"{embed}.position_embeddings.weight",
            r"\d+.input_layernorm.weight", r"\d+.input_layernorm.bias",
            r"\d+.post_attention_layernorm.weight", r"\d+.post_attention_layernorm.bias",
            r"\d+.self_attention.dense.bias", r"\d+.mlp.dense_4h_to_h.bias",
            r"\d+.weight", r"\d+.bias",
        ],
        c.PARAMETER_TO_AVERAGE_PATTERNS: [r"\d+.mlp.input_scale"],
        c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"\d+.mlp.dense_4h_to_h.weight",
                                                    r"\d+.self_attention.dense.weight"],
        c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: [r"\d+.mlp.dense_h_to_4h.weight"],
        c.PARAMETER_WITH_SUB_PARAMS: [asdict(SubparamShape(patterns=[qkv], shape=((HIDDEN, kv, kv), HIDDEN),
                                                           partition_dim=0))],
        # Version 0.4 records each sub-parameter's width on every TP rank (uneven GQA splits need it).
        c.SUB_PARAM_SHARD_WIDTHS: {qkv: [[HIDDEN // TP] * TP, [kv // TP] * TP, [kv // TP] * TP]},
    }


def build():
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    global MPU
    topo = PipeModelDataParallelTopology(num_pp=PP, num_mp=TP, num_dp=dist.get_world_size() // (PP * TP))
    MPU = ParallelState(topo)

    class GPTModelPipe(PipelineModule):

        def mpu(self):
            return MPU

    # As in Megatron-DeepSpeed, only the word embedding is kept in sync between the stages; the last
    # stage's position embedding is never used, and drifts (weight decay) from the first stage's.
    tied = "word_embeddings.weight"
    layers = [
        TiedLayerSpec("embed", Embedding, tied_weight_attr=tied),
        *[LayerSpec(TransformerLayer, number) for number in range(1, LAYERS + 1)],
        LayerSpec(torch.nn.LayerNorm, HIDDEN),
        TiedLayerSpec("embed", Embedding, forward_fn=head, tied_weight_attr=tied),
    ]
    model = GPTModelPipe(layers, topology=topo, loss_fn=loss_fn, partition_method="type:TransformerLayer")
    MPU.use_groups_of(model._grid)
    model.universal_checkpoint_info = universal_checkpoint_info()
    return model


class GPTModel(torch.nn.Module):
    """The same layers in a plain module, without a PipelineModule (PP 1): the layers under their pipeline
    indices (so the pattern lists match them alike), the embedding as ``embed``, reused as the output head."""

    def __init__(self):
        super().__init__()
        self.embed = Embedding()
        for index, layer in ((1, TransformerLayer(1)), (2, TransformerLayer(2)), (3, torch.nn.LayerNorm(HIDDEN))):
            self.add_module(str(index), layer)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for index in ("1", "2", "3"):
            x = self.get_submodule(index)(x)
        return loss_fn(head(self.embed, x), targets)


def build_plain():
    """`GPTModel` at TP `TP` x DP (the ranks left), its mpu given to ``deepspeed.initialize``: a grid of its own
    (``PipelineParallelGrid`` of one stage) gives the mpu its process groups."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    global MPU
    topo = PipeModelDataParallelTopology(num_pp=1, num_mp=TP, num_dp=dist.get_world_size() // TP)
    MPU = ParallelState(topo)
    MPU.use_groups_of(PipelineParallelGrid(topology=topo))
    model = GPTModel()
    model.universal_checkpoint_info = universal_checkpoint_info("embed")
    return model


def dp_size() -> int:
    return dist.get_world_size() // (TP * PP)


def ds_config(run: dict) -> dict:
    accumulation = max(1, ACCUMULATION // dp_size())  # DP 4 (load-only runs; `batches` cuts DP 1-2): 1 sample
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH * ACCUMULATION // (dp_size() * accumulation),
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "betas": [0.9, 0.95], "weight_decay": 0.05,
                                                  "torch_adam": True}},
        # Small buckets: the default (5e8 elements) costs GBs per rank, four ranks on a small machine.
        "zero_optimization": {"stage": run.get("stage", 1), "reduce_bucket_size": 10**6,
                              "allgather_bucket_size": 10**6},
        "steps_per_print": 10**9,
    }
    if run.get("dtype") == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def batches(step: int):
    """This rank's micro-batches of step `step`'s global batch: every micro-batch at DP 1, else its DP rank's."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH * ACCUMULATION, SEQ), generator=g)
    targets = (tokens * 3 + 1) % VOCAB
    every = [(tokens[m * MICRO_BATCH:(m + 1) * MICRO_BATCH], targets[m * MICRO_BATCH:(m + 1) * MICRO_BATCH])
             for m in range(ACCUMULATION)]
    return every[MPU.get_data_parallel_rank()::dp_size()]


CLIENT_STATE = {"client_marker": 23}


def write_bytes(path: str, written: int, model) -> None:
    """Every rank's bytes of its ucp save, and of every state it holds (fp32 master and two Adam moments of each
    parameter, its buffers), on rank 0."""
    held = sum(p.numel() * 4 * 3 for p in model.parameters()) + sum(b.numel() * b.element_size()
                                                                    for b in model.buffers())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"written": written, "held": held})
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(every, f)


def write_param_names(path: str, model) -> None:
    """Every stage's trainable parameter names in its optimizer's order, stage after stage (what `ucp convert
    --param-names` takes for fp32 ZeRO-0), one per line, on rank 0."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (MPU.get_pipe_parallel_rank(), MPU.get_tensor_model_parallel_rank(),
                                   MPU.get_data_parallel_rank(), names))
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.writelines(f"{n}\n" for stage, tp, dp, stage_names in sorted(every) if tp == dp == 0
                         for n in stage_names)


def refuse(engine, path: str) -> None:
    """Try one ucp save and write its refusal to `path`."""
    import ucp.deepspeed
    from ucp.errors import UcpError

    try:
        ucp.deepspeed.save(engine, path + ".d")
        message = None
    except UcpError as e:
        message = str(e)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(message, f)
    dist.barrier()
    engine.destroy()


def resume(engine, run: dict) -> bool:
    """Load what `run` names before training (see the module docstring); False when a stock load failed, which
    it then records in its `error_out`."""
    import ucp.deepspeed

    if run.get("load_from") and run.get("error_out"):  # a load expected to be refused: its error, no training
        from ucp.errors import UcpError

        try:
            ucp.deepspeed.load(engine, run["load_from"])
        except UcpError as e:
            if dist.get_rank() == 0:
                with open(run["error_out"], "w") as f:
                    json.dump(str(e), f)
        return False
    if run.get("load_from"):
        if run.get("swap_tp_boxes"):  # negative control: each TP rank's boxes are the other TP rank's
            import ucp.deepspeed.loading.mpu as mpu_target

            real = mpu_target.tp_rank
            mpu_target.tp_rank = lambda engine: TP - 1 - real(engine)
            try:
                ucp.deepspeed.load(engine, run["load_from"])
            finally:
                mpu_target.tp_rank = real
        else:
            ucp.deepspeed.load(engine, run["load_from"])
    if run.get("stock_load"):
        try:
            engine.load_checkpoint(run["stock_load"])
        except Exception as e:  # whatever DeepSpeed raises on another layout's files
            if dist.get_rank() == 0:
                with open(run["error_out"], "w") as f:
                    json.dump(f"{type(e).__name__}: {e}".splitlines()[0], f)
            return False
    return True


def plain_step(engine, step: int) -> float:
    """One step of `GPTModel` (this rank's micro-batches, then DeepSpeed's step); its loss averaged over the
    micro-batches and the DP ranks, as a pipeline's ``train_batch`` reports it."""
    total = torch.zeros(())
    for tokens, targets in batches(step):
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
    total /= len(batches(step)) * dp_size()
    dist.all_reduce(total, group=MPU.get_data_parallel_group())
    return float(total)


def train_one(run: dict, steps: int) -> None:
    import deepspeed

    import ucp.deepspeed
    from gather import dump_states, local_state

    plain = run.get("plain", False)
    use_layout(run.get("tp", 2), 1 if plain else run.get("pp", 2), run.get("sync_scale", False))
    model = build_plain() if plain else build()
    mpu = {"mpu": MPU} if plain else {}  # a PipelineModule hands DeepSpeed its mpu itself
    config, every = ds_config(run), run.get("ucp_every")
    if every:  # ucp saves every `every` steps (train_batch is wrapped), explicit calls below are skipped
        config["ucp"] = {"save": {"dir": run["ucp_save"], "every": every}}
        if run.get("ucp_memory"):  # the host-memory tier too, 2 simulated nodes (resume_common.memory_tier)
            from resume_common import memory_tier

            config["ucp"]["save"]["memory"] = memory_tier(run["ucp_memory"], every)
    if run.get("ucp_load"):
        config["ucp"] = {**config.get("ucp", {}), "load": run["ucp_load"]}
    if "ucp" in config:
        engine, _, _, _ = ucp.deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                                   config=config, **mpu)
        engine.ucp_client_state = dict(CLIENT_STATE)
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config,
                                               **mpu)
    explicit = run.get("ucp_save") and not every
    if run.get("refusal_out"):
        refuse(engine, run["refusal_out"])
        return
    if run.get("param_names_out"):
        write_param_names(run["param_names_out"], model)
    if not resume(engine, run):
        dist.barrier()
        engine.destroy()
        return
    save_after, losses = run.get("save_after"), []
    for step in range(engine.global_steps, run.get("steps", steps)):
        losses.append(plain_step(engine, step) if plain else float(engine.train_batch(iter(batches(step)))))
        if step + 1 == save_after:
            if explicit:  # asynchronous, overlapping DeepSpeed's own save of the same step
                stats = ucp.deepspeed.save(engine, run["ucp_save"], async_=not run.get("ucp_sync"),
                                           client_state=CLIENT_STATE)
                if run.get("save_bytes_out"):
                    write_bytes(run["save_bytes_out"], stats.bytes, model)
            engine.save_checkpoint(run["save_dir"], client_state=CLIENT_STATE)
    if explicit:  # the last step too: another step's checkpoint, for negative controls
        ucp.deepspeed.save(engine, run["ucp_save"], client_state=CLIENT_STATE)
    if run.get("ucp_save"):
        ucp.deepspeed.wait(engine)
    if run.get("losses_out") and dist.get_rank() == 0:
        with open(run["losses_out"], "w") as f:
            json.dump(losses, f)
    if save_after is not None:
        dist.barrier()
        engine.destroy()
        return
    if run.get("dump_state"):
        dump_states(run["dump_state"], {"stage": MPU.get_pipe_parallel_rank(),
                                        "tp_rank": MPU.get_tensor_model_parallel_rank(),
                                        "dp_rank": MPU.get_data_parallel_rank(),
                                        "params": local_state(engine, model.named_parameters())},
                    {"global_steps": engine.global_steps})
    if run.get("save_dir"):
        engine.save_checkpoint(run["save_dir"], client_state=CLIENT_STATE)
    dist.barrier()
    engine.destroy()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--runs", required=True, help="JSON list of runs, each {stage, dtype, save_dir, dump_state}")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    torch.use_deterministic_algorithms(True)
    deepspeed.init_distributed(dist_backend="gloo")
    for run in json.loads(args.runs):
        train_one(run, args.steps)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    import ucp.deepspeed
    ucp.deepspeed.finish(main())
