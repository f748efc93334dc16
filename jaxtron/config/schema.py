"""The config schema: one dataclass per section, each field with its default and doc.

The defaults are the ``tiny`` preset; the model section is :mod:`jaxtron.config.model_schema`. Loading (YAML +
dotted overrides) is in :mod:`jaxtron.config.loading`, checks of the fields themselves in
:mod:`jaxtron.config.validation`; the checks against the model's kernels and the mesh sizes are
:mod:`jaxtron.preflight`'s (this package imports nothing else of jaxtron).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from jaxtron.config.fields import documented as _f
from jaxtron.config.model_schema import ModelConfig

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
DEFAULT_PRESET = "tiny"


class ConfigError(ValueError):
    """A configuration value is invalid. ``str(err)`` is one line that starts with the field name."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


def require(cond: bool, field_name: str, message: str) -> None:
    """Raise :class:`ConfigError` for ``field_name`` with ``message`` unless ``cond`` holds."""
    if not cond:
        raise ConfigError(field_name, message)


@dataclass
class ParallelConfig:
    data: int = _f(-1, "Data-parallel size (replicated params). -1: all devices the other axes leave.")
    fsdp: int = _f(1, "FSDP / ZeRO-3 size: params, grads and optimizer state sharded, batch split.")
    zero: int = _f(0, "Distributed optimizer over 'data' (params stay replicated over it): 1 shards the optimizer "
                      "state (ZeRO-1), 2 also the gradients the optimizer takes (ZeRO-2: reduce-scatter instead "
                      "of all-reduce); 0: off. See docs/optimizers.md.")
    tensor: int = _f(1, "Megatron tensor-parallel size (heads, MLP and vocab split).")
    stage: int = _f(1, "Pipeline stages: the stacked decoder layers are split over this mesh axis (shard_map "
                       "over 'stage'; data, FSDP and tensor parallelism work inside each stage).")
    pipeline_schedule: str = _f("1f1b", "With stage > 1: '1f1b' (one forward and one backward per tick, "
                                        "activation memory flat in the number of micro batches), 'gpipe' "
                                        "(fill-drain, gradients through the loop), 'circular' (interleaved "
                                        "virtual stages, see virtual_stages), 'zb_h1' (1f1b with each "
                                        "backward split into the input gradient and a deferred weight "
                                        "gradient that fills the bubble: (S-1)/(3M+S-1); the weight step "
                                        "keeps B's per-layer cotangents until it runs, docs/parallelism.md) or "
                                        "'zbv' (ZB-V: two layer chunks per device in a V, the weight "
                                        "gradients deferred into the bubble, at most 2S chunk residuals "
                                        "held; needs num_layers divisible by 2 x stage).")
    virtual_stages: int = _f(1, "circular schedule: layer chunks per device (Megatron's virtual pipeline); "
                                "the bubble shrinks from (S-1)/(M+S-1) to (S-1)/(V*M+S-1).")
    pipeline_fsdp_gather_once: bool = _f(False, "With stage > 1 and fsdp > 1: all-gather each stage's weights "
                                                "over 'fsdp' once per step (and reduce-scatter their gradients "
                                                "once) instead of in every pipeline tick. Faster; costs the "
                                                "stage's unsharded weights and gradients in memory per device "
                                                "(MaxText's pipeline_fsdp_ag_once).")
    pipeline_recompute: bool = _f(False, "With stage > 1: run each stage's forward again in its backward, keeping "
                                         "only the stage input per micro batch in flight (the least activation "
                                         "memory). false: keep the stage's VJP residuals (what model.remat "
                                         "saves) per micro batch in flight and run no forward twice "
                                         "(docs/parallelism.md: memory per schedule).")
    sequence_parallel: bool = _f(False, "Shard the sequence axis of norm/residual activations over 'tensor'.")
    tp_comm_overlap: bool = _f(True, "With tensor > 1 and sequence_parallel: collective matmul (Megatron's TP "
                                     "comm overlap). The all-gather of the sequence before a column-parallel "
                                     "projection (Q/K/V, gate/up) and the reduce-scatter after a row-parallel one "
                                     "(attention out, down) run as 'tensor' ring steps of ppermute, each step's "
                                     "chunk GEMM overlapping the next chunk's transfer "
                                     "(jaxtron/parallel/collective_matmul.py). Predicted faster on H100s (Llama-3-8B "
                                     "tensor 8: 5152 -> 6022 tokens/s/GPU; tensor 2 x fsdp 4: 8171 -> 8995); "
                                     "costs compile time and kernels. Pipeline stages, context-split sequences and "
                                     "model.fp8 other than none keep the plain collectives.")
    collective_pipelining: bool = _f(True, "XLA:GPU's collective pipeliner, on by default for GPU compiles of "
                                           "FSDP layouts (fsdp > 1) across nodes: a layer loop's weight all-gathers, "
                                           "gradient reduce-scatters and all-reduces start one iteration early "
                                           "and overlap the neighbouring layer's compute, at the cost of the "
                                           "buffers in flight (one layer's; the xla_gpu_enable_pipelined_* "
                                           "options MaxText's GPU configs set). python -m jaxtron.plan predicts "
                                           "the step and memory both ways; false turns it off. Not passed to "
                                           "XLA:CPU.")
    split_reduce_scatters: bool = _f(True, "For GPU compiles of dense models on FSDP layouts (fsdp > 1) without "
                                           "pipeline stages: "
                                           "XLA's reduce-scatter combiner off, so each weight's gradient "
                                           "reduce-scatter is its own collective. XLA's schedule runs a layer's "
                                           "reduce-scatters one after another behind its weight-gradient GEMMs "
                                           "and waits for the last at the end of the layer loop's iteration; "
                                           "merged (XLA's default, up to 30 MiB), that last one is several "
                                           "weights' (Llama-3-8B, 8 H100: gate and up). Predicted faster on "
                                           "every dense non-pipelined FSDP row tried (docs/parallelism.md); "
                                           "slower with pipeline stages and on MoE models, which keep XLA's "
                                           "default. Not passed to XLA:CPU.")
    context: int = _f(1, "Context-parallel size: the sequence axis of activations split over this mesh axis "
                         "(parameters are not; their gradients are reduced over it). Each sequence is cut into "
                         "2*context chunks and rank r holds chunks r and 2*context-1-r (causal load balance).")
    context_impl: str = _f("all_gather", "With context > 1: 'all_gather' (K and V gathered over 'context', "
                                         "local queries attend to the whole sequence; the backward "
                                         "reduce-scatters dK and dV); 'ring' (K/V blocks passed round the "
                                         "context ranks with ppermute, partial results merged by their "
                                         "log-sum-exp; no rank holds the whole K/V); 'ulysses' (all-to-all "
                                         "from sequence split to head split around attention; num_heads "
                                         "divisible by context x tensor, kv heads repeated when fewer); "
                                         "ring is refused with stage > 1.")
    expert: int = _f(1, "Expert-parallel size: each MoE layer's experts split over this mesh axis (num_experts "
                        "divisible by it), which is drawn from the data-parallel devices: it splits the batch "
                        "too and other weights are replicated (or FSDP-sharded) over it. Tokens travel to their "
                        "experts' ranks and back with all-to-all (model.moe.ep_dispatch).")


