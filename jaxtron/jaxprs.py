"""Reading jaxprs the same way across the JAX versions jaxtron runs on (jax 0.10 on Python 3.11, newer on 3.12).

Several parts of jaxtron walk the jaxpr of a traced step: which weights the model casts (train/param_cast.py),
which of a stage's VJP residuals depend on the micro batch (parallel/residuals.py), and the stage backward's
split into B and W (parallel/backward_split.py). The one thing they read that changed between versions is how
a ``scan`` equation says which of its operands are loop constants, carries and scanned inputs.
"""

from __future__ import annotations

from typing import Optional


def scan_groups(eqn) -> Optional[tuple[int, int]]:
    """(loop constants, carries) counted among a scan equation's operands, the rest being the scanned inputs:
    older JAX says so in ``num_consts`` and ``num_carry``; newer JAX gives the three groups' structures in
    ``ft_in`` (consts, carry, xs; it may also move a carry the body leaves unchanged into the constants). None
    where neither reads consistently with the equation's operands."""
    p = eqn.params
    if "num_consts" in p:
        return p["num_consts"], p["num_carry"]
    try:  # a jax flat tree of (consts, carry, xs): unpack() gives the three, .vals each one's operands
        consts, carry, xs = (len(list(g.vals)) for g in p["ft_in"].unpack())
    except (KeyError, AttributeError, TypeError, ValueError):
        return None
    return (consts, carry) if consts + carry + xs == len(eqn.invars) else None
