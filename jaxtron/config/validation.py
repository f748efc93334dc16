"""Checks of a config on its own fields; each raises :class:`ConfigError` naming the first bad field.

Checks that need the model or the mesh (heads divisible by the tensor axis, batch by the data-parallel size,
layers by the pipeline stages, kernel capabilities, FP8 blocks per shard) are made by :mod:`jaxtron.preflight`,
which the entry points call on the configured sizes and again on the Layout's resolved ones.
"""

from __future__ import annotations

import math
import os
from functools import reduce

from jaxtron.config.schema import Config, require as check
from jaxtron.config.model_schema import head_dim

ATTENTION_IMPLS = ("xla", "cudnn", "pallas", "mosaic")
FP8_RECIPES = ("none", "current", "delayed", "blockwise")
FP8_BLOCKWISE_IMPLS = ("auto", "xla", "pallas")
KERNEL_IMPLS = ("xla", "pallas")
# jaxtron.model.remat.POLICIES has one policy for each but none (tests/test_remat.py checks they agree)
REMAT_POLICIES = ("none", "full", "save_dots", "save_dots_attention", "save_qkv_proj", "save_attention_out",
                  "save_qkv_attention", "save_mlp_io", "save_named", "offload_qkv_attention", "offload_named")
SCHEDULES = ("cosine", "linear", "wsd", "constant")
OPTIMIZERS = ("adamw", "muon")
DTYPES = ("float32", "bfloat16", "float16")
MOE_SCORE_FUNCS = ("softmax", "sigmoid")
MOE_DISPATCH = ("dropless", "capacity")
MOE_GMM_IMPLS = ("auto", "ragged_dot", "pallas")
MOE_EP_DISPATCH = ("all_to_all", "ragged_all_to_all")


def _positive(cfg, *dotted: str) -> None:
    for name in dotted:
        v = reduce(getattr, name.split("."), cfg)
        check(v is not None and v > 0, name, f"must be > 0, got {v}")


def _one_of(cfg, name: str, choices) -> None:
    v = reduce(getattr, name.split("."), cfg)
    check(v in choices, name, f"{v!r} is not one of {tuple(choices)}")


def validate(cfg: Config) -> Config:
    """Checks of the config's own fields (not against the model's kernels or the mesh: see
    :mod:`jaxtron.preflight`). Raises ConfigError naming the first bad field."""
    _validate_model(cfg)
    _validate_moe(cfg)
    _validate_mla(cfg)
    _validate_optim(cfg)
    _validate_data(cfg)
    _validate_run(cfg)
    return cfg


