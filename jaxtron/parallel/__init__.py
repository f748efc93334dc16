"""The only package that knows the device mesh: the mesh axes (:mod:`~jaxtron.parallel.axes`), the Layout
(:mod:`~jaxtron.parallel.layout`), mesh building, the logical-axis rules, sharding helpers, and the code that
needs mesh axes by name (pipeline stages, ring/Ulysses attention, expert dispatch). It imports no model code:
what it runs of the model comes in as functions."""