@dataclass
class OptimConfig:
    name: str = _f("adamw", "'adamw', or 'muon': Newton-Schulz orthogonalised momentum for the hidden weight "
                            "matrices (per layer, per expert), AdamW (beta1, beta2, eps) for embeddings, LM head, "
                            "router, norms and biases; see docs/optimizers.md.")
    lr: float = _f(1e-3, "Peak learning rate.")
    min_lr_ratio: float = _f(0.1, "Final learning rate as a fraction of lr.")
    schedule: str = _f("cosine", "'cosine' (warmup + cosine), 'linear' (warmup + linear), 'wsd' or 'constant'.")
    warmup_steps: int = _f(20, "Linear warmup steps from 0.")
    decay_steps: Optional[int] = _f(None, "Steps of the decay phase; default train.steps - warmup_steps "
                                          "(wsd: default 20% of train.steps).")
    beta1: float = _f(0.9, "AdamW beta1.")
    beta2: float = _f(0.95, "AdamW beta2.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    weight_decay: float = _f(0.1, "Decoupled weight decay (not applied to norms and biases).")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this; 0 disables clipping.")
    z_loss: float = _f(0.0, "Coefficient of the z-loss (logsumexp^2) added to the loss.")
    muon_beta: float = _f(0.95, "muon: momentum decay of the orthogonalised matrices.")
    muon_nesterov: bool = _f(True, "muon: Nesterov momentum.")
    muon_ns_steps: int = _f(5, "muon: Newton-Schulz iterations (quintic, Keller Jordan's coefficients).")
    muon_rms: float = _f(0.2, "muon: scale each orthogonalised update by muon_rms * sqrt(max(fan_in, fan_out)) "
                              "(Moonshot's RMS matching, so AdamW's lr and weight decay carry over); 0: Keller "
                              "Jordan's sqrt(max(1, fan_out / fan_in)) instead.")


