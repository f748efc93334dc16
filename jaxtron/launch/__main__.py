"""``python -m jaxtron.launch [options] -- [train arguments]`` and ``python -m jaxtron.launch k8s [options]``."""

from __future__ import annotations

import argparse
import os
import sys

from jaxtron import config as config_lib
from jaxtron.parallel import kubernetes


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value and value.isdigit() else default


def supervise(argv: list) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxtron.launch", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run this node's jaxtron.train processes; on a failure anywhere, restart the job from the "
                    "newest verified checkpoint (and, with --min-processes, on fewer processes).",
        epilog="Everything after -- goes to python -m jaxtron.train. Multi-node: one supervisor per node with "
               "--nodes, --node-rank and --coordinator; in a Kubernetes JobSet pod they come from its environment "
               "(python -m jaxtron.launch k8s writes the manifest; docs/operations.md).")
    p.add_argument("--processes", type=_positive, default=1, help="processes on this node (default 1)")
    p.add_argument("--cpu-devices", type=_positive, default=None,
                   help="virtual CPU devices per process: a local multi-process run on the CPU")
    p.add_argument("--gpus-per-process", type=_positive, default=None,
                   help="GPUs per process when a node runs several: slot i sees GPUs i*G..(i+1)*G-1 "
                        "(CUDA_VISIBLE_DEVICES; default: every process sees all, as with one process per node)")
    p.add_argument("--min-processes", type=_positive, default=None,
                   help="after a process is lost (a SIGKILL the supervisor did not send), restart "
                        "on the processes left, down to this many, re-laying the mesh (default: never shrink)")
    p.add_argument("--max-restarts", type=int, default=3, help="restart budget (default 3)")
    p.add_argument("--backoff", type=_non_negative, default=5.0,
                   help="seconds before the first restart, doubling with each (default 5)")
    p.add_argument("--max-backoff", type=_non_negative, default=300.0, help="longest wait (default 300)")
    p.add_argument("--grace", type=_non_negative, default=30.0,
                   help="when the supervisor is stopped (SIGTERM/SIGINT): seconds from passing SIGTERM on to the "
                        "processes (they save a checkpoint) to SIGKILL (default 30)")
    p.add_argument("--nodes", type=_positive, default=_env_int("JAXTRON_NODES", 1),
                   help="supervisors in the job, one per node (env JAXTRON_NODES; default 1)")
    p.add_argument("--node-rank", type=int, default=_env_int("JAXTRON_NODE_RANK", 0),
                   help="this node's index, 0..nodes-1 (env JAXTRON_NODE_RANK)")
    p.add_argument("--coordinator", default=os.environ.get("JAXTRON_LAUNCH_COORDINATOR"),
                   help="host:port of node 0 for a multi-node job; attempt k uses port + k "
                        "(env JAXTRON_LAUNCH_COORDINATOR)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then python -m jaxtron.train arguments")
    args = p.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args

    def bad(message: str) -> int:
        print(f"error: launch: {message}", file=sys.stderr)
        return 2

    in_pod = kubernetes.detected() and args.coordinator is None
    if in_pod:  # a JobSet pod: its place from its annotations
        try:
            pod = kubernetes.pod()
        except config_lib.ConfigError as err:
            return bad(str(err))
        args.nodes, args.node_rank, args.coordinator = pod.num_pods, pod.pod_rank, pod.coordinator
    if not 0 <= args.node_rank < args.nodes:
        return bad(f"--node-rank {args.node_rank} is not in 0..{args.nodes - 1}")
    if args.nodes > 1 and not args.coordinator:
        return bad("--nodes > 1 needs --coordinator host:port (node 0's address)")
    if args.coordinator and not args.coordinator.rsplit(":", 1)[-1].isdigit():
        return bad(f"--coordinator: expected host:port, got {args.coordinator!r}")
    if args.min_processes is not None and args.min_processes > args.processes:
        return bad(f"--min-processes {args.min_processes} is more than --processes {args.processes}")
    if args.min_processes is not None and args.min_processes < args.processes and args.nodes > 1:
        return bad("--min-processes below --processes needs a single supervisor for the whole run (--nodes 1): "
                   "a multi-node job restarts at full size (docs/operations.md)")
    if args.max_restarts < 0:
        return bad(f"--max-restarts must be >= 0, got {args.max_restarts}")

    targs = argparse.ArgumentParser(add_help=False)
    targs.add_argument("--config", default=None)
    targs.add_argument("overrides", nargs="*")
    try:
        parsed, _ = targs.parse_known_intermixed_args(train_args)
        cfg = config_lib.load(parsed.config, parsed.overrides)
        from jaxtron.jax_startup import import_jax
        import_jax()  # quiet on a machine without a GPU; the supervisor itself never touches a device
        from jaxtron.parallel import elastic
        from jaxtron.launch.supervisor import Options, Supervisor
        per = args.cpu_devices or args.gpus_per_process
        if per:  # the layout must fit the devices the processes will have
            elastic.current(cfg, per * args.processes * args.nodes)
    except config_lib.ConfigError as err:
        return bad(str(err))
    opts = Options(processes=args.processes, cpu_devices=args.cpu_devices, gpus_per_process=args.gpus_per_process,
                   min_processes=args.min_processes,
                   max_restarts=args.max_restarts, backoff_s=args.backoff, max_backoff_s=args.max_backoff,
                   grace_s=args.grace, nodes=args.nodes, node_rank=args.node_rank, coordinator=args.coordinator,
                   kubernetes=in_pod,
                   module=os.environ.get("JAXTRON_LAUNCH_MODULE", "jaxtron.train"))
    return Supervisor(cfg, train_args, opts).run()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["k8s"]:
        from jaxtron.launch.k8s import main as k8s_main
        return k8s_main(argv[1:])
    return supervise(argv)


if __name__ == "__main__":
    sys.exit(main())
