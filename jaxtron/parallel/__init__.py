"""The only package that knows the device mesh: mesh building, the logical-axis rules, sharding helpers."""

from jaxtron.parallel.mesh import build_mesh
from jaxtron.parallel.rules import logical_rules
from jaxtron.parallel.sharding import constrain, logical_to_sharding, use_rules

__all__ = ["build_mesh", "logical_rules", "constrain", "logical_to_sharding", "use_rules"]