@dataclass
class DataConfig:
    source: str = _f("builtin", "'builtin': this Python installation's standard-library sources (no download); "
                                "'indexed': Megatron .bin/.idx prefixes in data.paths.")
    paths: Optional[str] = _f(None, "indexed: 'PREFIX' or a weighted blend 'W1 PREFIX1 W2 PREFIX2 ...' "
                                    "(Megatron's --data-path).")
    split: str = _f("969,30,1", "indexed: train,valid,test weights over the documents (Megatron's --split).")
    train_paths: Optional[str] = _f(None, "indexed: the train split's own blend, all its documents (Megatron's "
                                          "--train-data-path); with valid_paths instead of paths and split.")
    valid_paths: Optional[str] = _f(None, "indexed: the validation split's own blend (--valid-data-path).")
    test_paths: Optional[str] = _f(None, "indexed: the test split's own blend (--test-data-path; unused by "
                                         "training).")
    mid_level_dataset_surplus: float = _f(0.005, "indexed, weighted blends: each prefix is asked for this "
                                                 "fraction more samples than its share (Megatron's "
                                                 "--mid-level-dataset-surplus).")
    seed: int = _f(1234, "Seed of the data order (document and sample shuffles), Megatron's --seed and its "
                         "default; train.seed seeds the parameters.")
    eod_id: Optional[int] = _f(None, "indexed: the end-of-document token id; default data.tokenizer's (byte: 0).")
    tokenizer: str = _f("byte", "The tokenizer the data was prepared with: 'byte' (vocab 256, token 0 = end of "
                                "document; the built-in corpus's), a Hugging Face tokenizer.json or a "
                                "SentencePiece .model. Checked against the data's <prefix>.meta.json and the "
                                "checkpoint resumed or loaded; checkpoints record it (with a copy of the file) "
                                "for generate, evaluate and export-hf.")
    allow_tokenizer_mismatch: bool = _f(False, "Train even when data.tokenizer differs from the tokenizer the data "
                                               "was prepared with or the checkpoint was trained with (a warning "
                                               "instead of an error).")
    seq_len: int = _f(256, "Tokens per training sequence.")
    valid_fraction: float = _f(0.02, "Fraction of documents held out for evaluation.")
    max_corpus_bytes: int = _f(16 * 2**20, "builtin: read at most this many bytes of sources.")
    cache_dir: Optional[str] = _f(None, "builtin: where its .bin/.idx files are prepared once (default "
                                        "$JAXTRON_CACHE_DIR or ~/.cache/jaxtron).")
    reset_position_ids: bool = _f(False, "Positions restart after each end-of-document token (Megatron's "
                                         "--reset-position-ids); needs reset_attention_mask.")
    reset_attention_mask: bool = _f(False, "Attention blocked between documents packed in one sequence, i.e. "
                                           "after each end-of-document token (--reset-attention-mask; the "
                                           "batch's segment_ids); false: causal over the whole sequence.")
    reset_at_eod: bool = _f(False, "Shorthand for reset_position_ids and reset_attention_mask together.")
    eod_mask_loss: bool = _f(False, "No loss where the input token is the end-of-document token, i.e. on "
                                    "predicting a document's first token (Megatron's --eod-mask-loss).")