def _validate_model(cfg: Config) -> None:
    m = cfg.model
    _positive(cfg, "model.vocab_size", "model.hidden_size", "model.num_layers", "model.num_heads",
              "model.num_kv_heads", "model.intermediate_size", "model.rope_theta", "model.rms_norm_eps")
    check(m.head_dim is None or m.head_dim > 0, "model.head_dim", f"must be > 0, got {m.head_dim}")
    check(m.head_dim is not None or m.hidden_size % m.num_heads == 0, "model.hidden_size",
          f"{m.hidden_size} is not divisible by model.num_heads={m.num_heads}; set model.head_dim")
    check(head_dim(m) % 2 == 0, "model.head_dim", f"must be even for RoPE, got {head_dim(m)}")
    check(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads",
          f"model.num_heads={m.num_heads} is not divisible by num_kv_heads={m.num_kv_heads}")
    _one_of(cfg, "model.attention_impl", ATTENTION_IMPLS)
    check(not (m.deterministic_attention and m.attention_impl == "cudnn"), "model.deterministic_attention",
          "cuDNN's attention backward is not deterministic here; use model.attention_impl=pallas or mosaic")
    _one_of(cfg, "model.fp8", FP8_RECIPES)
    check(m.fp8_amax_history >= 1, "model.fp8_amax_history", f"must be >= 1, got {m.fp8_amax_history}")
    check(m.fp8_margin >= 0, "model.fp8_margin", f"must be >= 0, got {m.fp8_margin}")
    _check_blockwise(cfg)
    _one_of(cfg, "model.rope_impl", KERNEL_IMPLS)
    _one_of(cfg, "model.mlp_impl", KERNEL_IMPLS)
    _one_of(cfg, "model.remat", REMAT_POLICIES)
    check(m.scan_unroll >= 1, "model.scan_unroll", f"must be >= 1, got {m.scan_unroll}")
    check(m.loss_chunk_tokens >= 0, "model.loss_chunk_tokens", f"must be >= 0 (0: off), got {m.loss_chunk_tokens}")
    _one_of(cfg, "model.dtype", DTYPES + ("auto",))
    _one_of(cfg, "model.param_dtype", DTYPES)
    check(m.mtp.num_layers >= 0, "model.mtp.num_layers", f"must be >= 0 (0: no MTP), got {m.mtp.num_layers}")
    check(m.mtp.loss_coef >= 0, "model.mtp.loss_coef", f"must be >= 0, got {m.mtp.loss_coef}")
    _one_of(cfg, "model.rope_scaling.type", ("none", "llama3", "yarn"))
    rs = m.rope_scaling
    if rs.type == "llama3":
        _positive(cfg, *(f"model.rope_scaling.{n}" for n in ("factor", "low_freq_factor", "high_freq_factor",
                                                             "original_max_position_embeddings")))
        check(rs.high_freq_factor > rs.low_freq_factor, "model.rope_scaling.high_freq_factor",
              f"must be > low_freq_factor ({rs.low_freq_factor}), got {rs.high_freq_factor}")
    if rs.type == "yarn":
        # factor < 1 would shrink the context (transformers only warns; its mscale is then 1 while the
        # frequencies still change): refuse it rather than run a model no checkpoint was trained as
        check(rs.factor >= 1, "model.rope_scaling.factor", f"must be >= 1 for yarn, got {rs.factor}")
        _positive(cfg, "model.rope_scaling.original_max_position_embeddings", "model.rope_scaling.beta_slow")
        check(rs.beta_fast > rs.beta_slow, "model.rope_scaling.beta_fast",
              f"must be > beta_slow ({rs.beta_slow}), got {rs.beta_fast}")
        for name in ("mscale", "mscale_all_dim"):
            check(getattr(rs, name) >= 0, f"model.rope_scaling.{name}", f"must be >= 0 (0: not set), got "
                                                                        f"{getattr(rs, name)}")


def _check_blockwise(cfg: Config) -> None:
    """The FP8 block's own fields; whether each device's shard holds whole blocks needs the mesh sizes
    (:func:`jaxtron.preflight.check`)."""
    _one_of(cfg, "model.fp8_blockwise_impl", FP8_BLOCKWISE_IMPLS)
    b = cfg.model.fp8_block
    check(b >= 16 and b & (b - 1) == 0, "model.fp8_block", f"must be a power of two >= 16, got {b}")


