"""Free chips per node, and where a gang goes (packing).

``FreeMap`` keeps every node in a bucket by its free chip count, so "do N nodes have C free"
costs O(chips per node) and best fit is a bucket lookup, whatever the pool's size: a policy
asks these questions thousands of times per simulated day.
"""

from __future__ import annotations

from collections.abc import Sequence


class FreeMap:
    """Free chips per node (mutable; a decision works on its own copy)."""

    __slots__ = ("free", "buckets", "total")

    def __init__(self, free: Sequence[int], top: int) -> None:
        self.free = list(free)
        self.buckets: list[set[int]] = [set() for _ in range(top + 1)]
        for i, f in enumerate(self.free):
            self.buckets[f].add(i)
        self.total = sum(self.free)

    def copy(self) -> FreeMap:
        new = FreeMap.__new__(FreeMap)
        new.free = self.free.copy()
        new.buckets = [b.copy() for b in self.buckets]
        new.total = self.total
        return new

    def count(self, chips: int) -> int:
        """Nodes with at least ``chips`` free."""
        return sum(len(b) for b in self.buckets[chips:])

    def fits(self, nodes: int, chips: int) -> bool:
        found = 0
        for b in self.buckets[chips:]:
            found += len(b)
            if found >= nodes:
                return True
        return False

    def set(self, node: int, free: int) -> None:
        old = self.free[node]
        assert 0 <= free < len(self.buckets), (node, free)
        self.buckets[old].discard(node)
        self.buckets[free].add(node)
        self.free[node] = free
        self.total += free - old

    def take(self, placement: Sequence[int], chips: int) -> None:
        for i in placement:
            self.set(i, self.free[i] - chips)

    def give(self, placement: Sequence[int], chips: int) -> None:
        for i in placement:
            self.set(i, self.free[i] + chips)


def place(free: FreeMap, nodes: int, chips: int, racks: Sequence[str | None] | None = None) -> tuple[int, ...] | None:
    """Where a gang of ``nodes`` × ``chips`` goes now, or None if it does not fit.

    Exactly ``nodes`` distinct nodes (a gang is never split further). Best fit: the nodes
    with the fewest free chips that still hold ``chips`` (partly used nodes first, so whole
    nodes stay free for big gangs); ties go to the lower index. With racks, a gang that fits
    in one rack goes to the rack where it leaves the fewest chips free; otherwise it spans
    the fewest racks (the racks with the most candidate nodes first).
    """
    if not free.fits(nodes, chips):
        return None
    top = len(free.buckets)
    if nodes == 1:
        for v in range(chips, top):
            if free.buckets[v]:
                return (min(free.buckets[v]),)
    best = [(v, i) for v in range(chips, top) for i in sorted(free.buckets[v])]
    if racks is None:
        return tuple(sorted(i for _, i in best[:nodes]))
    by_rack: dict[object, list[tuple[int, int]]] = {}
    for v, i in best:
        # A node without a rack label shares a rack with no other node.
        by_rack.setdefault(racks[i] if racks[i] is not None else ("node", i), []).append((v, i))
    whole = [
        (sum(v for v, _ in members[:nodes]), members[0][1], key)
        for key, members in by_rack.items()
        if len(members) >= nodes
    ]
    if whole:
        _, _, key = min(whole)
        return tuple(sorted(i for _, i in by_rack[key][:nodes]))
    chosen: list[int] = []
    for members in sorted(by_rack.values(), key=lambda m: (-len(m), sum(v for v, _ in m), m[0][1])):
        chosen.extend(i for _, i in members[: nodes - len(chosen)])
        if len(chosen) == nodes:
            break
    return tuple(sorted(chosen))