@dataclass
class TrainConfig:
    steps: int = _f(200, "Optimizer steps to run.")
    seed: int = _f(0, "Seed for parameter init and data order.")
    output_dir: str = _f("runs/default", "Where metrics.jsonl, TensorBoard events and the resolved config go.")
    global_batch_size: int = _f(8, "Sequences per optimizer step.")
    micro_batch_size: Optional[int] = _f(None, "Sequences per micro batch per data-parallel replica "
                                               "(data*fsdp*expert); gradient accumulation steps = global / "
                                               "(micro * dp). Default: global / dp (no accumulation).")
    eval_every: int = _f(100, "Evaluate on held-out data every N steps (0: only at the end).")
    eval_batches: int = _f(4, "Batches of global_batch_size per evaluation.")
    peak_tflops: Optional[float] = _f(None, "Peak dense bf16 TFLOP/s per device for MFU; default from the "
                                            "known-GPU table, none on CPU.")
    collective_timeout_s: int = _f(60, "Multi-process runs: a process that stops answering for this long "
                                       "(crashed, killed, stopped, lost node) makes the others exit with one "
                                       "error line naming it (exit status 75) instead of waiting forever.")
    max_skipped_steps: int = _f(10, "A step whose loss or gradient norm is not finite is skipped (no update); "
                                    "after this many in a row the run saves a checkpoint and stops.")
    exit_after_steps: Optional[int] = _f(None, "Stop with a checkpoint after this many steps in this process "
                                               "(0 or null: off); the learning-rate schedule still runs to "
                                               "steps and the next start resumes (Megatron's --exit-interval).")
    exit_after_minutes: Optional[float] = _f(None, "Stop with a checkpoint at the first step after this many "
                                                   "minutes of wall time since train() began (0 or null: off), "
                                                   "e.g. before a SLURM time limit; the schedule is unchanged "
                                                   "and the next start resumes (Megatron's "
                                                   "--exit-duration-in-mins).")
    cast_params_once: bool = _f(True, "Cast the weights the model casts to model.dtype (the projections, the "
                                      "embedding, an untied LM head) once per step, before the gradient-"
                                      "accumulation loop, instead of at each use in every micro batch: same "
                                      "numbers; the step holds the cast copy, sharded as the params. Pipelines "
                                      "(parallel.stage > 1) cast once per step too: 1f1b and zb_h1 before the "
                                      "tick loop, so that FSDP gathers (parallel.pipeline_fsdp_gather_once's "
                                      "too) move model.dtype; gpipe and circular inside their loop, before the "
                                      "ticks (their gathers still move fp32; with parallel.pipeline_recompute "
                                      "their stage weights are cast per tick).")
    latency_profile: Optional[str] = _f(None, "For GPU compiles: a latency profile for XLA:GPU's scheduler "
                                              "(xla_gpu_pgle_profile_file_or_directory_path; the text form of "
                                              "ProfiledInstructionsProto), which then places compute under each "
                                              "collective by the costs in it instead of fixed estimates. python "
                                              "-m jaxtron.plan --latency-profile-out FILE writes one from its "
                                              "step model for the same config and GPUs (Llama-3-70B fsdp 64 on "
                                              "64 H100: 993 -> 1,124 tokens/s/GPU predicted); one measured on "
                                              "the cluster (JAX's profile-guided latency estimation) works too. "
                                              "null: XLA's estimates. Not passed to XLA:CPU.")
    uninitialized_scan_outputs: bool = _f(True, "For GPU compiles: XLA:GPU allocates a loop's stacked outputs "
                                                "uninitialized where it proves the loop writes every slice before "
                                                "reading it (xla_gpu_enable_dus_accumulator_zero_init_elimination) "
                                                "instead of filling them with zeros first: the layer scan's "
                                                "residuals for the backward, one memory pass (and a copy of each "
                                                "stack XLA's CSE merged) less per micro batch. Predicted faster "
                                                "(Llama-3-8B fsdp 8 on 8 H100: 10,985 -> 11,055 tokens/s/GPU); "
                                                "skipped where the installed XLA lacks the option. Not passed to "
                                                "XLA:CPU.")


