"""The one typed configuration tree: model, parallel, optim, data, train, checkpoint, logging.

Parsing and merging (YAML presets plus dotted command-line overrides such as ``parallel.tensor=8``) is done
by OmegaConf against the dataclass schema below, so unknown keys and wrong types are rejected with the full
dotted name of the field. Cross-field checks (heads divisible by the tensor axis, batch divisible by the
data-parallel size, ...) live in :func:`validate` and raise :class:`ConfigError`, whose message starts with
the field it is about.

    cfg = jaxtron.config.load("configs/llama3_8b.yaml", ["parallel.tensor=8", "train.steps=100"])
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
DEFAULT_PRESET = "tiny"


class ConfigError(ValueError):
    """A configuration value is invalid. ``str(err)`` is one line that starts with the field name."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


def _f(default: Any = dataclasses.MISSING, doc: str = "", factory: Any = None):
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class RopeScalingConfig:
    type: str = _f("none", "'none' or 'llama3' (Llama-3.1 frequency-dependent scaling).")
    factor: float = _f(8.0, "llama3: how much the context is stretched.")
    low_freq_factor: float = _f(1.0, "llama3: wavelengths above original_max/low_freq_factor are scaled fully.")
    high_freq_factor: float = _f(4.0, "llama3: wavelengths below original_max/high_freq_factor are kept.")
    original_max_position_embeddings: int = _f(8192, "llama3: the context length the model was trained with.")


@dataclass
class ModelConfig:
    vocab_size: int = _f(256, "Vocabulary size (rows of the embedding table).")
    hidden_size: int = _f(256, "Model width d_model.")
    num_layers: int = _f(4, "Number of decoder blocks (stacked and scanned).")
    num_heads: int = _f(4, "Query heads.")
    num_kv_heads: int = _f(2, "Key/value heads (GQA: num_heads % num_kv_heads == 0; 1 = MQA).")
    head_dim: Optional[int] = _f(None, "Per-head width; default hidden_size // num_heads.")
    intermediate_size: int = _f(512, "SwiGLU hidden width (ffn_hidden_size).")
    rope_theta: float = _f(10000.0, "RoPE base frequency.")
    rope_scaling: RopeScalingConfig = _f(doc="RoPE frequency scaling.", factory=RopeScalingConfig)
    rms_norm_eps: float = _f(1e-5, "RMSNorm epsilon.")
    tie_embeddings: bool = _f(False, "Share the token embedding with the LM head.")
    qkv_bias: bool = _f(False, "Bias on the Q/K/V projections (Qwen2).")
    initializer_range: float = _f(0.02, "Std of the normal init; output projections use std/sqrt(2*num_layers).")
    attention_impl: str = _f("xla", "Attention: 'xla' (reference, any device), 'cudnn' (GPU), 'pallas' (jaxtron's "
                                    "flash attention; GPU, or interpret mode on CPU: exact but slow) or 'mosaic' "
                                    "(its Mosaic GPU kernels for Hopper; bf16/fp16, head_dim "
                                    "64 or 128; on CPU interpreted with jax >= 0.11).")
    deterministic_attention: bool = _f(False, "Bitwise-reproducible attention gradients: 'mosaic' then computes dq "
                                              "in a kernel of its own instead of reduce-adding it from the dk/dv "
                                              "kernel (seven matmuls per block pair, not five); 'xla' and "
                                              "'pallas' always are; 'cudnn' is refused.")
    rope_impl: str = _f("xla", "Rotary embedding: 'xla' or 'pallas' (fused q/k kernel; interpret mode on CPU).")
    mlp_impl: str = _f("xla", "SwiGLU activation: 'xla' or 'pallas' (fused kernel; interpret mode on CPU).")
    check_kernels: bool = _f(True, "On GPUs, before compiling the train step, run each selected Pallas/Mosaic "
                                   "kernel forward and backward on a small problem against the XLA reference "
                                   "and stop with an error naming the field if it disagrees "
                                   "(jaxtron/train/kernel_check.py).")
    remat: str = _f("none", "Activation recomputation per block: 'none', 'full', or 'save_dots' (selective).")
    scan_unroll: int = _f(1, "Decoder blocks per iteration of the layer scan (1: rolled). Unrolling lets XLA fuse "
                             "across blocks and, inside a pipeline tick's checkpoint, merge the blocks' own "
                             "recomputation with the tick's; compile time grows with it.")
    dtype: str = _f("auto", "Compute dtype for matmuls and activations; 'auto': bfloat16 on GPU/TPU, float32 on "
                            "CPU (where bf16 elementwise ops are emulated and slower).")
    param_dtype: str = _f("float32", "Master weight dtype (optimizer state follows it).")


