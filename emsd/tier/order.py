"""LinkedOrder: ids kept in use order, in lists, without a Python object per id.

The disk tier's least-recently-used orders (one of every block, one per tenant)
as intrusive doubly linked lists over small integer ids: a ``prev`` and a
``next`` link and the list an id is on, each a machine integer in an
``array.array``, so that an id costs 12 bytes here whatever the count (an
``OrderedDict`` of the same keys costs about 105 bytes a key, plus the key).
Every step is O(1): ``push`` (newest), ``remove``, ``touch`` (newest again;
``touch_many`` of a batch in one loop over the links, at about a third of a
microsecond an id);
``oldest`` walks a list oldest first and may be walked while the ids it
yields are removed. ``extend`` appends many ids at once with numpy (a
restart's re-index).

An id is on at most one list of an order. Lists are named by small ints.
Not thread-safe: the caller holds its lock.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import numpy as np

NONE = -1  # no id: the end of a list, or an id on no list


class LinkedOrder:
    """Ids (>= 0) on lists named by ints, each list oldest first."""

    def __init__(self) -> None:
        self._prev = array("i")
        self._next = array("i")
        self._on = array("i")  # the list each id is on, NONE if none
        self._head: dict[int, int] = {}  # list -> its oldest id
        self._tail: dict[int, int] = {}  # list -> its newest id
        self._len: dict[int, int] = {}

    def __contains__(self, i: int) -> bool:
        return 0 <= i < len(self._on) and self._on[i] != NONE

    def size(self, lst: int) -> int:
        """How many ids list ``lst`` holds."""
        return self._len.get(lst, 0)

    def list_of(self, i: int) -> int:
        """The list ``i`` is on, ``NONE`` if none."""
        return self._on[i] if 0 <= i < len(self._on) else NONE

    def _fit(self, n: int) -> None:
        """Room for ids below ``n``."""
        more = n - len(self._on)
        if more > 0:
            fill = array("i", [NONE]) * more
            self._prev.extend(fill)
            self._next.extend(fill)
            self._on.extend(fill)

    def push(self, lst: int, i: int) -> None:
        """Put id ``i`` (on no list) on list ``lst`` as its newest."""
        self._fit(i + 1)
        if self._on[i] != NONE:
            raise ValueError(f"id {i} is on list {self._on[i]} already")
        tail = self._tail.get(lst, NONE)
        self._prev[i], self._next[i], self._on[i] = tail, NONE, lst
        if tail == NONE:
            self._head[lst] = i
        else:
            self._next[tail] = i
        self._tail[lst] = i
        self._len[lst] = self._len.get(lst, 0) + 1

    def remove(self, i: int) -> None:
        """Take id ``i`` off its list (``ValueError`` if it is on none)."""
        lst = self.list_of(i)
        if lst == NONE:
            raise ValueError(f"id {i} is on no list")
        p, n = self._prev[i], self._next[i]
        if p == NONE:
            self._head[lst] = n
        else:
            self._next[p] = n
        if n == NONE:
            self._tail[lst] = p
        else:
            self._prev[n] = p
        self._prev[i] = self._next[i] = self._on[i] = NONE
        left = self._len[lst] - 1
        if left:
            self._len[lst] = left
        else:
            del self._len[lst], self._head[lst], self._tail[lst]

    def touch(self, i: int) -> None:
        """Make id ``i`` the newest of its list."""
        lst = self.list_of(i)
        if self._tail.get(lst) != i:
            self.remove(i)
            self.push(lst, i)

    def touch_many(self, ids: np.ndarray) -> None:
        """``touch`` of each id in turn (each on a list; repeats allowed), in one loop over
        the links: what a load's promotions and demotions do to many ids at once. An id on
        no list raises ``ValueError``, after the ids before it were touched."""
        prev, nxt, on, tail = self._prev, self._next, self._on, self._tail
        for i in np.asarray(ids, dtype=np.int64).tolist():
            lst = on[i] if 0 <= i < len(on) else NONE
            if lst == NONE:
                raise ValueError(f"id {i} is on no list")
            last = tail[lst]
            if last == i:
                continue
            p, n = prev[i], nxt[i]  # n is an id: i is not the newest
            if p == NONE:
                self._head[lst] = n
            else:
                nxt[p] = n
            prev[n] = p
            prev[i], nxt[i], nxt[last] = last, NONE, i
            tail[lst] = i

    def first(self, lst: int) -> int:
        """The oldest id of list ``lst``, ``NONE`` if it is empty."""
        return self._head.get(lst, NONE)

    def oldest(self, lst: int) -> Iterator[int]:
        """The ids of list ``lst``, oldest first. The id just yielded may be removed or
        touched before the next is asked for (the next is read before yielding); other
        changes to the list during the walk are not allowed."""
        i = self._head.get(lst, NONE)
        while i != NONE:
            nxt = self._next[i]
            yield i
            i = nxt

    def extend(self, lst: int, ids: np.ndarray) -> None:
        """Append distinct ids, none on a list, to list ``lst`` in order (its newest last)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            return
        self._fit(int(ids.max()) + 1)
        prev = np.frombuffer(self._prev, dtype=np.int32)  # views: no resize while they live
        nxt = np.frombuffer(self._next, dtype=np.int32)
        on = np.frombuffer(self._on, dtype=np.int32)
        if ids.min() < 0 or (on[ids] != NONE).any() or np.bincount(ids).max() > 1:
            del prev, nxt, on
            raise ValueError("extend of an id that is on a list, or of an id twice")
        tail = self._tail.get(lst, NONE)
        prev[ids[1:]] = ids[:-1]
        prev[ids[0]] = tail
        nxt[ids[:-1]] = ids[1:]
        nxt[ids[-1]] = NONE
        on[ids] = lst
        first, last = int(ids[0]), int(ids[-1])
        del prev, nxt, on
        if tail == NONE:
            self._head[lst] = first
        else:
            self._next[tail] = first
        self._tail[lst] = last
        self._len[lst] = self._len.get(lst, 0) + int(ids.size)

    def nbytes(self) -> int:
        """Bytes held by the link arrays."""
        return sum(a.itemsize * len(a) for a in (self._prev, self._next, self._on))
