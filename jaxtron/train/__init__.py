"""Training: the pure train step, optimizer, loss, metrics and the loop (``python -m jaxtron.train``)."""
