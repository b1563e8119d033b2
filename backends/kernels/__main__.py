"""``python -m backends.kernels [KIND ...]``: build the native CPU kernels of
every CPU kind this machine can compile (or the kinds named) into the kernel
cache (``$BATON_KERNEL_CACHE``), e.g. at image build time, so that a runtime
without a C compiler loads them. Prints one line per library."""

from __future__ import annotations

import logging
import sys

from backends.kernels import build, cache_dir


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        built = build(argv or None)
    except (RuntimeError, KeyError) as exc:
        print(f"baton kernels: {exc}", file=sys.stderr)
        return 1
    for kind, path in built.items():
        print(f"{kind}: {path}")
    print(f"in {cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
