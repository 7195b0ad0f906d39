"""Is the cluster window's barrier protocol sound? (`docs/patches/wide_cluster_window.diff`,
`ClusterWindow`; the probe `wgmma_rates clusters`' window form.) An event model on the CPU:
`blocks` blocks, each a ring of `stages` stages with a producer and a consumer; the consumer
releases each use, and after every `mile`-th one sends one arrival to milestone barrier m % `miles`
of every block, one after the other (one lane), each delivered after a random delay of up to
`delay` tiles; a producer issues use u once its stage is free and, where u - window + 1 is a
positive multiple of `mile`, once milestone (u - window + 1) / mile - 1 is complete in its own
block, read by parity as the kernel reads it. Checked: every arrival lands in its milestone's
phase (none counted in the phase `miles` milestones before), every parity wait reads the phase
it means, no deadlock, and every milestone complete at the end (the producer's drain). Consumers
take 1 to 1 + jitter x rank tiles a tile, so blocks drift.

    python bench/probes/cluster_window_model.py [--window 4] [--mile 2] [--miles 8]

Prints, for each delay, the runs of 150 seeds that broke a check (0: none). With window 4 and
mile 2, milestone barriers from 4 on held under every delay tried; 2 and 3 broke from delays of 3
tiles (an arrival counted a phase early).
"""

from __future__ import annotations

import argparse
import heapq
import random


def run(window: int, mile: int, miles: int, uses: int, seed: int, delay: float, blocks: int = 4,
        stages: int = 2, jitter: float = 0.3) -> None:  # fmt: skip
    """One run; raises AssertionError where a check breaks."""
    rng = random.Random(seed)
    phase = [[0] * miles for _ in range(blocks)]  # completed phases of each milestone barrier
    count = [[0] * miles for _ in range(blocks)]  # arrivals in the current phase
    released = [-1] * blocks  # the last use each block's consumer released
    issued = [0] * blocks  # the next use each producer issues
    landed: list[set[int]] = [set() for _ in range(blocks)]
    taken = [0] * blocks  # the next use each consumer takes
    free_at = [0.0] * blocks
    events: list[tuple[float, int, str, tuple[int, int]]] = []
    order = 0

    def push(at: float, kind: str, block: int, n: int) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (at, order, kind, (block, n)))

    def arrive(block: int, m: int) -> None:
        bar = m % miles
        assert phase[block][bar] == m // miles, f"milestone {m}'s arrival in phase {phase[block][bar]}"
        count[block][bar] += 1
        if count[block][bar] == blocks:
            count[block][bar] = 0
            phase[block][bar] += 1

    def paced(block: int, use: int) -> bool:
        m = use - window + 1
        if m <= 0 or m % mile:
            return True
        j = m // mile - 1
        done = (phase[block][j % miles] & 1) != ((j // miles) & 1)  # try_wait.parity
        assert not done or phase[block][j % miles] == j // miles + 1, f"milestone {j} read a phase off"
        return done

    def produce(block: int, now: float) -> None:
        while issued[block] < uses:
            use = issued[block]
            if use >= stages and released[block] < use - stages or not paced(block, use):
                return
            issued[block] += 1
            push(now + 1.0 + 0.5 * rng.random(), "land", block, use)

    def consume(block: int, now: float) -> None:
        use = taken[block]
        if use < uses and use in landed[block] and free_at[block] <= now:
            free_at[block] = now + 1.0 + jitter * block * rng.random()
            push(free_at[block], "release", block, use)
            taken[block] += 1

    for b in range(blocks):
        produce(b, 0.0)
    while events:
        now, _, kind, (block, n) = heapq.heappop(events)
        if kind == "land":
            landed[block].add(n)
        elif kind == "release":
            released[block] = n
            if n % mile == mile - 1:
                at = now
                for dst in range(blocks):  # one lane, one block after the other
                    at += delay * rng.random()
                    push(at, "arrive", dst, n // mile)
        else:
            arrive(block, n)
        for b in range(blocks):
            produce(b, now)
            consume(b, now)
    assert taken == [uses] * blocks, f"deadlock: taken {taken}, issued {issued}"
    for b in range(blocks):  # the drain: every milestone reached is complete everywhere
        for m in range(uses // mile):
            assert phase[b][m % miles] >= m // miles + 1, f"block {b}: milestone {m} incomplete"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--mile", type=int, default=2)
    ap.add_argument("--miles", type=int, default=8)
    args = ap.parse_args()
    for delay in (0.0, 1.0, 3.0, 30.0):
        broken = 0
        for seed in range(150):
            for uses in (1, 5, 120):
                try:
                    run(args.window, args.mile, args.miles, uses, seed, delay)
                except AssertionError:
                    broken += 1
                    break
        print(f"window {args.window}, mile {args.mile}, {args.miles} barriers, delays up to {delay} tiles: "
              f"{broken} of 150 seeds broke a check")  # fmt: skip


if __name__ == "__main__":
    main()
