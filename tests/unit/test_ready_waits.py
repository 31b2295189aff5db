"""How often a starting server is probed (issue #41): soon at first, then every ``poll_s``.

A simulator or a small model is up in about a second; probing every 2 s from the start kept
each such start waiting up to 2 s past ready (in the suite, every server start). A real vLLM
start takes minutes, and after the first few seconds it is probed every ``poll_s`` as before.
"""

from __future__ import annotations

import itertools

import pytest

from speedmatrix.engine.vllm_server.ready import FIRST_POLL_S, poll_waits


def test_the_waits_double_from_a_quarter_second_up_to_poll_s():
    assert FIRST_POLL_S == 0.25
    waits = list(itertools.islice(poll_waits(2.0), 7))
    assert waits == pytest.approx([0.25, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0])


def test_a_poll_shorter_than_the_first_wait_is_kept():
    assert list(itertools.islice(poll_waits(0.2), 3)) == pytest.approx([0.2, 0.2, 0.2])