def _validate_moe(cfg: Config) -> None:
    e, m = cfg.model.moe, cfg.model
    check(e.num_experts >= 0, "model.moe.num_experts", f"must be >= 0 (0: dense), got {e.num_experts}")
    _one_of(cfg, "model.moe.gmm_impl", MOE_GMM_IMPLS)
    if e.num_experts == 0:
        return
    _positive(cfg, "model.moe.num_experts_per_token", "model.moe.expert_intermediate_size", "model.moe.layer_freq",
              "model.moe.n_group", "model.moe.topk_group", "model.moe.routed_scaling_factor")
    check(e.num_experts_per_token <= e.num_experts, "model.moe.num_experts_per_token",
          f"top-k {e.num_experts_per_token} > model.moe.num_experts={e.num_experts}")
    check(e.num_shared_experts >= 0, "model.moe.num_shared_experts", f"must be >= 0, got {e.num_shared_experts}")
    check(e.shared_expert_intermediate_size is None or e.shared_expert_intermediate_size > 0,
          "model.moe.shared_expert_intermediate_size", f"must be > 0, got {e.shared_expert_intermediate_size}")
    check(not e.shared_expert_gate or e.num_shared_experts > 0, "model.moe.shared_expert_gate",
          "needs model.moe.num_shared_experts > 0")
    check(0 <= e.first_dense_layers < m.num_layers, "model.moe.first_dense_layers",
          f"must be in [0, model.num_layers={m.num_layers}), got {e.first_dense_layers}")
    check((m.num_layers - e.first_dense_layers) % e.layer_freq == 0, "model.moe.layer_freq",
          f"{e.layer_freq} does not divide the {m.num_layers - e.first_dense_layers} layers after "
          f"model.moe.first_dense_layers (the MoE layers are scanned in groups of layer_freq)")
    _one_of(cfg, "model.moe.score_func", MOE_SCORE_FUNCS)
    _one_of(cfg, "model.moe.dispatch", MOE_DISPATCH)
    check(e.gmm_impl != "pallas" or e.dispatch == "dropless", "model.moe.gmm_impl",
          f"{e.gmm_impl!r} is the grouped matmul of dropless dispatch; model.moe.dispatch=capacity runs dense "
          "einsums (use gmm_impl=ragged_dot)")
    check(e.num_experts % e.n_group == 0, "model.moe.n_group",
          f"{e.n_group} groups do not divide model.moe.num_experts={e.num_experts}")
    check(e.topk_group <= e.n_group, "model.moe.topk_group", f"{e.topk_group} > model.moe.n_group={e.n_group}")
    per_group = e.num_experts // e.n_group
    # a group scores the sum of its best two experts (DeepSeek-V3), so it needs two when grouping is on
    check(e.n_group == 1 or per_group >= 2, "model.moe.n_group",
          f"{e.n_group} groups leave {per_group} expert per group; grouped top-k needs >= 2")
    check(e.num_experts_per_token <= e.topk_group * per_group, "model.moe.num_experts_per_token",
          f"top-k {e.num_experts_per_token} > the {e.topk_group * per_group} experts of model.moe.topk_group="
          f"{e.topk_group} groups")
    check(e.bias_update_rate >= 0, "model.moe.bias_update_rate", f"must be >= 0, got {e.bias_update_rate}")
    for name in ("aux_loss_coef", "z_loss_coef"):
        v = getattr(e, name)
        check(v >= 0, f"model.moe.{name}", f"must be >= 0, got {v}")
    check(e.capacity_factor > 0, "model.moe.capacity_factor", f"must be > 0, got {e.capacity_factor}")
    _one_of(cfg, "model.moe.ep_dispatch", MOE_EP_DISPATCH)
    check(e.ep_capacity_factor is None or e.ep_capacity_factor > 0, "model.moe.ep_capacity_factor",
          f"must be > 0 (or null: the worst case, nothing dropped), got {e.ep_capacity_factor}")


def _validate_mla(cfg: Config) -> None:
    a, m = cfg.model.mla, cfg.model
    for name in ("kv_lora_rank", "q_lora_rank"):
        check(getattr(a, name) >= 0, f"model.mla.{name}", f"must be >= 0 (0: off), got {getattr(a, name)}")
    if a.kv_lora_rank == 0:
        return
    _positive(cfg, "model.mla.qk_nope_head_dim", "model.mla.qk_rope_head_dim", "model.mla.v_head_dim")
    check(a.qk_rope_head_dim % 2 == 0, "model.mla.qk_rope_head_dim", f"must be even for RoPE, got {a.qk_rope_head_dim}")
    # the shared rotary key is one head: the fused kernel rotates q and k with the same head split
    check(m.rope_impl == "xla", "model.rope_impl",
          f"{m.rope_impl!r}: MLA rotates its one shared key head with the 'xla' RoPE; set model.rope_impl=xla")