@dataclass
class CheckpointConfig:
    dir: Optional[str] = _f(None, "Checkpoint directory; default <train.output_dir>/checkpoints.")
    enabled: bool = _f(True, "Save checkpoints (at the end, every every_steps, and on SIGTERM/SIGINT) and resume "
                             "from the newest complete one in dir.")
    every_steps: int = _f(0, "Also save every N steps (0: only at the end and on SIGTERM/SIGINT).")
    keep: int = _f(2, "Keep the newest N checkpoints (older ones are deleted, except keep_every multiples).")
    keep_every: int = _f(0, "Keep every checkpoint whose step is a multiple of N for good (0: none).")
    async_save: bool = _f(True, "Write checkpoints in the background; training blocks only while the state is "
                                "copied.")
    resume: bool = _f(True, "Resume from the newest complete checkpoint in dir when there is one.")
    fallback: bool = _f(False, "When the newest checkpoint cannot be read, fall back to the previous one "
                               "(default: stop with an error naming the file and step).")
    load_weights: Optional[str] = _f(None, "Start from the parameters of this checkpoint (a checkpoint "
                                           "directory, or one step of it) with a fresh optimizer, e.g. the "
                                           "output of 'python -m jaxtron.convert import-hf'. Ignored when "
                                           "resuming from dir.")


@dataclass
class DistributedConfig:
    coordinator: Optional[str] = _f(None, "host:port of process 0's coordinator for a multi-process run "
                                          "(env JAXTRON_COORDINATOR). Under SLURM or Open MPI it is found "
                                          "automatically.")
    num_processes: Optional[int] = _f(None, "Processes in the run (env JAXTRON_NUM_PROCESSES).")
    process_id: Optional[int] = _f(None, "This process's index, 0..num_processes-1 (env JAXTRON_PROCESS_ID).")
    initialization_timeout_s: int = _f(300, "How long processes wait for each other at start-up.")


@dataclass
class LoggingConfig:
    log_every: int = _f(10, "Log metrics every N steps.")
    tensorboard: bool = _f(True, "Write TensorBoard events to <train.output_dir>/tensorboard.")
    progress: bool = _f(True, "Show a progress bar on the terminal.")
    level: str = _f("INFO", "Python logging level.")


@dataclass
class MonitorConfig:
    health: bool = _f(True, "Time every step on every process (step time, device wait, data wait) and gather them "
                            "with host and device memory at each log point: metrics.jsonl, health.jsonl, the "
                            "straggler warning and the hang detector need it (docs/operations.md).")
    straggler_threshold: float = _f(1.5, "Warn when a process's slowdown against the median process reaches this.")
    hang_factor: float = _f(20.0, "End the run (exit status 75, for the supervisor to restart) when no step has "
                                  "finished for this many times the median of the recent step times; 0: off.")
    hang_min_s: float = _f(600.0, "The hang limit is never shorter than this (seconds).")
    loss_spike_window: int = _f(0, "Judge each step's loss against the median of this many previous ones; 0: off.")
    loss_spike_threshold: float = _f(0.5, "A loss above the window's median by more than this fraction is a spike.")
    loss_spike_action: str = _f("log", "On a loss spike: 'log' (a warning) or 'stop' (save a checkpoint and stop).")
    prometheus_port: Optional[int] = _f(None, "Serve Prometheus metrics on this port of process 0 (needs the "
                                              "'monitoring' extra); None: off, 0: any free port.")


@dataclass
class Config:
    model: ModelConfig = _f(doc="The network.", factory=ModelConfig)
    parallel: ParallelConfig = _f(doc="Device mesh sizes and sharding switches.", factory=ParallelConfig)
    optim: OptimConfig = _f(doc="Optimizer and learning-rate schedule.", factory=OptimConfig)
    data: DataConfig = _f(doc="Training data.", factory=DataConfig)
    train: TrainConfig = _f(doc="The training run.", factory=TrainConfig)
    checkpoint: CheckpointConfig = _f(doc="Checkpoints.", factory=CheckpointConfig)
    distributed: DistributedConfig = _f(doc="Joining a multi-process (multi-node) run.", factory=DistributedConfig)
    logging: LoggingConfig = _f(doc="Metrics and terminal output.", factory=LoggingConfig)
    monitor: MonitorConfig = _f(doc="Run health: stragglers, hangs, loss spikes, Prometheus.", factory=MonitorConfig)


def checkpoint_dir(cfg: Config) -> str:
    return cfg.checkpoint.dir or os.path.join(cfg.train.output_dir, "checkpoints")
