"""`python -m remote_worker run SPEC.json`: run one experiment, writing events.jsonl beside the spec."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from remote_worker import stop_signal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remote_worker")
    commands = parser.add_subparsers(dest="command", required=True)
    run_cmd = commands.add_parser("run", help="run the experiment described by a spec file")
    run_cmd.add_argument("spec", type=Path, help="path to spec.json; events go to events.jsonl beside it")
    args = parser.parse_args(argv)
    if not args.spec.is_file():
        parser.error(f"spec file {args.spec} does not exist")
    stop_signal.install()
    from remote_worker.runner import run

    return run(args.spec)


if __name__ == "__main__":
    sys.exit(main())
