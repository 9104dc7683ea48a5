"""``python -m shardfn.show plan.json [-o page.html]``: a plan saved with ``plan.to_json()`` as its HTML page
(shardfn.show.plan_page), to open in any browser, offline. A file that is not a plan, or a plan of another format,
is refused with the file's name and exit status 1."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .plan_page import write_page
from ..strategy_search.plan import Plan

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardfn.show",
                                     description="Write a saved shardfn plan (plan.to_json()) as one HTML page.")
    parser.add_argument("plan", help="the plan's JSON file")
    parser.add_argument("-o", "--out", help="the page to write (default: the plan's file name with .html)")
    args = parser.parse_args(argv)
    try:
        plan = Plan.load(args.plan)
    except (OSError, ValueError) as e:
        print(f"python -m shardfn.show: {e}", file=sys.stderr)
        return 1
    out = args.out or str(Path(args.plan).with_suffix(".html"))
    write_page(plan, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
