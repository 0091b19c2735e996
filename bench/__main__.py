"""Run every benchmark module in this package (or the ones named on the command line).

Each module exposes `main() -> None`, measures a raw baseline in the same run,
and prints its figures and ratios.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def main() -> None:
    available = sorted(
        info.name
        for info in pkgutil.iter_modules([str(Path(__file__).parent)])
        if not info.name.startswith("_")
    )
    selected = sys.argv[1:] or available
    unknown = sorted(set(selected) - set(available))
    if unknown:
        sys.exit(f"unknown benchmark(s): {', '.join(unknown)}; available: {', '.join(available)}")
    for name in selected:
        print(f"\n=== bench.{name} ===", flush=True)
        importlib.import_module(f"bench.{name}").main()


if __name__ == "__main__":
    main()
