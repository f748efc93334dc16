"""model.loss_chunk_tokens: the LM head and cross entropy a chunk of tokens at a time train exactly as the whole
micro batch's logits at once (losses, gradient norms, every gradient leaf; fp32), on one device, on a tensor x
FSDP mesh (the head split over vocab) and through a pipeline, dense and MoE, with z-loss, gradient
accumulation and tied embeddings; and the compiled train step needs less temporary memory with them."""

from __future__ import annotations

import functools

import jax
import pytest

from helpers import NONZERO_LR, TINY, assert_same_training, tiny_config, training_record
from jaxtron import config as config_lib
from jaxtron.config import ConfigError
from jaxtron.train.loss import loss_chunks
from jaxtron.train.program import build_program

# z-loss on; micro batches of 4 rows x 16 positions (64 tokens): two per step on one device
DENSE = ("optim.z_loss=1e-3", "train.micro_batch_size=4") + NONZERO_LR
# the same micro batches on tensor 2 x fsdp 2 (2 rows per FSDP rank)
MESH = ("parallel.tensor=2", "parallel.fsdp=2", "parallel.data=1", "train.micro_batch_size=2")


@functools.cache
def _record(overrides: tuple[str, ...], devices: int = 1, preset=None) -> dict:
    """One training record per config (the references are shared by the tests)."""
    cfg = config_lib.load(preset, TINY + list(overrides))
    return training_record(cfg, jax.devices()[:devices])


def test_chunk_shapes():
    """(chunks, positions per chunk) of a [rows, positions] micro batch."""
    assert loss_chunks(4, 16, 16) == (4, 4)   # divides: 4 chunks of 4 positions x 4 rows
    assert loss_chunks(4, 16, 24) == (3, 6)   # 64 / 24: 3 chunks of 6 positions, the last with 2 of padding
    assert loss_chunks(4, 16, 4096) == (1, 16)
    assert loss_chunks(4, 16, 1) == (16, 1)   # at least one position of every row per chunk


def test_dense_chunks_train_as_whole():
    """Chunks of 24 tokens: the 16 positions do not divide into 3 chunks, the last has 2 of padding."""
    assert_same_training(_record(DENSE + ("model.loss_chunk_tokens=24",)), _record(DENSE))


def test_moe_chunks_train_as_whole():
    """configs/tiny_moe.yaml (router aux and z losses through forward_with_stats' path) on the tiny shape."""
    chunked = _record(DENSE + ("model.loss_chunk_tokens=24",), preset="tiny_moe")
    assert_same_training(chunked, _record(DENSE, preset="tiny_moe"))


def test_vocab_sharded_chunks_train_as_one_device():
    """tensor 2 x fsdp 2 on 4 devices (the head split over vocab, gathered over fsdp once per micro batch), tied
    embeddings, against one device without chunks. Chunks are per device: 12 tokens per FSDP rank take 24 of
    the micro batch's 64 (3 chunks of 6 positions, 2 of them padding)."""
    tie = ("model.tie_embeddings=true",)
    chunked = _record(DENSE + tie + MESH + ("model.loss_chunk_tokens=12",), devices=4)
    assert_same_training(chunked, _record(DENSE + tie))


def test_pipeline_chunks_train_as_one_device():
    """stage 2 x tensor 2: the last stage applies the head a chunk at a time (two micro batches of 4 rows)."""
    pipe = ("parallel.stage=2", "parallel.tensor=2", "parallel.data=1", "model.loss_chunk_tokens=24")
    assert_same_training(_record(DENSE + pipe, devices=4), _record(DENSE))


def test_chunks_need_less_temp_memory():
    """A shape where the logits dominate (vocab 8192, 512 positions, width 64): the compiled train step's
    temporary memory with chunks of 128 tokens against the whole micro batch's [2, 512, 8192] fp32 logits."""
    def temp_bytes(chunk_tokens):
        cfg = tiny_config("model.vocab_size=8192", "data.seq_len=512", "train.global_batch_size=2",
                          "model.num_layers=1", f"model.loss_chunk_tokens={chunk_tokens}")
        program = build_program(cfg, jax.devices()[:1])
        return program.lower_train_step().compile().memory_analysis().temp_size_in_bytes

    whole, chunked = temp_bytes(0), temp_bytes(128)
    print(f"train step temp memory: whole {whole / 2**20:.1f} MiB, chunks of 128 tokens {chunked / 2**20:.1f} MiB")
    logits = 2 * 512 * 8192 * 4
    assert chunked < whole - logits, (whole, chunked)


def test_negative_chunk_is_refused():
    with pytest.raises(ConfigError, match=r"^model\.loss_chunk_tokens: must be >= 0"):
        tiny_config("model.loss_chunk_tokens=-1")


def test_custom_loss_with_chunks_is_refused():
    """A custom loss_fn computes its own logits: the field would be silently ignored, so it is refused."""
    cfg = tiny_config("model.loss_chunk_tokens=16")
    with pytest.raises(ConfigError, match=r"^model\.loss_chunk_tokens: chunks the built-in loss only"):
        build_program(cfg, jax.devices()[:1], loss_fn=lambda model, batch: (0.0, None))