@dataclass
class ParallelConfig:
    data: int = _f(-1, "Data-parallel size (replicated params). -1: all devices the other axes leave.")
    fsdp: int = _f(1, "FSDP / ZeRO-3 size: params, grads and optimizer state sharded, batch split.")
    tensor: int = _f(1, "Megatron tensor-parallel size (heads, MLP and vocab split).")
    stage: int = _f(1, "Pipeline stages: the stacked decoder layers are split over this mesh axis (shard_map "
                       "over 'stage'; data, FSDP and tensor parallelism work inside each stage).")
    pipeline_schedule: str = _f("1f1b", "With stage > 1: '1f1b' (one forward and one backward per tick, "
                                        "activation memory flat in the number of micro batches), 'gpipe' "
                                        "(fill-drain, gradients through the loop with remat) or 'circular' "
                                        "(interleaved virtual stages, see virtual_stages).")
    virtual_stages: int = _f(1, "circular schedule: layer chunks per device (Megatron's virtual pipeline); "
                                "the bubble shrinks from (S-1)/(M+S-1) to (S-1)/(V*M+S-1).")
    pipeline_fsdp_gather_once: bool = _f(False, "With stage > 1 and fsdp > 1: all-gather each stage's weights "
                                                "over 'fsdp' once per step (and reduce-scatter their gradients "
                                                "once) instead of in every pipeline tick. Faster; costs the "
                                                "stage's unsharded weights and gradients in memory per device "
                                                "(MaxText's pipeline_fsdp_ag_once).")
    sequence_parallel: bool = _f(False, "Shard the sequence axis of norm/residual activations over 'tensor'.")


@dataclass
class OptimConfig:
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


@dataclass
class DataConfig:
    source: str = _f("builtin", "'builtin': this Python installation's standard-library sources (no download); "
                                "'indexed': Megatron .bin/.idx prefixes in data.paths.")
    paths: Optional[str] = _f(None, "indexed: 'PREFIX' or a weighted blend 'W1 PREFIX1 W2 PREFIX2 ...' "
                                    "(Megatron's --data-path).")
    split: str = _f("969,30,1", "indexed: train,valid,test weights over the documents (Megatron's --split).")
    eod_id: int = _f(0, "indexed: the end-of-document token id (the byte tokenizer's is 0).")
    tokenizer: str = _f("byte", "builtin: 'byte', byte-level (vocab 256, token 0 = end of document).")
    seq_len: int = _f(256, "Tokens per training sequence.")
    valid_fraction: float = _f(0.02, "Fraction of documents held out for evaluation.")
    max_corpus_bytes: int = _f(16 * 2**20, "builtin: read at most this many bytes of sources.")
    cache_dir: Optional[str] = _f(None, "builtin: where its .bin/.idx files are prepared once (default "
                                        "$JAXTRON_CACHE_DIR or ~/.cache/jaxtron).")
    reset_at_eod: bool = _f(False, "Restart positions and block attention at end-of-document tokens (the batch's "
                                   "segment_ids); false: plain causal attention over the whole sequence.")
    eod_mask_loss: bool = _f(False, "Do not train on predicting the end-of-document token.")


