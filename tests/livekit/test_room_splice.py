"""The splice in the room (#21, docs/ARCHITECTURE.md "Rewind at a turn start"): `RoomVideo` cuts its queue at a turn
start, with real SDK objects (`rtc.VideoFrame`, `rtc.AudioFrame`, livekit-agents' `AudioSegmentEnd`) and no server.

Due times are counted by queue position: the i-th queued frame is published about (held_frames + i) / fps from now
(`frames_held_by_runner`: what the AvatarRunner and its AVSynchronizer hold, counted as shown), so the cut
for a horizon is exact arithmetic here, no clock. Every frame carries its own level (chunk · 10 + frame, + 100 for a
chunk made again), so the published sequence is read back from the pixels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from livekit import rtc
from livekit.agents.voice.avatar import AudioSegmentEnd
from test_livekit_avatar import OfflineRoom, wait_until
from vivant.worker.model.config import ModelConfig
from vivant.worker.serving.room_video import ChunkMeta, RoomVideo, frames_held_by_runner
from vivant.worker.stream.livekit_sink import pcm_to_audio_frame

CFG = ModelConfig.from_name("tiny")  # 24 fps, 4 frames per chunk, 16 kHz
FPC, FPS = CFG.frames_per_chunk, CFG.fps
HELD = frames_held_by_runner(FPS)
pytestmark = pytest.mark.timeout(120)


def frames(chunk: int, remade: bool = False) -> np.ndarray:
    levels = [chunk * 10 + j + (100 if remade else 0) for j in range(FPC)]
    return np.stack([np.full((CFG.height, CFG.width, 3), v, np.uint8) for v in levels])


def span(chunk: int) -> int:
    a, b = CFG.chunk_sample_range(chunk)
    return b - a


def speech(chunk: int) -> np.ndarray:
    a, b = CFG.chunk_sample_range(chunk)
    return (0.4 * np.sin(np.arange(a, b) * 0.07)).astype(np.float32)


def silent(video: RoomVideo, *chunks: int) -> None:
    for c in chunks:
        video.deliver(c, frames(c), np.zeros(span(c), np.float32), 0, False, video.clear_epoch)


def level(item: rtc.VideoFrame) -> int:
    return int(np.frombuffer(item.data, np.uint8)[0])


async def drain(video: RoomVideo) -> list[Any]:
    video.close()
    return [item async for item in video]


def horizon(frames_kept: int) -> float:
    """The keep horizon (s) under which exactly the first `frames_kept` queued frames are due."""
    return (HELD + frames_kept - 1) / FPS


def test_the_runner_holds_the_synchronizers_queue_its_paced_frame_and_the_one_it_pushes() -> None:
    assert frames_held_by_runner(24, 100) == 2 + 2  # int(24 · 0.1) = 2 queued
    assert frames_held_by_runner(24, 10) == 1 + 2  # the SDK bounds its queue to at least one frame


@pytest.mark.parametrize(("kept", "cut"), [(0, (0, 0)), (7, (1, 3)), (8, (2, 0)), (16, (4, 0))])
async def test_the_queue_is_cut_at_the_first_frame_due_after_the_horizon(kept: int, cut: tuple[int, int]) -> None:
    video = RoomVideo(CFG, lambda e: None)
    silent(video, 0, 1, 2, 3)  # 16 silent frames queued
    assert video.splice(horizon(kept)) == cut
    m, k = cut
    assert video.next_chunk == m and video.stats.spliced_frames == 16 - kept
    video.deliver(m, frames(m, remade=True), np.zeros(span(m), np.float32), 0, False, video.clear_epoch)
    video.deliver(m + 1, frames(m + 1, remade=True), np.zeros(span(m + 1), np.float32), 0, False, video.clear_epoch)
    out = await drain(video)
    levels = [level(v) for v in out if isinstance(v, rtc.VideoFrame)]
    old = [c * 10 + j for c in range(4) for j in range(FPC)][:kept]
    remade = [100 + m * 10 + j for j in range(k, FPC)] + [100 + (m + 1) * 10 + j for j in range(FPC)]
    assert levels == old + remade, "the old frames before f*, then the remade chunk's frames ≥ k, nothing else"
    assert video.stats.published == [[0, (m + 2) * FPC - 1]], "every frame index published once, in order"


async def test_a_cut_leaves_the_producer_time_for_the_chunk_after_the_remade_one() -> None:
    """`next_chunk_s`: frame 7 (chunk 1's last) is the first due after the horizon of 7 kept frames, but the chunk
    after a chunk 1 remade from its frame 3 would be due one frame later; with 2.5 frames' time for it the cut moves
    to chunk 2's first frame. A bad value is named and cuts nothing."""
    video = RoomVideo(CFG, lambda e: None)
    silent(video, 0, 1, 2, 3)
    with pytest.raises(ValueError, match="next_chunk_s = -1"):
        video.splice(horizon(7), next_chunk_s=-1)
    assert video.stats.spliced_frames == 0
    assert video.splice(horizon(7), next_chunk_s=2.5 / FPS) == (2, 0)
    assert video.stats.spliced_frames == 16 - 8


async def test_the_remade_chunk_brings_its_speech_from_frame_k_one_frame_of_audio_per_frame() -> None:
    video = RoomVideo(CFG, lambda e: None)
    silent(video, 0, 1)
    assert video.splice(horizon(6)) == (1, 2)
    video.deliver(1, frames(1, remade=True), speech(1), span(1), True, video.clear_epoch)  # the turn, one chunk long
    out = await drain(video)
    tail = out[6:]
    assert [type(o) for o in tail] == [rtc.VideoFrame, rtc.AudioFrame] * 2 + [AudioSegmentEnd]
    start = CFG.chunk_sample_range(1)[0]
    for f, (v, a) in zip((6, 7), (tail[0:2], tail[2:4]), strict=True):
        piece = speech(1)[f * 16000 // FPS - start:(f + 1) * 16000 // FPS - start]
        assert level(v) == 100 + 10 + f % FPC
        assert a.samples_per_channel == len(piece) and bytes(a.data) == bytes(pcm_to_audio_frame(piece, 16000).data), \
            f"frame {f}'s audio must be its own 1/24 s of the remade chunk's speech"
    assert all(isinstance(o, rtc.VideoFrame) for o in out[:6]), "the old silent frames kept carry no audio"


async def test_queued_speech_and_its_segment_end_are_never_cut() -> None:
    video = RoomVideo(CFG, lambda e: None)
    video.deliver(0, frames(0), speech(0), span(0), True, video.clear_epoch)  # the previous turn's last chunk
    silent(video, 1, 2)
    assert video.splice(0.0) == (1, 0), "the cut comes after the speech, whatever the horizon"
    out = await drain(video)
    assert [type(o) for o in out] == [rtc.VideoFrame, rtc.AudioFrame] * 4 + [AudioSegmentEnd]
    assert video.stats.spliced_frames == 8


async def test_an_explicit_cut_before_queued_speech_is_refused_and_loses_nothing() -> None:
    video = RoomVideo(CFG, lambda e: None)
    silent(video, 0)
    video.deliver(1, frames(1), speech(1), span(1), False, video.clear_epoch)
    before = video.queued_items()
    with pytest.raises(ValueError, match=r"splice m = 0, k = 2: speech of the current playback"):
        video.cut(0, 2)
    assert video.queued_items() == before and video.next_chunk == 2
    assert len(await drain(video)) == before


async def test_speech_muted_by_an_interrupt_is_spliced_over() -> None:
    video = RoomVideo(CFG, lambda e: None)
    silent(video, 0)
    video.deliver(1, frames(1), speech(1), span(1), False, video.clear_epoch)
    await video.clear_buffer()  # the interrupt drops the queued speech; its video stays
    video.deliver(2, frames(2), speech(2), span(2), True, 0)  # taken before the interrupt: muted
    assert video.splice(horizon(5)) == (1, 1), "after an interrupt the turn splices over the muted frames too"
    out = await drain(video)
    assert [level(v) for v in out] == [0, 1, 2, 3, 10]


async def test_an_interrupts_splice_remakes_the_muted_frames_without_audio() -> None:
    """After `lk.clear_buffer` rank 0 splices too; chunk m made again keeps the (interrupted) speech of its frames
    < k and is silent from k: its speech count is > 0, but nothing is published as audio (a stray
    `lk.playback_started` otherwise)."""
    video = RoomVideo(CFG, lambda e: None)
    video.deliver(0, frames(0), speech(0), span(0), False, video.clear_epoch)
    video.deliver(1, frames(1), speech(1), span(1), False, video.clear_epoch)
    await video.clear_buffer()
    assert video.splice(horizon(6)) == (1, 2)
    remade = speech(1)
    remade[6 * 16000 // FPS - CFG.chunk_sample_range(1)[0]:] = 0  # silence from frame 2 of chunk 1 (frame 6)
    video.deliver(1, frames(1, remade=True), remade, span(1), False, video.clear_epoch)
    out = await drain(video)
    assert [type(o) for o in out] == [rtc.VideoFrame] * 8
    assert [level(v) for v in out] == [0, 1, 2, 3, 10, 11, 112, 113]


async def test_chunks_in_the_decoder_stage_are_judged_whole() -> None:
    video = RoomVideo(CFG, lambda e: None)
    silent(video, 0)
    epoch = video.clear_epoch
    pending = [ChunkMeta(1, 0, False, epoch), ChunkMeta(2, 0, False, epoch), ChunkMeta(3, 0, False, epoch)]
    # chunk 1's first frame is due (HELD + 4) / fps: within the horizon, it is kept whole; chunk 2 is not
    assert video.splice(horizon(5), pending=pending) == (2, 0)
    assert video.next_chunk == 1 and video.stats.spliced_frames == 0
    silent(video, 1)  # the kept chunk arrives, then the remade one
    video.deliver(2, frames(2, remade=True), np.zeros(span(2), np.float32), 0, False, epoch)
    out = await drain(video)
    assert [level(v) for v in out] == [0, 1, 2, 3, 10, 11, 12, 13, 120, 121, 122, 123]


async def test_speech_upstream_keeps_everything_before_it() -> None:
    video = RoomVideo(CFG, lambda e: None)
    silent(video, 0, 1)
    epoch = video.clear_epoch
    pending = [ChunkMeta(2, span(2), True, epoch), ChunkMeta(3, 0, False, epoch)]
    assert video.splice(0.0, pending=pending) == (3, 0), "a speech chunk still decoding plays, and all before it"
    assert video.stats.spliced_frames == 0
    stale = [ChunkMeta(2, span(2), True, epoch - 1), ChunkMeta(3, 0, False, epoch)]
    video2 = RoomVideo(CFG, lambda e: None)
    silent(video2, 0, 1)
    await video2.clear_buffer()
    assert video2.splice(0.0, pending=stale) == (0, 0), "speech from before an interrupt is muted, so cut over"


async def test_chunks_below_oldest_are_kept() -> None:
    video = RoomVideo(CFG, lambda e: None)
    silent(video, 0, 1, 2)
    assert video.splice(0.0, oldest=2) == (2, 0)
    assert [level(v) for v in await drain(video)] == [0, 1, 2, 3, 10, 11, 12, 13]


async def test_bad_input_names_the_field_and_loses_nothing() -> None:
    video = RoomVideo(CFG, lambda e: None)
    silent(video, 0, 1)
    assert video.splice(horizon(6)) == (1, 2)
    queued = video.queued_items()
    for call, field in [
        (lambda: video.splice(-0.1), "splice keep_s = -0.1"),
        (lambda: video.splice(float("nan")), "splice keep_s = nan"),
        (lambda: video.splice(0.0, oldest=-1), "splice oldest = -1"),
        (lambda: video.splice(0.0, oldest=5), "splice oldest = 5"),
        (lambda: video.splice(0.0, pending=[ChunkMeta(3, 0, False, 0)]), r"splice pending = chunks \[3\]"),
        (lambda: video.cut(9, 0), r"splice m = 9; expected .* in \[0, 1\]"),
        (lambda: video.cut(0, 4), r"splice k = 4; expected a frame index in \[0, 4\)"),
        (lambda: video.cut(0, -1), r"splice k = -1"),
        (lambda: video.cut(1, 0), "splice k = 0: chunk 1 is still to come, so it is cut at frame 2"),
        (lambda: video.deliver(2, frames(2), np.zeros(span(2), np.float32), 0, False, 0),
         "deliver index = 2: expected chunk 1"),
    ]:
        with pytest.raises(ValueError, match=field):
            call()
        assert video.queued_items() == queued and video.next_chunk == 1
    with pytest.raises(ValueError, match="held_frames = -1"):
        RoomVideo(CFG, lambda e: None, held_frames=-1)
    assert [level(v) for v in await drain(video)] == [0, 1, 2, 3, 10, 11]


def test_a_splice_in_a_running_room_publishes_every_index_once() -> None:
    """`RoomSession.splice` on the room's loop while the framework's AvatarRunner consumes the queue: the frames it
    took are shown, the cut is at a queued frame, and the remade chunk continues the index sequence."""
    room = OfflineRoom([]).start()
    try:
        for n in range(6):
            room.deliver(n, frames(n), np.zeros(span(n), np.float32), 0, False, room.clear_epoch)
        wait_until(lambda: len(room.runner.video_out) >= 4)
        m, k = room.splice(0.0)
        assert m * FPC + k >= 4, "frames the runner already took are never cut"
        for n in range(m, m + 2):
            room.deliver(n, frames(n, remade=True), np.zeros(span(n), np.float32), 0, False, room.clear_epoch)
        last = (m + 2) * FPC - 1
        wait_until(lambda: room.video.stats.published[-1][1] == last)
    finally:
        room.close()
    assert room.video.stats.published == [[0, last]], room.video.stats.published
    assert room.video.stats.splices == [(m, k)] and room.video.stats.spliced_frames == 6 * FPC - (m * FPC + k)


def test_the_decoder_ranks_splice_cuts_the_room_and_its_decoder_stage_together() -> None:
    """`splice_room` as the livekit kind's decoder rank runs it: a real `DecoderStage` (vivant's tiny VAE) delivers
    into a running OfflineRoom; at the splice the chunks still in the stage are dropped with the room's cut, the
    stage's causal state returns to before m, and the chunks made again continue the published index sequence."""
    import torch
    from vivant.worker.serving.livekit_avatar import splice_room
    from vivant.worker.stream.decoder_stage import DecoderStage, LatentChunk
    from vivant.worker.stream.vae import VAEConfig, build_vae_decoder

    room = OfflineRoom([]).start()
    pending: dict[int, ChunkMeta] = {}

    def to_room(chunk: Any) -> None:  # the decoder rank's _to_room
        meta = pending.pop(chunk.index)
        room.deliver(chunk.index, chunk.frames, chunk.audio, meta.speech_samples, meta.ends_segment, meta.epoch)

    stage = DecoderStage(build_vae_decoder(VAEConfig.for_model(CFG)), to_room).start()

    def submit(n: int) -> None:
        pending[n] = ChunkMeta(n, 0, False, room.clear_epoch)
        stage.submit(LatentChunk(n, torch.full((CFG.latent_channels, CFG.latent_h, CFG.latent_w), n / 10),
                                 np.zeros(span(n), np.float32)))

    try:
        for n in range(4):
            submit(n)
        wait_until(lambda: room.video.next_chunk == 4)
        submit(4)
        submit(5)
        m, k = splice_room(room, stage, pending, 0.0)
        assert m <= 5 and all(c < m for c in pending), (m, k, pending)
        for n in range(m, m + 2):
            submit(n)
        last = (m + 2) * FPC - 1
        wait_until(lambda: room.video.stats.published[-1][1] == last, 20)
    finally:
        stage.close()
        room.close()
    assert room.video.stats.published == [[0, last]], room.video.stats.published
    assert room.video.stats.splices == [(m, k)]


def test_a_chunk_the_room_refuses_fails_the_decoder_ranks_next_wait() -> None:
    room = OfflineRoom([]).start()
    try:
        room.deliver(0, frames(0), np.zeros(span(0), np.float32), 0, False, room.clear_epoch)
        room.deliver(2, frames(2), np.zeros(span(2), np.float32), 0, False, room.clear_epoch)  # chunk 1 skipped
        wait_until(lambda: room.delivery_error is not None)
        with pytest.raises(RuntimeError, match="the room refused a decoded chunk: deliver index = 2: expected chunk 1"):
            room.wait_lead()
    finally:
        room.close()


def test_the_lead_counts_queued_frames_and_the_chunks_upstream() -> None:
    """`wait_lead(upstream=n)`: frames queued (speech or silence alike) + n chunks still in the decoder stage, against
    `lead_chunks` chunks of frames. The runner here never consumes (a room that never connects), so a wait that
    holds ends in the stall error."""
    from livekit.agents.voice.avatar import AvatarRunner
    from vivant.worker.serving.livekit_avatar import RoomSession

    class NeverPublishes(OfflineRoom):
        def _avatar_runner(self, room: rtc.Room, receiver: Any, video: RoomVideo) -> AvatarRunner:
            return RoomSession._avatar_runner(self, room, receiver, video)

    room = NeverPublishes([], stall_timeout_s=0.5).start()
    try:
        room.deliver(0, frames(0), speech(0), span(0), False, room.clear_epoch)  # 8 items, 4 frames
        room.deliver(1, frames(1), np.zeros(span(1), np.float32), 0, False, room.clear_epoch)
        wait_until(lambda: room.video.next_chunk == 2)
        room.wait_lead(upstream=1)  # 8 frames + 1 chunk = 3 chunks: no wait
        with pytest.raises(RuntimeError, match="published video stalled"):
            room.wait_lead(upstream=2)
    finally:
        room.close()


async def test_a_turns_wait_is_counted_in_frames_handed_to_the_runner() -> None:
    video = RoomVideo(CFG, lambda e: None)
    silent(video, 0)
    frames_out = video.__aiter__()
    for _ in range(3):
        await anext(frames_out)  # the runner takes 3 silent frames
    await video.push_audio(rtc.AudioFrame(b"\x10\x00" * 1600, 16000, 1, 1600))  # a segment's first audio comes in
    await anext(frames_out)  # the last silent frame
    video.deliver(1, frames(1), speech(1), span(1), False, video.clear_epoch)
    assert isinstance(await anext(frames_out), rtc.VideoFrame)
    assert isinstance(await anext(frames_out), rtc.AudioFrame)
    assert video.stats.turn_waits == [2], "the silent frame and the speech chunk's first frame were handed first"
