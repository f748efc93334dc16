"""Write docs/config.md from the dataclass field docs in jaxtron/config.py (``--check``: exit 1 if it is stale).

    python scripts/gen_config_reference.py           # regenerate after changing a config field
    python scripts/gen_config_reference.py --check   # what tests/test_docs.py asserts
"""

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from jaxtron.config import reference_markdown  # noqa: E402

OUT = os.path.join(REPO, "docs", "config.md")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 when docs/config.md is stale")
    args = parser.parse_args(argv)
    text = reference_markdown()
    if args.check:
        try:
            with open(OUT) as f:
                current = f.read()
        except OSError:
            current = None
        if current != text:
            print(f"{OUT} is stale: run python scripts/gen_config_reference.py", file=sys.stderr)
            return 1
        return 0
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
