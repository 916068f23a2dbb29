"""LinkedOrder (emsd.tier.order): the disk tier's use orders, against OrderedDicts."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.tier.order import NONE, LinkedOrder

IDS = 40
LISTS = 3

_step = st.one_of(
    st.tuples(st.just("push"), st.integers(0, LISTS - 1), st.integers(0, IDS - 1)),
    st.tuples(st.just("remove"), st.just(0), st.integers(0, IDS - 1)),
    st.tuples(st.just("touch"), st.just(0), st.integers(0, IDS - 1)),
    st.tuples(st.just("extend"), st.integers(0, LISTS - 1), st.lists(st.integers(0, IDS - 1), max_size=8)),
    st.tuples(st.just("evict"), st.integers(0, LISTS - 1), st.integers(0, 4)),
    st.tuples(st.just("touch_many"), st.just(0), st.lists(st.integers(0, IDS - 1), max_size=3 * IDS)),
)


def _assert_holds(order: LinkedOrder, model: dict[int, OrderedDict[int, None]]) -> None:
    """Each list of ``order`` holds its OrderedDict's ids in its order, linked both ways."""
    for k, d in model.items():
        assert list(order.oldest(k)) == list(d)
        back = [NONE, *d]  # each id's prev link: the one before it (internal, checked too)
        assert [order._prev[i] for i in d] == back[:-1]
        assert order.size(k) == len(d)
        assert order.first(k) == (next(iter(d)) if d else NONE)


@settings(max_examples=300, deadline=None)
@given(st.lists(_step, max_size=60))
def test_lists_keep_the_order_an_ordered_dict_keeps(steps: list[tuple]) -> None:
    """Any mix of push, remove, touch, touch_many, extend and a walk that removes what it
    yields (an eviction) leaves every list holding the ids an OrderedDict per list holds, in its order;
    what may not be done (a push of an id on a list, a remove of one on none) raises."""
    order, model = LinkedOrder(), {lst: OrderedDict[int, None]() for lst in range(LISTS)}

    def on(i: int) -> int:
        return next((lst for lst, d in model.items() if i in d), NONE)

    for op, lst, arg in steps:
        if op == "push":
            if on(arg) != NONE:
                with pytest.raises(ValueError):
                    order.push(lst, arg)
            else:
                order.push(lst, arg)
                model[lst][arg] = None
        elif op == "remove":
            if on(arg) == NONE:
                with pytest.raises(ValueError):
                    order.remove(arg)
            else:
                order.remove(arg)
                del model[on(arg)][arg]
        elif op == "touch" and on(arg) != NONE:
            order.touch(arg)
            model[on(arg)].move_to_end(arg)
        elif op == "touch_many":
            held = [i for i in arg if on(i) != NONE]
            order.touch_many(np.array(held, dtype=np.int64))
            for i in held:
                model[on(i)].move_to_end(i)
            stray = [i for i in arg if on(i) == NONE]
            for batch in (stray[:1], stray[:1] * 20):  # refused before any touch: nothing changes
                if batch:
                    with pytest.raises(ValueError):
                        order.touch_many(np.array(batch, dtype=np.int64))
        elif op == "extend":
            fresh = list(dict.fromkeys(i for i in arg if on(i) == NONE))
            order.extend(lst, np.array(fresh, dtype=np.int64))
            model[lst].update(dict.fromkeys(fresh))
            if any(on(i) != NONE for i in arg) and arg:
                with pytest.raises(ValueError):
                    order.extend(lst, np.array(arg[:1], dtype=np.int64))
        elif op == "evict":
            walked = []
            for i in order.oldest(lst):
                if len(walked) == arg:
                    break
                walked.append(i)
                order.remove(i)
            want = list(model[lst])[:arg]
            assert walked == want
            for i in want:
                del model[lst][i]
        _assert_holds(order, model)
        for i in range(IDS):
            assert order.list_of(i) == on(i) and (i in order) == (on(i) != NONE)



@settings(max_examples=300, deadline=None)
@given(st.permutations(range(IDS)), st.lists(st.integers(NONE, LISTS - 1), min_size=IDS, max_size=IDS),
       st.lists(st.lists(st.integers(0, IDS - 1), max_size=3 * IDS), max_size=4))
def test_a_touch_of_many_ids_at_once_is_each_touched_in_turn(
        order_in: list[int], list_of: list[int], batches: list[list[int]]) -> None:
    """Lists filled in a random order, then batches of touches (ids that follow one another,
    repeats, a list's newest): each list as an OrderedDict's ``move_to_end`` of every id in
    turn leaves it, its links both ways."""
    order, model = LinkedOrder(), {lst: OrderedDict[int, None]() for lst in range(LISTS)}
    for i in order_in:
        if list_of[i] != NONE:
            order.push(list_of[i], i)
            model[list_of[i]][i] = None
    for batch in batches:
        held = [i for i in batch if list_of[i] != NONE]
        order.touch_many(np.array(held, dtype=np.int64))
        for i in held:
            model[list_of[i]].move_to_end(i)
        _assert_holds(order, model)
        assert all(order.list_of(i) == list_of[i] for i in range(IDS))
        if len(held) < len(batch):
            stray = next(i for i in batch if list_of[i] == NONE)
            with pytest.raises(ValueError):
                order.touch_many(np.array([stray] * 20, dtype=np.int64))

def test_a_touch_during_a_walk_moves_the_id_to_the_end_and_the_walk_goes_on() -> None:
    """The disk tier touches a busy victim while it walks for room: the walk still reaches the
    ids after it, and the touched id comes round again at the end."""
    order = LinkedOrder()
    order.extend(0, np.arange(4))
    seen = []
    for i in order.oldest(0):
        seen.append(i)
        if i == 1 and seen.count(1) == 1:
            order.touch(1)
        if len(seen) == 6:
            break
    assert seen == [0, 1, 2, 3, 1]
    assert list(order.oldest(0)) == [0, 2, 3, 1]


def test_an_id_costs_twelve_bytes() -> None:
    order = LinkedOrder()
    order.extend(0, np.arange(1000))
    assert order.nbytes() == 12 * 1000
