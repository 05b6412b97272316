"""Start-up objects leave the garbage collector's walks; what requests allocate stays in them."""

from __future__ import annotations

import gc

from mmserve.runtime.heap import freeze_startup_heap


def test_objects_alive_after_start_up_are_frozen_and_later_ones_are_not() -> None:
    startup = {"kept": ["for good"]}
    try:
        assert freeze_startup_heap() > 0
        assert not any(obj is startup for obj in gc.get_objects())
        request = {"made": ["later"]}
        assert any(obj is request for obj in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(obj is startup for obj in gc.get_objects())
