"""``python -m jaxtron.checkpoint verify DIR``: check checkpoints without restoring them into JAX.

DIR is a checkpoint directory (every ``<step>`` in it) or one step directory. Every item a resume reads must
be there (params, opt_state, meta; a weights-only step, such as an imported model, is said to load only as
weights), Orbax's step metadata and the JSON meta must parse, and every shard file is checked against its index
(present, the right size, the right checksum). Exit status 0: all good (checkpoints written before checksums
existed are size-checked, and said to have none); 1: one line per bad file on stderr; 2: usage errors.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxtron.checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="check that a step has every item and its shard files match their index")
    v.add_argument("dir", help="a checkpoint directory or one step directory of it")
    v.add_argument("--threads", type=int, default=4, help="files checked at once (default 4)")
    args = p.parse_args(argv)

    from jaxtron.checkpoint.integrity import verify_path  # pure file I/O: nothing is loaded into JAX

    problems, notes = verify_path(args.dir, args.threads)
    for note in notes:
        print(f"note: {note}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"ok: {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
