"""``python -m mmha {info,demo,generate,bench}``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd, rest = (argv[0], argv[1:]) if argv else ("info", [])
    if cmd == "info":
        from .info import format_info

        print(format_info())
        return 0
    if cmd == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    if cmd in ("generate", "demo"):
        from .models import generate

        return generate.main([cmd, *rest])
    print(f"usage: python -m mmha {{info,demo,generate,bench}} [options]; unknown command {cmd!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
