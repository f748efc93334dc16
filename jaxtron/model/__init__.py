"""Flax NNX Llama-family models. Model code names logical axes only; jaxtron.parallel maps them to a mesh."""

from jaxtron.model.llama import DecoderBlock, Llama

__all__ = ["Llama", "DecoderBlock"]
