"""The tests a cut-off pytest run did not reach: the node ids of a ``pytest --collect-only -q``
listing that have no outcome in a ``pytest -v`` log (xdist's ``[gw3] [ 12%] PASSED <id>`` lines
or a serial run's ``<id> PASSED [ 12%]``). tests/gpu_call.sh writes them to its logs so that the
next call on the same machine (``REST=1``) runs exactly those.

Usage: python tests/unreached.py COLLECTED PYTEST_LOG > unrun.txt   (counts on stderr)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

OUTCOMES = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
_XDIST = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] (?:{OUTCOMES}) (.+?)\s*$")
_SERIAL = re.compile(rf"^(\S.*?::.*?) (?:{OUTCOMES})(?: \(.*\))?\s+\[\s*\d+%\]\s*$")


def collected(text: str) -> list[str]:
    """Node ids of a ``--collect-only -q`` listing, in its order (its summary lines left out)."""
    ids = [line.strip() for line in text.splitlines() if "::" in line and not line.startswith(" ")]
    return list(dict.fromkeys(ids))  # a warnings summary may name one again


def reached(log: str) -> set[str]:
    """Node ids with an outcome in a ``pytest -v`` log."""
    done = set()
    for line in log.splitlines():
        m = _XDIST.match(line) or _SERIAL.match(line)
        if m:
            done.add(m.group(1))
    return done


def unreached(collected_text: str, log: str) -> list[str]:
    done = reached(log)
    return [t for t in collected(collected_text) if t not in done]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    listing = Path(argv[0]).read_text()
    left = unreached(listing, Path(argv[1]).read_text())
    for t in left:
        print(t)
    print(f"{len(left)} of {len(collected(listing))} collected tests not reached", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
