"""``python -m sample_models [--check] [NAME ...]``: rewrite (or verify) the committed models."""

from __future__ import annotations

import argparse
import sys

from . import SAMPLES, stale_samples, write_samples


def main(argv: list[str] | None = None) -> int:
    """Write the sample files, or with ``--check`` exit 1 if any is stale."""
    parser = argparse.ArgumentParser(prog="python -m sample_models", description=__doc__)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"samples to write (default: all of {', '.join(SAMPLES)})")
    parser.add_argument("--check", action="store_true",
                        help="only verify that the committed files match the generators")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in SAMPLES]
    if unknown:
        parser.error(f"unknown sample(s) {', '.join(unknown)}; known: {', '.join(SAMPLES)}")
    if args.check:
        stale = [n for n in stale_samples() if not args.names or n in args.names]
        for name in stale:
            print(f"stale: {SAMPLES[name].path}")
        return 1 if stale else 0
    for path, size in write_samples(args.names or None):
        print(f"wrote {path} ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
