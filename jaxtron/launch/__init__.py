"""Operations: the supervisor that restarts (and shrinks) a failed run, and the Kubernetes JobSet launch.

``python -m jaxtron.launch [options] -- [python -m jaxtron.train arguments]`` runs this node's training
processes under :class:`~jaxtron.launch.supervisor.Supervisor`; ``python -m jaxtron.launch k8s ...`` writes a
JobSet manifest (:mod:`jaxtron.launch.k8s`). docs/operations.md tells the whole story.
"""
