"""How an asynchronous save to object storage shares each data file's multipart upload among the ranks
(`ucp.deepspeed.saving.files.plan_parts`, `bytes_to_send`): every part has one uploader, the rank holding most of
its bytes, and a rank sends each of its bytes that lie in another rank's part to that rank, and no others."""
from __future__ import annotations

import random

from ucp.deepspeed.saving.files import SaveFile, bytes_to_send, plan_parts

FILES = [SaveFile("a", b"h" * 10, 100), SaveFile("b", b"h" * 7, 41)]
# Rank 0: bytes [10, 55) of a; rank 1: [55, 100) of a and [7, 20) of b; rank 2: [20, 41) of b.
RUNS = [[("a", 10, 55)], [("a", 55, 100), ("b", 7, 20)], [("b", 20, 41)]]


def test_each_part_goes_to_the_rank_holding_most_of_it():
    parts = plan_parts(FILES, RUNS, 16)
    assert [(p.file, p.number, p.begin, p.end) for p in parts if p.file == "b"] == [
        ("b", 1, 0, 16), ("b", 2, 16, 32), ("b", 3, 32, 41)]
    assert [p.uploader for p in parts] == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2]
    # a part of header bytes only goes to the first rank (every rank writes the headers into its staging copy)
    assert plan_parts([SaveFile("c", b"h" * 40, 40)], [[], [], []], 16)[0].uploader == 0


def test_what_each_rank_sends_fills_exactly_the_bytes_of_others_parts():
    rng = random.Random(5)
    for _ in range(200):
        size, ranks, step = rng.randint(1, 300), rng.randint(1, 5), rng.randint(1, 64)
        cuts = sorted({0, size, *rng.sample(range(size + 1), min(size + 1, rng.randint(0, 8)))})
        runs: list[list[tuple[str, int, int]]] = [[] for _ in range(ranks)]
        for lo, hi in zip(cuts, cuts[1:]):
            runs[rng.randrange(ranks)].append(("f", lo, hi))
        parts = plan_parts([SaveFile("f", b"", size)], runs, step)
        assert [(p.begin, p.end) for p in parts] == [(lo, min(size, lo + step)) for lo in range(0, size, step)]
        owner = [next((r for r, mine in enumerate(runs) for _, lo, hi in mine if lo <= b < hi)) for b in range(size)]
        got = [-1] * size  # which rank's bytes each uploader ends up with
        for p in parts:
            for b in range(p.begin, p.end):
                if owner[b] == p.uploader:
                    got[b] = p.uploader
        for me in range(ranks):
            for uploader, _, lo, hi in bytes_to_send(parts, runs[me], me, step):
                assert uploader != me
                for b in range(lo, hi):
                    assert got[b] == -1 and owner[b] == me  # sent once, and only its own bytes
                    assert parts[b // step].uploader == uploader
                    got[b] = uploader
        assert got == [parts[b // step].uploader for b in range(size)]  # every uploader has its whole parts
