"""Pure load planning: who reads replicated tensors, and how reads coalesce."""
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp.deepspeed.loading.readers import assign_readers
from ucp.format.byte_ranges import ByteRange, coalesce


def test_readers_balance_bytes_and_agree_across_ranks():
    sizes = {("emb", "fp32"): 100, ("a", "fp32"): 60, ("b", "fp32"): 50, ("c", "fp32"): 10}
    owners = assign_readers(sizes, [4, 5])
    assert owners == assign_readers(dict(reversed(list(sizes.items()))), [4, 5])  # order-independent
    load = {r: sum(s for k, s in sizes.items() if owners[k] == r) for r in (4, 5)}
    assert sorted(load.values()) == [110, 110]


def test_readers_account_for_what_ranks_already_read():
    owners = assign_readers({("x", "fp32"): 10, ("y", "fp32"): 10}, [0, 1], preload={0: 1000})
    assert set(owners.values()) == {1}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=30), st.integers(1, 6))
def test_lpt_is_within_the_largest_item_of_perfect_balance(sizes, n):
    keys = {(str(i), "s"): s for i, s in enumerate(sizes)}
    owners = assign_readers(keys, list(range(n)))
    loads = [sum(s for k, s in keys.items() if owners[k] == r) for r in range(n)]
    assert max(loads) <= sum(sizes) / n + max(sizes)


def test_coalesce_merges_touching_ranges_per_file_only():
    parts = [ByteRange("a", 0, 10), ByteRange("a", 10, 30), ByteRange("a", 40, 50), ByteRange("b", 30, 40)]
    merged = coalesce(reversed(parts))
    assert [m for m, _ in merged] == [ByteRange("a", 0, 30), ByteRange("a", 40, 50), ByteRange("b", 30, 40)]
    assert merged[0][1] == parts[:2]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 20)), min_size=1, max_size=25))
def test_coalesced_reads_cover_exactly_the_requested_bytes(spans):
    ranges = {ByteRange("f", b, b + n) for b, n in spans}
    merged = coalesce(ranges)
    covered = {i for m, _ in merged for i in range(m.begin, m.end)}
    assert covered == {i for r in ranges for i in range(r.begin, r.end)}
    for m, parts in merged:
        assert all(m.begin <= p.begin and p.end <= m.end for p in parts)
    assert sorted((p.begin, p.end) for _, parts in merged for p in parts) == sorted((r.begin, r.end) for r in ranges)
    assert len(merged) <= len(ranges)
    for (a, _), (b, _) in zip(merged, merged[1:]):
        assert a.end < b.begin  # merged reads never touch: they would have been one read
