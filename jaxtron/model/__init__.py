"""Flax NNX Llama-family models. Model code names logical axes only; jaxtron.parallel maps them to a mesh.

The model is :class:`jaxtron.model.llama.Llama`; the kernels' one door is :mod:`jaxtron.model.kernels`."""