def _validate_optim(cfg: Config) -> None:
    o = cfg.optim
    _one_of(cfg, "optim.name", OPTIMIZERS)
    _positive(cfg, "optim.lr")
    # an lr past float32's range becomes inf in the step (1e39 did, with numpy overflow warnings); even 10 is
    # far beyond any optimizer's stable range
    check(math.isfinite(o.lr) and o.lr <= 10.0, "optim.lr", f"must be a finite learning rate <= 10, got {o.lr}")
    check(0.0 <= o.min_lr_ratio <= 1.0, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    _one_of(cfg, "optim.schedule", SCHEDULES)
    check(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    check(o.decay_steps is None or o.decay_steps >= 0, "optim.decay_steps", f"must be >= 0, got {o.decay_steps}")
    check(0.0 <= o.beta1 < 1.0, "optim.beta1", f"must be in [0, 1), got {o.beta1}")
    check(0.0 <= o.beta2 < 1.0, "optim.beta2", f"must be in [0, 1), got {o.beta2}")
    for name in ("weight_decay", "grad_clip", "z_loss", "muon_rms"):
        v = getattr(o, name)
        check(v >= 0, f"optim.{name}", f"must be >= 0, got {v}")
    check(0.0 <= o.muon_beta < 1.0, "optim.muon_beta", f"must be in [0, 1), got {o.muon_beta}")
    check(o.muon_ns_steps >= 1, "optim.muon_ns_steps", f"must be >= 1, got {o.muon_ns_steps}")


def _validate_data(cfg: Config) -> None:
    d, m = cfg.data, cfg.model
    _one_of(cfg, "data.source", ("builtin", "indexed"))
    per_split = bool(d.train_paths or d.valid_paths or d.test_paths)
    check(d.source != "indexed" or bool(d.paths) or per_split, "data.paths",
          "required when data.source=indexed (or data.train_paths and data.valid_paths)")
    check(not (d.paths and per_split), "data.paths", "give either data.paths (cut by data.split) or "
          "data.train_paths/valid_paths/test_paths, not both (as Megatron's --data-path)")
    check(d.mid_level_dataset_surplus >= 0, "data.mid_level_dataset_surplus",
          f"must be >= 0, got {d.mid_level_dataset_surplus}")
    # the attention masks causally by position within a segment, so positions that restart inside one
    # segment would let tokens see later documents: reset positions only together with the mask
    check(not d.reset_position_ids or d.reset_attention_mask or d.reset_at_eod, "data.reset_position_ids",
          "needs data.reset_attention_mask=true (positions restart per document only where attention does)")
    check(d.tokenizer == "byte" or os.path.exists(d.tokenizer), "data.tokenizer",
          f"{d.tokenizer!r}: no such file (give 'byte', a tokenizer.json or a SentencePiece .model)")
    check(d.eod_id is None or d.eod_id >= 0, "data.eod_id", f"must be >= 0, got {d.eod_id}")
    _positive(cfg, "data.seq_len", "data.max_corpus_bytes")
    check(0.0 < d.valid_fraction < 1.0, "data.valid_fraction", f"must be in (0, 1), got {d.valid_fraction}")
    if d.source == "builtin" and d.tokenizer == "byte":
        check(m.vocab_size >= 256, "model.vocab_size", f"the byte tokenizer needs >= 256, got {m.vocab_size}")


def _validate_run(cfg: Config) -> None:
    t, c, dd = cfg.train, cfg.checkpoint, cfg.distributed
    _positive(cfg, "train.steps", "train.global_batch_size", "train.eval_batches")
    check(t.micro_batch_size is None or t.micro_batch_size > 0, "train.micro_batch_size",
          f"must be > 0, got {t.micro_batch_size}")
    check(t.eval_every >= 0, "train.eval_every", f"must be >= 0, got {t.eval_every}")
    check(t.peak_tflops is None or t.peak_tflops > 0, "train.peak_tflops", f"must be > 0, got {t.peak_tflops}")
    check(bool(t.output_dir), "train.output_dir", "must not be empty")
    for name in ("every_steps", "keep_every"):
        check(getattr(c, name) >= 0, f"checkpoint.{name}", f"must be >= 0, got {getattr(c, name)}")
    check(c.keep >= 1, "checkpoint.keep", f"must be >= 1, got {c.keep}")
    check(cfg.parallel.zero in (0, 1, 2), "parallel.zero", f"must be 0, 1 or 2, got {cfg.parallel.zero}")
    check(c.dir is None or bool(c.dir), "checkpoint.dir", "must not be empty")
    check(c.load_weights is None or bool(c.load_weights), "checkpoint.load_weights", "must not be empty")
    check(t.collective_timeout_s >= 1, "train.collective_timeout_s", f"must be >= 1, got {t.collective_timeout_s}")
    check(dd.num_processes is None or dd.num_processes >= 1, "distributed.num_processes",
          f"must be >= 1, got {dd.num_processes}")
    check(dd.process_id is None or dd.process_id >= 0, "distributed.process_id",
          f"must be >= 0, got {dd.process_id}")
    check(dd.initialization_timeout_s >= 1, "distributed.initialization_timeout_s", "must be >= 1")
    check(t.max_skipped_steps >= 1, "train.max_skipped_steps", f"must be >= 1, got {t.max_skipped_steps}")
    if t.latency_profile is not None:
        # XLA picks the parser by the suffix and skips any other file without a word
        check(t.latency_profile.endswith((".pbtxt", ".pb")), "train.latency_profile",
              f"{t.latency_profile!r}: must end in .pbtxt (text) or .pb (binary ProfiledInstructionsProto)")
        check(os.path.isfile(t.latency_profile), "train.latency_profile",
              f"{t.latency_profile!r}: no such file (python -m jaxtron.plan --latency-profile-out FILE writes one)")
    for name in ("exit_after_steps", "exit_after_minutes"):
        v = getattr(t, name)
        check(v is None or v >= 0, f"train.{name}", f"must be >= 0 (0 or null: off), got {v}")
        check(not v or c.enabled, f"train.{name}", "needs checkpoint.enabled=true (the next run resumes from the "
                                                   "checkpoint it saves)")
    _positive(cfg, "logging.log_every")
    check(cfg.logging.level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "logging.level",
          f"{cfg.logging.level!r} is not a logging level")
    _validate_monitor(cfg)


def _validate_monitor(cfg: Config) -> None:
    m = cfg.monitor
    check(m.straggler_threshold > 1, "monitor.straggler_threshold", f"must be > 1, got {m.straggler_threshold:g}")
    check(m.hang_factor == 0 or m.hang_factor > 1, "monitor.hang_factor",
          f"must be > 1 (or 0: off), got {m.hang_factor:g}")
    check(m.hang_min_s > 0, "monitor.hang_min_s", f"must be > 0, got {m.hang_min_s:g}")
    check(m.hang_factor == 0 or m.health, "monitor.hang_factor", "needs monitor.health=true (it times the steps)")
    check(m.loss_spike_window >= 0, "monitor.loss_spike_window", f"must be >= 0, got {m.loss_spike_window}")
    check(m.loss_spike_threshold > 0, "monitor.loss_spike_threshold", f"must be > 0, got {m.loss_spike_threshold:g}")
    _one_of(cfg, "monitor.loss_spike_action", ("log", "stop"))
    check(m.prometheus_port is None or 0 <= m.prometheus_port < 65536, "monitor.prometheus_port",
          f"must be a port number (0: any free one), got {m.prometheus_port}")
