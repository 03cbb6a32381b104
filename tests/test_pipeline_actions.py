"""Schedule actions: the p2p batch rules every list obeys, and how actions read in messages."""
from __future__ import annotations

import pytest

from megazero.parallel.pipeline.actions import P2P, B, Compute, Exchange, F, Kind, Op, batch


def test_a_batch_posts_at_most_one_op_of_each_kind_in_the_fixed_order():
    """send-next, recv-prev, send-prev, recv-next (on a ring of two ranks prev and next are the same
    rank, and both sides must match the activation before the gradient)."""
    ok = Exchange((P2P(Op.SEND_NEXT, 0, 1), P2P(Op.RECV_PREV, 0, 2), P2P(Op.SEND_PREV, 0, 0), P2P(Op.RECV_NEXT, 0, 1)))
    assert [p.op for p in ok.ops] == list(Op)
    for bad in [(P2P(Op.SEND_PREV, 0, 0), P2P(Op.SEND_NEXT, 0, 1)),        # out of order
                (P2P(Op.RECV_PREV, 0, 0), P2P(Op.RECV_PREV, 0, 1)),        # two of a kind
                ()]:                                                        # empty
        with pytest.raises(ValueError, match="in the order send-next, recv-prev, send-prev, recv-next"):
            Exchange(bad)


def test_batch_sorts_and_skips_missing_ops():
    got = batch(P2P(Op.RECV_NEXT, 0, 0), None, P2P(Op.SEND_NEXT, 0, 1), wait=False)
    assert got == [Exchange((P2P(Op.SEND_NEXT, 0, 1), P2P(Op.RECV_NEXT, 0, 0)), wait=False)]
    assert batch(None, None) == []


def test_ops_know_their_tensor_and_peer():
    assert [(op.is_send, op.tensor, op.towards_next) for op in Op] == [
        (True, "activation", True), (False, "activation", False), (True, "gradient", False), (False, "gradient", True)]


def test_actions_are_frozen_values_that_read_well():
    assert F(1, 3) == Compute(Kind.FORWARD, 1, 3) and hash(B(0, 2)) == hash(Compute(Kind.BACKWARD, 0, 2))
    with pytest.raises(AttributeError):
        F(0, 0).micro = 1
    assert str(F(1, 3)) == "F(chunk 1, micro-batch 3)"
    assert str(Compute(Kind.BACKWARD_WEIGHT, 0, 2)) == "W(chunk 0, micro-batch 2)"
    assert str(Exchange((P2P(Op.SEND_NEXT, 0, 1), P2P(Op.RECV_NEXT, 0, 0)), wait=False)) == (
        "exchange[send-next activation (chunk 0, micro-batch 1), recv-next gradient (chunk 0, micro-batch 0); "
        "wait when needed]")


def test_a_batch_may_hold_one_op_of_a_kind_per_chunk():
    """The V: chunk 0's activation from the previous rank and chunk 1's from the next, in one batch."""
    both = Exchange((P2P(Op.RECV_PREV, 0, 3), P2P(Op.RECV_PREV, 1, 1)))
    assert batch(P2P(Op.RECV_PREV, 1, 1), P2P(Op.RECV_PREV, 0, 3)) == [both]
    with pytest.raises(ValueError, match="at most one of each kind per chunk"):
        Exchange((P2P(Op.RECV_PREV, 1, 1), P2P(Op.RECV_PREV, 0, 3)))
