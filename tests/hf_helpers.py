"""Shared pieces of the Hugging Face parity tests (whole models: test_hf_parity.py, test_hf_mixtral.py,
test_hf_qwen3_moe.py, test_qwen3.py; single layers: test_hf_layers.py).

Every model is tiny (d=64, vocab 128 unless a test says otherwise) and runs in fp32 on CPU. Weights are
re-randomized at std 0.1 (norm scales around 1, non-zero biases) so that activations are O(1) and a swapped or
mis-transposed weight cannot hide behind a near-zero init.

Logit tolerance: rtol=1e-4 with atol=1e-5. Two fp32 implementations of the same network differ by summation
order only (observed max |diff| ~1e-6 on logits of size ~1); the small atol is there because a relative
tolerance alone is meaningless for the logits that happen to be within ~1e-2 of zero. Importing this module
needs torch (the test modules import it after ``pytest.importorskip("torch")``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.model.llama import Llama

VOCAB, HIDDEN, FFN, LAYERS, HEADS = 128, 64, 96, 2, 4
BATCH, SEQ = 2, 16
LOGITS_RTOL, LOGITS_ATOL = 1e-4, 1e-5


def random_tokens(seq: int = SEQ, seed: int = 0, vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(BATCH, seq), dtype=np.int64)


def randomize_torch(model, seed: int = 0) -> None:
    """Weights ~ N(0, 0.1), norm scales ~ 1 + N(0, 0.2), biases ~ N(0, 0.1); ties stay tied (in place)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is the embedding, listed once
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.1 * noise)


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.float().numpy()


_forward = nnx.jit(lambda model, tokens: model(tokens))  # one compile per distinct config


def jax_logits(model: Llama, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(_forward(model, jnp.asarray(tokens, jnp.int32)))


def assert_logits_close(actual, expected) -> None:
    np.testing.assert_allclose(actual, expected, rtol=LOGITS_RTOL, atol=LOGITS_ATOL)


def jaxtron_model(seed: int = 1, **overrides) -> Llama:
    """A random fp32 jaxtron model with O(1) weights (see module docstring), built like ``hf.load`` builds
    one: abstract model + real arrays (numpy randoms are much faster than eager jax.random on CPU)."""
    cfg = ModelConfig(**{**dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                                num_kv_heads=2, intermediate_size=FFN, dtype="float32", param_dtype="float32",
                                remat="none"), **overrides})
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        is_norm = any("norm" in str(getattr(p, "key", "")) for p in path)
        return jnp.asarray(1.0 + 0.2 * noise if is_norm else 0.1 * noise)

    nnx.replace_by_pure_dict(state, jax.tree.map_with_path(draw, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


def hf_greedy(hf_model, prompt, new: int) -> list[int]:
    """transformers' greedy continuation of one prompt (``new`` tokens, no end-of-sequence stop)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == len(prompt) + new
    return out[0, len(prompt):].tolist()
