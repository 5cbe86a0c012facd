"""A plain-Python ARC with EvoSpec's additions: the reference for specjax.vocab.arc.

Lists are ``OrderedDict``s in LRU -> MRU order, the textbook formulation (Megiddo &
Modha, 2003, figure 4), plus the minimum residency, the warm-up and the per-event
insertion cap that specjax.vocab.arc documents. Nothing here is shared with the array
version: the two are compared on random traces.
"""

from __future__ import annotations

from collections import OrderedDict


class ArcReference:
    def __init__(self, capacity: int, ghost: int, p_init: int, warmup: int,
                 min_residency: int, max_insert: int):
        self.c, self.g = capacity, ghost
        self.p = p_init
        self.warmup, self.min_res, self.max_insert = warmup, min_residency, max_insert
        self.t1: OrderedDict[int, int] = OrderedDict()  # id -> step it became resident
        self.t2: OrderedDict[int, int] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.events = self.insertions = self.evictions = 0

    # ----------------------------------------------------------------- helpers
    def _evictable(self, lst: OrderedDict, step: int) -> int | None:
        """The least recent id of ``lst`` resident for at least min_res steps."""
        for x, since in lst.items():
            if step - since >= self.min_res:
                return x
        return None

    def _ghost(self, lst: OrderedDict, x: int) -> None:
        if len(lst) >= self.g:
            lst.popitem(last=False)
        lst[x] = None

    def _replace(self, in_b2: bool, step: int) -> bool:
        e1, e2 = self._evictable(self.t1, step), self._evictable(self.t2, step)
        n1 = len(self.t1)
        prefer_t1 = n1 >= 1 and ((in_b2 and n1 == self.p) or n1 > self.p)
        if e1 is None and e2 is None:
            return False
        from_t1 = (e1 is not None) if prefer_t1 else (e2 is None)
        if from_t1:
            del self.t1[e1]
            self._ghost(self.b1, e1)
        else:
            del self.t2[e2]
            self._ghost(self.b2, e2)
        self.evictions += 1
        return True

    # ----------------------------------------------------------------- API
    def resident(self) -> set[int]:
        return set(self.t1) | set(self.t2)

    def touch(self, tokens: list[int]) -> None:
        """Hits for committed tokens, in order."""
        for x in tokens:
            if x in self.t1:
                since = self.t1.pop(x)
                self.t2[x] = since
            elif x in self.t2:
                self.t2.move_to_end(x)

    def event(self, candidates: list[int], step: int) -> None:
        self.events += 1
        inserted = 0
        for x in candidates:
            if x in self.t1 or x in self.t2:
                self.touch([x])
                continue
            if inserted >= self.max_insert:
                continue
            if self._request_miss(x, step):
                inserted += 1
                self.insertions += 1

    def _request_miss(self, x: int, step: int) -> bool:
        """Insert a non-resident ``x``; all-or-nothing (False leaves the state unchanged)."""
        saved = (self.t1.copy(), self.t2.copy(), self.b1.copy(), self.b2.copy(), self.p,
                 self.evictions)
        adapt = self.events > self.warmup
        c = self.c
        full = len(self.t1) + len(self.t2) >= c
        if x in self.b1:
            if adapt:
                self.p = min(c, self.p + max(1, len(self.b2) // max(len(self.b1), 1)))
            del self.b1[x]
            ok = self._replace(False, step) if full else True
            target = self.t2
        elif x in self.b2:
            if adapt:
                self.p = max(0, self.p - max(1, len(self.b1) // max(len(self.b2), 1)))
            del self.b2[x]
            ok = self._replace(True, step) if full else True
            target = self.t2
        else:
            target = self.t1
            if len(self.t1) + len(self.b1) >= c:
                if len(self.t1) < c:
                    if self.b1:
                        self.b1.popitem(last=False)
                    ok = self._replace(False, step) if full else True
                else:
                    victim = self._evictable(self.t1, step)
                    ok = victim is not None
                    if ok:
                        del self.t1[victim]
                        self.evictions += 1
            else:
                total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
                if total >= 2 * c and self.b2:
                    self.b2.popitem(last=False)
                ok = self._replace(False, step) if full else True
        if not ok:
            self.t1, self.t2, self.b1, self.b2, self.p, self.evictions = saved
            return False
        target[x] = step
        return True