@dataclass
class TrainConfig:
    steps: int = _f(200, "Optimizer steps to run.")
    seed: int = _f(0, "Seed for parameter init and data order.")
    output_dir: str = _f("runs/default", "Where metrics.jsonl, TensorBoard events and the resolved config go.")
    global_batch_size: int = _f(8, "Sequences per optimizer step.")
    micro_batch_size: Optional[int] = _f(None, "Sequences per micro batch per data-parallel replica (data*fsdp);"
                                               " gradient accumulation steps = global / (micro * dp). Default: "
                                               "global / dp (no accumulation).")
    eval_every: int = _f(100, "Evaluate on held-out data every N steps (0: only at the end).")
    eval_batches: int = _f(4, "Batches of global_batch_size per evaluation.")
    peak_tflops: Optional[float] = _f(None, "Peak dense bf16 TFLOP/s per device for MFU; default from the "
                                            "known-GPU table, none on CPU.")
    collective_timeout_s: int = _f(100, "Multi-process runs: a process that stops answering for this long "
                                        "(crashed, hung, lost node) makes the others exit with an error "
                                        "instead of waiting forever.")
    max_skipped_steps: int = _f(10, "A step whose loss or gradient norm is not finite is skipped (no update); "
                                    "after this many in a row the run saves a checkpoint and stops.")


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
class Config:
    model: ModelConfig = _f(doc="The network.", factory=ModelConfig)
    parallel: ParallelConfig = _f(doc="Device mesh sizes and sharding switches.", factory=ParallelConfig)
    optim: OptimConfig = _f(doc="Optimizer and learning-rate schedule.", factory=OptimConfig)
    data: DataConfig = _f(doc="Training data.", factory=DataConfig)
    train: TrainConfig = _f(doc="The training run.", factory=TrainConfig)
    checkpoint: CheckpointConfig = _f(doc="Checkpoints.", factory=CheckpointConfig)
    distributed: DistributedConfig = _f(doc="Joining a multi-process (multi-node) run.", factory=DistributedConfig)
    logging: LoggingConfig = _f(doc="Metrics and terminal output.", factory=LoggingConfig)


# ----------------------------------------------------------------------------------------------- loading


def _omegaconf_error(err: OmegaConfBaseException, origin: str) -> ConfigError:
    key = getattr(err, "full_key", None) or "config"
    msg = str(getattr(err, "msg", None) or err).splitlines()[0]
    if "not in" in msg and "Key" in msg:
        msg = "unknown field"
    return ConfigError(key, f"{msg} (from {origin})")


def preset_path(name_or_path: str) -> str:
    """A preset name ('tiny', 'llama3_8b') or a path to a YAML file."""
    if os.path.exists(name_or_path):
        return name_or_path
    candidate = os.path.join(CONFIG_DIR, f"{name_or_path}.yaml")
    if os.path.exists(candidate):
        return candidate
    raise ConfigError("--config", f"no such file or preset: {name_or_path!r}")


def load(path: Optional[str] = None, overrides: Sequence[str] = (), validate_config: bool = True) -> Config:
    """Load a config: dataclass defaults <- YAML file <- dotted overrides.

    The dataclass defaults are the ``tiny`` preset (configs/tiny.yaml spells them out), so ``load()``
    works from an installed package with no configs/ folder."""
    schema = OmegaConf.structured(Config)
    raw: Any = {}
    if path is not None:
        path = preset_path(path)
        try:
            with open(path) as f:
                raw = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError("--config", f"cannot read {path}: {str(err).splitlines()[0]}") from None
    else:
        path = "defaults"
    if not isinstance(raw, dict):
        raise ConfigError("--config", f"{path} must hold a mapping of sections, got {type(raw).__name__}")
    merged = schema
    try:
        merged = OmegaConf.merge(merged, OmegaConf.create(raw))
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err, path) from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "an override must look like section.field=value")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as err:
            raise _omegaconf_error(err, f"override {item!r}") from None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err, path) from None
    if validate_config:
        validate(cfg)
    return cfg


