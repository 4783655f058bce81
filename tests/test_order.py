"""Data order and seeds are pure functions of (seed, position): no process group, no hidden state."""

import numpy as np

from diffrelay.data.order import DataOrder, derive_seed, epoch_permutation, global_indices, rank_slice, step_seed


def test_global_stream_is_consecutive_epoch_permutations():
    n = 10
    stream = global_indices(seed=3, n=n, start=0, count=35)
    expected = np.concatenate([epoch_permutation(3, e, n) for e in range(4)])[:35]
    assert np.array_equal(stream, expected)
    for e in range(3):
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n))


def test_stream_read_in_pieces_equals_stream_read_at_once():
    whole = global_indices(seed=1, n=7, start=0, count=40)
    pieces = np.concatenate([global_indices(1, 7, s, 5) for s in range(0, 40, 5)])
    assert np.array_equal(whole, pieces)


def test_rank_shares_cover_the_global_batch_once_for_any_world():
    batch = global_indices(seed=0, n=100, start=13, count=24)
    for world in (1, 2, 3, 4):
        parts = [rank_slice(batch, r, world) for r in range(world)]
        rebuilt = np.empty_like(batch)
        for r, p in enumerate(parts):
            rebuilt[r::world] = p
        assert np.array_equal(rebuilt, batch)


def test_data_order_state_resumes_the_same_sequence():
    a = DataOrder(seed=5, n=30, global_batch=8)
    first = [a.next_batch()[0] for _ in range(3)]
    b = DataOrder(seed=5, n=30, global_batch=8)
    b.load_state_dict(a.state_dict())
    c = DataOrder(seed=5, n=30, global_batch=8)
    straight = [c.next_batch() for _ in range(5)]
    assert all(np.array_equal(x, y) for x, (y, _) in zip(first, straight[:3]))
    indices, positions = b.next_batch()
    assert np.array_equal(indices, straight[3][0])
    assert np.array_equal(positions, np.arange(24, 32))


def test_seeds_differ_by_each_input_and_do_not_collide_like_sums():
    seeds = {step_seed(s, st, r) for s in range(3) for st in range(20) for r in range(4)}
    assert len(seeds) == 3 * 20 * 4
    # seed+epoch style mixing would make (1, 2) and (2, 1) equal
    assert derive_seed(1, 2) != derive_seed(2, 1)
    assert not np.array_equal(epoch_permutation(0, 1, 50), epoch_permutation(1, 0, 50))


def test_cached_order_equals_the_stream_across_epochs_and_after_a_mid_epoch_load():
    for n, batch in ((10, 3), (7, 16), (50, 50)):  # epochs end mid-batch; a batch spans several epochs; exact fit
        order = DataOrder(seed=4, n=n, global_batch=batch)
        for step in range(12):
            indices, positions = order.next_batch()
            assert np.array_equal(indices, global_indices(4, n, step * batch, batch)), (n, batch, step)
            assert np.array_equal(positions, np.arange(step * batch, (step + 1) * batch))
    a = DataOrder(seed=4, n=10, global_batch=3)
    for _ in range(5):  # consumed 15: the middle of the second epoch, with epoch 1's permutation cached
        a.next_batch()
    b = DataOrder(seed=9, n=10, global_batch=3)
    b.next_batch()  # caches seed 9's epoch 0, which the load must drop
    b.load_state_dict(a.state_dict())
    for step in range(5, 12):
        assert np.array_equal(b.next_batch()[0], global_indices(4, 10, step * 3, 3))


def test_advance_counts_a_batch_without_changing_the_order():
    a, b = DataOrder(seed=2, n=9, global_batch=4), DataOrder(seed=2, n=9, global_batch=4)
    a.next_batch()
    b.advance()
    assert a.state_dict() == b.state_dict() == {"seed": 2, "consumed": 4}
    assert np.array_equal(a.next_batch()[0], b.next_batch()[0])
