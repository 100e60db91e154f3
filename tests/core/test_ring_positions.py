"""Ring slot arithmetic and the position frame: wrap-around, sink preservation, reset boundaries,
odd window sizes. Pure integer logic; no model."""

from __future__ import annotations

import pytest
import torch
from vivant.worker.model.positions import PositionFrame, RingLayout, chunk_positions, sink_positions


@pytest.mark.parametrize("sink,T,W", [(489, 757, 7), (10, 27, 3), (0, 5, 1), (3, 7, 5), (7, 7, 2)])
def test_chunks_cycle_through_window_blocks_and_never_touch_the_sink(sink, T, W):
    lay = RingLayout(sink, T, W)
    assert lay.slots == sink + W * T
    seen = {}
    for c in range(3 * W + 1):
        a, b = lay.chunk_slot_range(c)
        assert sink <= a < b <= lay.slots, f"chunk {c} got slots [{a},{b}) outside the window of {lay}"
        assert b - a == T
        assert (a - sink) % T == 0
        seen.setdefault((a, b), []).append(c)
    # every block is reused every W chunks, and blocks never overlap
    for rng, chunks in seen.items():
        assert all(y - x == W for x, y in zip(chunks, chunks[1:], strict=False)), f"block {rng} reused by {chunks}"
    starts = sorted(r[0] for r in seen)
    assert starts == [sink + i * T for i in range(W)]


@pytest.mark.parametrize("sink,T,W", [(10, 27, 3), (3, 7, 5), (0, 4, 2), (4, 4, 1)])
def test_valid_mask_is_sink_after_eviction_plus_resident_chunks(sink, T, W):
    lay = RingLayout(sink, T, W)
    for c in range(4 * W):
        mask = lay.valid_mask(c)
        owner = lay.slot_owner(c)
        expected_chunks = set(range(max(0, c - W + 1), c + 1))
        window_owners = set(owner[sink:][owner[sink:] >= 0].tolist())
        assert window_owners == expected_chunks, f"chunk {c}: window holds {window_owners}, expected {expected_chunks}"
        assert int(mask[sink:].sum()) == len(expected_chunks) * T
        sink_on = bool(mask[:sink].all()) if sink else False
        assert sink_on == (sink > 0 and c >= W), f"chunk {c}: sink valid={sink_on} with W={W}"
        assert torch.equal(mask, owner >= 0)


def test_each_key_seen_once_sink_masked_while_chunk0_resident():
    lay = RingLayout(5, 9, 3)
    for c in range(3):
        assert not lay.valid_mask(c)[:5].any(), "sink must stay masked while chunk 0 is still in the window"
    assert lay.valid_mask(3)[:5].all()


def test_bad_layouts_are_rejected_with_the_field():
    with pytest.raises(ValueError, match="sink"):
        RingLayout(10, 5, 2)
    with pytest.raises(ValueError, match="tokens_per_chunk"):
        RingLayout(0, 0, 2)
    with pytest.raises(ValueError, match="chunk index"):
        RingLayout(0, 4, 2).chunk_slot_range(-1)


def test_position_frame_resets_at_limit_and_lands_on_window():
    f = PositionFrame(t_limit=12, window_chunks=3)
    ts, resets = [], []
    for c in range(100):
        if f.needs_reset(c):
            resets.append((c, f.reset()))
        ts.append(f.t_of(c))
    assert max(ts) == 11 and min(ts) == 0
    assert len(resets) >= 2
    assert all(d == 9 for _, d in resets), resets
    # right after a reset the chunk sits at t = W and t then climbs by one per chunk
    for c, _ in resets:
        assert ts[c] == 3 and ts[c - 1] == 11, f"reset before chunk {c}: t went {ts[c-1]} → {ts[c]}"
    assert all(b - a == 1 for i, (a, b) in enumerate(zip(ts, ts[1:], strict=False)) if (i + 1) not in {c for c, _ in resets})


def test_chunk_positions_layout():
    pos = chunk_positions(5, grid_h=2, grid_w=3, audio_tokens=2)
    assert pos.shape == (8, 3)
    assert (pos[:, 0] == 5).all()
    assert pos[:6, 1:].tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert pos[6:, 1:].tolist() == [[2, 0], [2, 1]], "audio tokens sit on the extra row h = grid_h"
    sp = sink_positions(chunk_positions(0, 2, 3, 2), 4)
    assert sp[:, 0].tolist() == [0, 0, 0, 0] and sp[:, 1:].tolist() == pos[:4, 1:].tolist()