def load_config(path: Optional[str] = None, overrides: Sequence[str] | Mapping[str, Any] = (),
                validate_config: bool = True) -> Config:
    """Load a :class:`Config`: the dataclass defaults (the ``tiny`` preset), then the YAML ``path`` (a preset
    name such as ``"llama3_8b"`` or a file), then ``overrides``: dotted ``"section.field=value"`` strings, as
    on the command line, or a dict ``{"section.field": value}``. Raises :class:`ConfigError`, whose message
    starts with the offending field, on unknown fields, wrong types and inconsistent values.

        cfg = jaxtron.load_config("tiny", {"train.steps": 30, "parallel.fsdp": 2})"""
    if isinstance(overrides, Mapping):
        items = []
        for key, value in overrides.items():
            if isinstance(value, (dict, list, tuple)):
                raise ConfigError(str(key), f"override values must be scalars, got {type(value).__name__}")
            text = "null" if value is None else (str(value).lower() if isinstance(value, bool) else str(value))
            items.append(f"{key}={text}")
        overrides = items
    elif isinstance(overrides, str):
        overrides = [overrides]
    return load(None if path is None else os.fspath(path), list(overrides), validate_config)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def from_dict(d: dict) -> Config:
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(d)))
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err, "dict") from None


def _leaf_fields(cls: type, prefix: str = ""):
    """(dotted name, default value, doc) for every leaf field of the dataclass ``cls``."""
    inst = cls()
    for f in dataclasses.fields(cls):
        value = getattr(inst, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _leaf_fields(type(value), name + ".")
        else:
            yield name, value, f.metadata.get("doc", "")


def fields_help(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, doc) for every leaf field, for ``--help`` and the docs."""
    return [(name, repr(value), doc) for name, value, doc in _leaf_fields(cls, prefix)]


REFERENCE_HEADER = """\
# Config reference

<!-- Generated from the dataclass docs in jaxtron/config.py by `python scripts/gen_config_reference.py`;
     do not edit by hand (tests/test_docs.py checks it is current). -->

Every field of `jaxtron.config.Config`, its default (the `tiny` preset) and what it does. Set fields in a
YAML file (`--config FILE`, sections as mappings), as dotted overrides on the command line
(`python -m jaxtron.train section.field=value`), or in Python with
`jaxtron.load_config(path, {"section.field": value})`. Defaults are written as in YAML. A bad value stops
the program before anything is compiled, with one line that starts with the field's name.
"""


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def reference_markdown() -> str:
    """The config reference (``docs/config.md``): one table per section, from the dataclass field docs."""
    out = [REFERENCE_HEADER]
    inst = Config()
    for section in dataclasses.fields(Config):
        out.append(f"## `{section.name}`\n")
        out.append(f"{section.metadata.get('doc', '')}\n")
        out.append("| field | default | description |")
        out.append("|---|---|---|")
        for name, default, doc in _leaf_fields(type(getattr(inst, section.name)), section.name + "."):
            text = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
            out.append(f"| `{name}` | `{_md_cell(text)}` | {_md_cell(doc)} |")
        out.append("")
    return "\n".join(out)


# -------------------------------------------------------------------------------------------- validation

ATTENTION_IMPLS = ("xla", "cudnn", "pallas", "mosaic")
KERNEL_IMPLS = ("xla", "pallas")
REMAT_POLICIES = ("none", "full", "save_dots")
SCHEDULES = ("cosine", "linear", "wsd", "constant")
DTYPES = ("float32", "bfloat16", "float16")
MESH_AXES = ("data", "fsdp", "tensor", "stage")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "circular")


def compute_dtype(m: ModelConfig) -> str:
    """The resolved compute dtype name ('auto' -> bfloat16 on accelerators, float32 on CPU)."""
    if m.dtype != "auto":
        return m.dtype
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def head_dim(m: ModelConfig) -> int:
    return m.head_dim if m.head_dim is not None else m.hidden_size // m.num_heads


def _check(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ConfigError(field_name, message)


def _positive(obj: Any, section: str, names: Sequence[str]) -> None:
    for n in names:
        v = getattr(obj, n)
        _check(v is not None and v > 0, f"{section}.{n}", f"must be > 0, got {v}")


def validate(cfg: Config) -> Config:
    """Checks that need no devices. Raises ConfigError naming the first bad field."""
    m, p, o, d, t = cfg.model, cfg.parallel, cfg.optim, cfg.data, cfg.train
    _positive(m, "model", ["vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                           "intermediate_size", "rope_theta", "rms_norm_eps"])
    _check(m.head_dim is None or m.head_dim > 0, "model.head_dim", f"must be > 0, got {m.head_dim}")
    _check(m.head_dim is not None or m.hidden_size % m.num_heads == 0, "model.hidden_size",
           f"{m.hidden_size} is not divisible by model.num_heads={m.num_heads}; set model.head_dim")
    _check(head_dim(m) % 2 == 0, "model.head_dim", f"must be even for RoPE, got {head_dim(m)}")
    _check(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads",
           f"model.num_heads={m.num_heads} is not divisible by num_kv_heads={m.num_kv_heads}")
    _check(m.attention_impl in ATTENTION_IMPLS, "model.attention_impl",
           f"{m.attention_impl!r} is not one of {ATTENTION_IMPLS}")
    if m.attention_impl == "mosaic":
        from pallas_kernels.flash_attention_mosaic import MOSAIC_HEAD_DIMS

        _check(head_dim(m) in MOSAIC_HEAD_DIMS, "model.attention_impl",
               f"'mosaic' supports head_dim {MOSAIC_HEAD_DIMS}, the model has {head_dim(m)}; use 'pallas'")
        _check(m.dtype != "float32", "model.attention_impl",
               "'mosaic' computes in bf16/fp16 (wgmma has no IEEE fp32); model.dtype=float32 needs 'pallas'")
    if m.attention_impl == "pallas":
        from pallas_kernels.flash_attention import head_dim_supported

        _check(head_dim_supported(head_dim(m)), "model.attention_impl",
               f"'pallas' needs head_dim a power of two >= 16 (64, 128, 256), the model has {head_dim(m)}; "
               "use 'xla'")
    if m.rope_impl == "pallas":
        from pallas_kernels.rope import head_dim_supported as rope_head_dim_supported

        _check(rope_head_dim_supported(head_dim(m)), "model.rope_impl",
               f"'pallas' needs head_dim/2 a power of two (head_dim 64, 128, 256), the model has {head_dim(m)}; "
               "use 'xla'")
    _check(not (m.deterministic_attention and m.attention_impl == "cudnn"), "model.deterministic_attention",
           "cuDNN's attention backward is not deterministic here; use model.attention_impl=pallas or mosaic")
    for name in ("rope_impl", "mlp_impl"):
        _check(getattr(m, name) in KERNEL_IMPLS, f"model.{name}", f"{getattr(m, name)!r} is not one of {KERNEL_IMPLS}")
    _check(m.remat in REMAT_POLICIES, "model.remat", f"{m.remat!r} is not one of {REMAT_POLICIES}")
    _check(m.scan_unroll >= 1, "model.scan_unroll", f"must be >= 1, got {m.scan_unroll}")
    _check(m.dtype in DTYPES + ("auto",), "model.dtype", f"{m.dtype!r} is not one of {DTYPES + ('auto',)}")
    _check(m.param_dtype in DTYPES, "model.param_dtype", f"{m.param_dtype!r} is not one of {DTYPES}")
    _check(m.rope_scaling.type in ("none", "llama3"), "model.rope_scaling.type",
           f"{m.rope_scaling.type!r} is not one of ('none', 'llama3')")
    if m.rope_scaling.type == "llama3":
        rs = m.rope_scaling
        _positive(rs, "model.rope_scaling", ["factor", "low_freq_factor", "high_freq_factor",
                                             "original_max_position_embeddings"])
        _check(rs.high_freq_factor > rs.low_freq_factor, "model.rope_scaling.high_freq_factor",
               f"must be > low_freq_factor ({rs.low_freq_factor}), got {rs.high_freq_factor}")

    for axis in MESH_AXES:
        v = getattr(p, axis)
        _check(v == -1 or v >= 1, f"parallel.{axis}", f"must be >= 1 (or -1 to fill), got {v}")
    _check(sum(getattr(p, a) == -1 for a in MESH_AXES) <= 1, "parallel",
           "at most one of data/fsdp/tensor/stage may be -1")
    _check(p.pipeline_schedule in PIPELINE_SCHEDULES, "parallel.pipeline_schedule",
           f"{p.pipeline_schedule!r} is not one of {PIPELINE_SCHEDULES}")
    _check(p.virtual_stages >= 1, "parallel.virtual_stages", f"must be >= 1, got {p.virtual_stages}")
    _check(p.virtual_stages == 1 or p.pipeline_schedule == "circular", "parallel.virtual_stages",
           f"{p.virtual_stages} virtual stages need parallel.pipeline_schedule=circular "
           f"(got {p.pipeline_schedule!r})")
    if p.stage > 0:
        _check_layers_split(m, p, p.stage)
    if p.tensor > 0:
        _check(m.num_heads % p.tensor == 0, "parallel.tensor",
               f"model.num_heads={m.num_heads} is not divisible by tensor={p.tensor}")
        _check(m.num_kv_heads % p.tensor == 0, "parallel.tensor",
               f"model.num_kv_heads={m.num_kv_heads} is not divisible by tensor={p.tensor}")
        _check(m.intermediate_size % p.tensor == 0, "parallel.tensor",
               f"model.intermediate_size={m.intermediate_size} is not divisible by tensor={p.tensor}")
        if p.sequence_parallel:
            _check(d.seq_len % p.tensor == 0, "data.seq_len",
                   f"{d.seq_len} is not divisible by parallel.tensor={p.tensor} (sequence_parallel)")

    _positive(o, "optim", ["lr"])
    _check(0.0 <= o.min_lr_ratio <= 1.0, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    _check(o.schedule in SCHEDULES, "optim.schedule", f"{o.schedule!r} is not one of {SCHEDULES}")
    _check(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _check(o.decay_steps is None or o.decay_steps >= 0, "optim.decay_steps", f"must be >= 0, got {o.decay_steps}")
    _check(0.0 <= o.beta1 < 1.0, "optim.beta1", f"must be in [0, 1), got {o.beta1}")
    _check(0.0 <= o.beta2 < 1.0, "optim.beta2", f"must be in [0, 1), got {o.beta2}")
    _check(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _check(o.grad_clip >= 0, "optim.grad_clip", f"must be >= 0, got {o.grad_clip}")
    _check(o.z_loss >= 0, "optim.z_loss", f"must be >= 0, got {o.z_loss}")

    _check(d.source in ("builtin", "indexed"), "data.source", f"{d.source!r} is not one of ('builtin', 'indexed')")
    _check(d.source != "indexed" or bool(d.paths), "data.paths", "required when data.source=indexed")
    _check(d.tokenizer == "byte", "data.tokenizer", f"{d.tokenizer!r} is not supported yet (only 'byte')")
    _positive(d, "data", ["seq_len", "max_corpus_bytes"])
    _check(0.0 < d.valid_fraction < 1.0, "data.valid_fraction", f"must be in (0, 1), got {d.valid_fraction}")
    if d.source == "builtin" and d.tokenizer == "byte":
        _check(m.vocab_size >= 256, "model.vocab_size", f"the byte tokenizer needs >= 256, got {m.vocab_size}")

    _positive(t, "train", ["steps", "global_batch_size", "eval_batches"])
    _check(t.micro_batch_size is None or t.micro_batch_size > 0, "train.micro_batch_size",
           f"must be > 0, got {t.micro_batch_size}")
    _check(t.eval_every >= 0, "train.eval_every", f"must be >= 0, got {t.eval_every}")
    _check(t.peak_tflops is None or t.peak_tflops > 0, "train.peak_tflops", f"must be > 0, got {t.peak_tflops}")
    _check(bool(t.output_dir), "train.output_dir", "must not be empty")
    if -1 not in (p.data, p.fsdp):
        _check_batch(t, p.data * p.fsdp)
    c = cfg.checkpoint
    for name in ("every_steps", "keep_every"):
        _check(getattr(c, name) >= 0, f"checkpoint.{name}", f"must be >= 0, got {getattr(c, name)}")
    _check(c.keep >= 1, "checkpoint.keep", f"must be >= 1, got {c.keep}")
    _check(c.dir is None or bool(c.dir), "checkpoint.dir", "must not be empty")
    _check(c.load_weights is None or bool(c.load_weights), "checkpoint.load_weights", "must not be empty")
    _check(t.collective_timeout_s >= 1, "train.collective_timeout_s", f"must be >= 1, got {t.collective_timeout_s}")
    dd = cfg.distributed
    _check(dd.num_processes is None or dd.num_processes >= 1, "distributed.num_processes",
           f"must be >= 1, got {dd.num_processes}")
    _check(dd.process_id is None or dd.process_id >= 0, "distributed.process_id", f"must be >= 0, got {dd.process_id}")
    _check(dd.initialization_timeout_s >= 1, "distributed.initialization_timeout_s", "must be >= 1")
    _check(t.max_skipped_steps >= 1, "train.max_skipped_steps", f"must be >= 1, got {t.max_skipped_steps}")
    _positive(cfg.logging, "logging", ["log_every"])
    _check(cfg.logging.level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "logging.level",
           f"{cfg.logging.level!r} is not a logging level")
    return cfg


def _check_layers_split(m: ModelConfig, p: ParallelConfig, stages: int) -> None:
    chunks = stages * p.virtual_stages
    _check(m.num_layers % chunks == 0, "model.num_layers",
           f"{m.num_layers} layers cannot be split into parallel.stage ({stages}) x parallel.virtual_stages "
           f"({p.virtual_stages}) = {chunks} equal chunks")


def pipeline_micro_batches(t: TrainConfig, dp: int) -> int:
    """Micro batches per step (= gradient accumulation steps): global / (micro batch size x data parallel)."""
    return t.global_batch_size // (micro_batch_size(t, dp) * dp)


def pipeline_bubble(p: ParallelConfig, stages: int, micro_batches: int) -> float:
    """Idle fraction of the pipeline schedule: (S-1)/(M+S-1), or (S-1)/(V*M+S-1) for the circular one."""
    if stages <= 1:
        return 0.0
    v = p.virtual_stages if p.pipeline_schedule == "circular" else 1
    return (stages - 1) / (v * micro_batches + stages - 1)


def _check_batch(t: TrainConfig, dp: int) -> None:
    if t.micro_batch_size is None:
        _check(t.global_batch_size % dp == 0, "train.global_batch_size",
               f"{t.global_batch_size} is not divisible by the data-parallel size (data*fsdp = {dp})")
    else:
        _check(t.global_batch_size % (t.micro_batch_size * dp) == 0, "train.global_batch_size",
               f"{t.global_batch_size} is not divisible by micro_batch_size ({t.micro_batch_size}) x "
               f"data-parallel size (data*fsdp = {dp})")


def checkpoint_dir(cfg: Config) -> str:
    return cfg.checkpoint.dir or os.path.join(cfg.train.output_dir, "checkpoints")


def micro_batch_size(t: TrainConfig, dp: int) -> int:
    """Sequences per micro batch per data-parallel replica (resolving the default)."""
    return t.micro_batch_size if t.micro_batch_size is not None else t.global_batch_size // dp


def resolve_mesh_shape(p: ParallelConfig, num_devices: int) -> dict[str, int]:
    """Fill a -1 axis and check that the mesh covers exactly ``num_devices`` devices."""
    sizes = {a: getattr(p, a) for a in MESH_AXES}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    fill = [a for a, v in sizes.items() if v == -1]
    if fill:
        _check(num_devices % fixed == 0, f"parallel.{fill[0]}",
               f"cannot fill: {num_devices} devices are not divisible by the other axes' product {fixed}")
        sizes[fill[0]] = num_devices // fixed
    total = math.prod(sizes.values())
    _check(total == num_devices, "parallel",
           f"mesh data*fsdp*tensor*stage = {'*'.join(str(sizes[a]) for a in MESH_AXES)} = {total} "
           f"does not match the {num_devices} available devices")
    return sizes


def validate_for_devices(cfg: Config, num_devices: int, platform: Optional[str] = None) -> dict[str, int]:
    """Device-dependent checks (mesh size, batch divisibility, GPU-only choices); returns the mesh shape."""
    if platform is not None and cfg.model.attention_impl == "cudnn":
        _check(platform in ("gpu", "cuda"), "model.attention_impl",
               f"'cudnn' needs an NVIDIA GPU; the devices here are {platform!r} (use model.attention_impl=xla)")
    if platform is not None:
        for name in ("attention_impl", "rope_impl", "mlp_impl"):
            _check(getattr(cfg.model, name) != "pallas" or platform in ("gpu", "cuda", "cpu"), f"model.{name}",
                   f"'pallas' kernels are Triton (NVIDIA GPU; interpret mode on CPU), not {platform!r}")
    if platform is not None and cfg.model.attention_impl == "mosaic":
        _check(platform in ("gpu", "cuda", "cpu"), "model.attention_impl",
               f"'mosaic' is a Mosaic GPU kernel (NVIDIA Hopper; interpret mode on CPU), not {platform!r}")
        if platform == "cpu":
            import jax
            from jax.experimental.pallas import mosaic_gpu as plgpu

            _check(hasattr(plgpu, "InterpretGPUParams"), "model.attention_impl",
                   f"'mosaic' on CPU runs in Mosaic GPU's interpreter, which jax {jax.__version__} lacks "
                   "(jax >= 0.11); use 'pallas'")
        _check(compute_dtype(cfg.model) != "float32", "model.dtype",
               "float32 compute (model.dtype=auto on CPU) cannot use attention_impl='mosaic'; "
               "set model.dtype=bfloat16")
    sizes = resolve_mesh_shape(cfg.parallel, num_devices)
    t, m = cfg.train, cfg.model
    _check_batch(t, sizes["data"] * sizes["fsdp"])
    if platform == "cpu" and m.attention_impl == "mosaic" and not m.deterministic_attention:
        from pallas_kernels.flash_attention import INTERPRET_DQ_BYTES, interpret_dq_bytes

        rows = micro_batch_size(t, sizes["data"] * sizes["fsdp"])
        seq = -(-cfg.data.seq_len // 128) * 128              # as flash_attention pads it (default blocks)
        need = interpret_dq_bytes(rows, seq, m.num_heads // sizes["tensor"], head_dim(m))
        _check(need <= INTERPRET_DQ_BYTES, "model.deterministic_attention",
               f"'mosaic' on CPU (interpreted) sums its fused dq through {need / 2**30:.1f} GiB of partial sums at "
               f"data.seq_len={cfg.data.seq_len}; set model.deterministic_attention=true or a shorter data.seq_len")
    if platform == "cpu" and m.attention_impl == "mosaic":
        from pallas_kernels.flash_attention_mosaic import INTERPRET_THREADS, interpret_threads

        _check(num_devices == 1, "model.attention_impl",
               f"'mosaic' on CPU runs in Mosaic GPU's interpreter, which simulates one GPU per process: kernels "
               f"interpreted on {num_devices} CPU devices at once trip over each other's barriers; train on one "
               "device (jaxtron.Trainer(cfg, devices=jax.devices()[:1])) or use 'pallas'")
        _check(interpret_threads() >= INTERPRET_THREADS, "model.attention_impl",
               f"'mosaic' on CPU needs {INTERPRET_THREADS} XLA CPU threads for Mosaic GPU's interpreter and XLA "
               f"has {interpret_threads()} here (max of cores and CPU devices), so it would deadlock; use "
               "'pallas'")
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        _check(getattr(m, name) % sizes["tensor"] == 0, "parallel.tensor",
               f"model.{name}={getattr(m, name)} is not divisible by tensor={sizes['tensor']}")
    p = cfg.parallel
    if sizes["stage"] > 1:
        _check_layers_split(m, p, sizes["stage"])
        if p.pipeline_schedule == "circular":
            mb = pipeline_micro_batches(t, sizes["data"] * sizes["fsdp"])
            _check(mb >= sizes["stage"], "train.micro_batch_size",
                   f"the circular schedule needs at least parallel.stage={sizes['stage']} micro batches per step; "
                   f"global_batch_size / (micro_batch_size x data x fsdp) = {mb}")
    return sizes
