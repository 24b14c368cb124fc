"""KDA state snapshots in spare recurrent-pool slots: taken at commit, keyed, resumed from, evicted."""

import torch

from mstar.resources.recurrent_pool import RecurrentStatePool
from mstar.resources.step import SeqStep, StepDecl

INTERVAL = 8


def make_pool(slots):
    return RecurrentStatePool(num_layers=2, max_slots=slots, num_heads=2, head_dim=3, conv_kernel=4,
                              state_dtype=torch.float32, conv_dtype=torch.float32, snapshot_interval=INTERVAL)


def run(pool, request_id, start, n, prefix=(), verify=False, lag=0):
    """Admit a step of n rows, fill the slot with fresh values (what the forward would leave), commit."""
    decl = StepDecl((SeqStep(request_id, start, tuple(range(n)), sample=True, verify=verify, prefix=prefix,
                             lag=lag),))
    assert pool.can_admit(decl)
    pool.admit(decl)
    slot = pool.slots[request_id]
    pool.state[:, slot] = torch.randn_like(pool.state[:, slot])
    pool.conv[:, slot] = torch.randn_like(pool.conv[:, slot])
    pool.commit(decl)
    return slot


def test_a_row_ending_on_a_boundary_leaves_a_snapshot_that_a_new_request_resumes_from():
    pool = make_pool(4)
    slot = run(pool, "a", 0, 5)
    assert pool.num_snapshots == 0  # 5 is no boundary
    run(pool, "a", 5, 3)
    state, conv = pool.state[:, slot].clone(), pool.conv[:, slot].clone()
    assert pool.num_snapshots == 1 and pool.num_free == pool.capacity - 1  # snapshots stay available to requests
    run(pool, "a", 8, 2, verify=True)  # a verify block from 8: its state is that at 8, snapshotted already
    assert pool.num_snapshots == 1
    run(pool, "a", 9, 4, verify=True)  # (accepted 1 of the last block's rows; the block after skips 16)
    run(pool, "a", 13, 4, verify=True)
    assert pool.num_snapshots == 1
    run(pool, "a", 16, 4, verify=True)  # a block starting on a boundary: the state folded up to 16
    assert pool.num_snapshots == 2
    pool.publish("a", {8: b"k8"})
    assert pool.has_snapshot(b"k8")
    pool.release("a")
    assert pool.num_snapshots == 1  # a keyed snapshot outlives its request; the unkeyed one at 16 went
    decl = StepDecl((SeqStep("b", 8, (1,), sample=True, prefix=(b"k7", b"k8")),))
    pool.admit(decl)
    b = pool.slots["b"]
    assert torch.equal(pool.state[:, b], state) and torch.equal(pool.conv[:, b], conv)
    assert pool.prefix_len[b] == 0


def test_a_verify_block_placed_by_the_step_in_flight_leaves_no_snapshot():
    """Planned while the verify block before runs (async scheduling), a block starts 0..lag positions past its
    num_computed, known only on the device: a snapshot labelled num_computed could hold a later state."""
    pool = make_pool(4)
    run(pool, "a", 0, 5)
    run(pool, "a", 5, 3, verify=True)  # the anchor row at 5 is committed at launch, the drafts pending
    run(pool, "a", 8, 4, verify=True, lag=2)  # starts at 8, 9 or 10: no snapshot at 8
    assert pool.num_snapshots == 0
    run(pool, "a", 8, 4, verify=True)  # the same block settled at 8 (core.py `_settle`): now it is known
    assert pool.num_snapshots == 1


def test_unkeyed_snapshots_go_with_their_request_and_duplicates_are_dropped():
    pool = make_pool(5)
    run(pool, "a", 0, 8)
    run(pool, "b", 0, 8)
    pool.publish("a", {8: b"same"})
    pool.publish("b", {8: b"same"})  # b computed the same prefix: a's snapshot stays the one
    assert pool.num_snapshots == 1
    run(pool, "a", 8, 8)
    pool.release("a")  # its snapshot at 16 never got a key
    assert pool.num_snapshots == 1
    pool.release("b")
    assert pool.num_used == 0 and pool.num_free == pool.capacity


def test_requests_take_snapshot_slots_back_least_recently_used_first():
    pool = make_pool(4)  # 3 slots
    for request_id, key in (("a", b"ka"), ("b", b"kb")):
        run(pool, request_id, 0, 8)
        pool.publish(request_id, {8: key})
        pool.release(request_id)
    assert pool.num_snapshots == 2
    run(pool, "x", 0, 1)  # the free slot
    run(pool, "y", 0, 1)  # takes the oldest snapshot's slot
    assert not pool.has_snapshot(b"ka") and pool.has_snapshot(b"kb")
    run(pool, "z", 0, 1)
    assert pool.num_snapshots == 0 and pool.num_used == 3
    run(pool, "x", 1, 7)  # a boundary with no spare slot: no snapshot, and no error
    assert pool.num_snapshots == 0


def test_the_snapshot_a_step_resumes_from_is_never_the_slot_it_gets():
    pool = make_pool(3)  # 2 slots
    run(pool, "a", 0, 8)
    pool.publish("a", {8: b"k"})
    pool.release("a")  # one free slot, one snapshot
    run(pool, "x", 0, 1)  # takes the free slot: the snapshot's is the only one left
    resume = StepDecl((SeqStep("b", 8, (1,), sample=True, prefix=(b"k",)),))
    assert not pool.can_admit(resume)  # it would have to evict its own source
    assert pool.has_snapshot(b"k") and "b" not in pool.slots


def test_dropped_and_reset_snapshots_free_their_slots_and_copies_are_logged():
    pool = make_pool(4)
    run(pool, "a", 0, 8)
    run(pool, "a", 8, 8)
    pool.publish("a", {8: b"k8", 16: b"k16"})
    copies = pool.take_copies()
    assert len(copies) == 2 and all(src == pool.slots["a"] for src, _ in copies)
    assert pool.take_copies() == []
    pool.drop_snapshot(b"k8")  # its page was evicted
    assert not pool.has_snapshot(b"k8") and pool.has_snapshot(b"k16")
    pool.reset_prefix_cache()
    assert pool.num_snapshots == 0
    pool.release("a")
    assert pool.num_free == pool.capacity


def test_a_follower_replays_the_copies_to_the_same_state():
    leader, follower = make_pool(4), make_pool(4)
    follower.state.copy_(leader.state)
    follower.conv.copy_(leader.conv)
    slot = run(leader, "a", 0, 8)
    follower.state[:, slot], follower.conv[:, slot] = leader.state[:, slot], leader.conv[:, slot]  # the forward
    leader.publish("a", {8: b"k"})
    leader.release("a")
    leader.admit(StepDecl((SeqStep("b", 8, (1,), sample=True, prefix=(b"k",)),)))
    follower.apply_copies(leader.take_copies())
    assert torch.equal(follower.state, leader.state) and torch.equal(follower.conv, leader.conv)
