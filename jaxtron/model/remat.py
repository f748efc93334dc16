"""The recompute policies of the scanned decoder block (``model.remat``) and the names the model code gives the
activations they choose from.

``full`` keeps only each block's input and recomputes the rest in the backward; ``save_dots`` keeps every
matmul output without a batch dimension (XLA's choice, not named). The named policies keep chosen activations
(``jax.checkpoint_policies.save_only_these_names``) and recompute the rest, as Megatron's selective recompute
by module and MaxText's named policies do; the ``offload_*`` ones move them to pinned host memory after the
forward and back for the backward (``save_and_offload_only_these_names``), trading device memory for host
transfers. The names, tagged with :func:`tag` (``jax.ad_checkpoint.checkpoint_name``, an identity that only
remat policies read):

- ``query_proj``, ``key_proj``, ``value_proj``: the Q, K, V projections (after bias and the sharding
  constraint, before QK-norm and RoPE);
- ``attention_out``: attention's context, before the output projection (``wo``);
- ``out_proj``: the attention block's output, after ``wo``;
- ``mlp_in``: the feed-forward block's input (after its norm); ``mlp_out``: its output;
- ``router``: an MoE layer's routing (logits, probabilities, choices, combine weights);
- ``attention_kernel``: what a flash kernel's backward reads (cuDNN's, Pallas', Mosaic's: the operands it
  saw, its output, the softmax statistics). A kernel's output is no dot, so ``save_dots`` runs the kernel's
  forward again in the backward (for these, and for ``attention_out``, which ``wo``'s weight gradient reads);
  ``save_dots_attention`` keeps both and runs each attention forward once.

Every policy computes the same numbers (tests/test_remat.py: per-leaf gradients equal the default's).
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

QKV = ("query_proj", "key_proj", "value_proj")
ATTENTION_OUT, OUT_PROJ = "attention_out", "out_proj"
MLP_IN, MLP_OUT, ROUTER = "mlp_in", "mlp_out", "router"
ATTENTION_KERNEL = "attention_kernel"
NAMED = QKV + (ATTENTION_OUT, OUT_PROJ, MLP_IN, MLP_OUT, ROUTER)


def tag(x, name: str):
    """``x`` (an array or a pytree of arrays) named ``name`` for the remat policies."""
    return jax.tree.map(lambda a: checkpoint_name(a, name), x)


def _offload(*names: str):
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names), offload_src="device",
        offload_dst="pinned_host")


_save = jax.checkpoint_policies.save_only_these_names

# FP8 recipes' scales and amaxes (jaxtron/model/fp8.py): scalars that every policy keeps, so that the backward's
# recomputed FP8 casts reuse the forward's scales instead of reducing over their recomputed tensors again
FP8_SCALE = "fp8_scale"
_fp8_scales = _save(FP8_SCALE)


def _keeping_fp8_scales(policy):
    """``policy``, and the values tagged :data:`FP8_SCALE` kept (a few scalars per layer; the same numbers as
    recomputed ones)."""
    def keep(prim, *args, **params):
        return True if _fp8_scales(prim, *args, **params) is True else policy(prim, *args, **params)

    return keep


# model.remat -> the policy jax.checkpoint applies to the scanned block ('none' applies no checkpoint)
POLICIES = {name: _keeping_fp8_scales(policy) for name, policy in {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_dots_attention": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _save(ATTENTION_KERNEL, ATTENTION_OUT)),
    "save_qkv_proj": _save(*QKV),
    "save_attention_out": _save(ATTENTION_OUT, OUT_PROJ),
    "save_qkv_attention": _save(*QKV, ATTENTION_OUT),
    "save_mlp_io": _save(MLP_IN, MLP_OUT, ROUTER),
    "save_named": _save(*NAMED),
    "offload_qkv_attention": _offload(*QKV, ATTENTION_OUT),
    "offload_named": _offload(*NAMED),
}.items()}
