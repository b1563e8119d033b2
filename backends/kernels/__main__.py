"""``python -m backends.kernels``: build the native CPU kernels (one library
holding every CPU kind this machine's compiler targets) into the kernel cache
(``$BATON_KERNEL_CACHE``), e.g. at image build time, so that a runtime
without compilers loads them. Prints the library's path and its kinds."""

from __future__ import annotations

import logging
import sys

from backends.kernels import _kinds_built, build


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if argv:
        print("usage: python -m backends.kernels (every CPU kind is built into one library)",
              file=sys.stderr)
        return 2
    try:
        path = build()
    except RuntimeError as exc:
        print(f"baton kernels: {exc}", file=sys.stderr)
        return 1
    print(f"{', '.join(_kinds_built())}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
