"""The served runtime on CPU (gloo, the tiny preset): `vivant worker --tensor-parallel N` forms its N DiT ranks and
its decoder rank itself and serves sessions from Redis (worker/serving/, docs/multi_gpu.md).

Real everything: redis-server (tests/conftest.py), the `vivant worker` process, its spawned ranks on loopback.
At 1 + 1, 2 + 1 and 4 + 1 ranks a session goes from the operator's claim to the lease's release; the fused flag
is flipped mid-session and every DiT rank switches at the same chunk (each rank's rank<r>.jsonl); the latents
the decoder rank received at TP = 2 and 4 equal TP = 1's; a rank killed mid-session ends it with its reason
within 10 s and leaks no lease; bad audio on rank 0 ends the session cleanly on every rank, which then serve
the next session; numerical faults on every chunk cost chunks on every rank in step, then end the session by
themselves; bad layouts are refused before anything is spawned.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import av
import numpy as np
import pytest
from polling import wait_for
from vivant.ports import free_port
from vivant.sessions.flags import FlagStore
from vivant.worker.serving.runner import EXIT_FAULT
from vivant.worker.serving.service import MAX_FAULTED_SECONDS, MAX_FAULTED_SESSIONS
from worker_proc import POOL, WorkerProcess, assignment, overflowing_checkpoint

FUSED, UNFUSED, NO_TP = "fused_gemm_all_reduce", "gemm_then_all_reduce", "no_tp"
FLIP_AT = 3  # the fused flag is set once the session reported this many chunks
CHUNKS = 8  # a session runs at least this many chunks before the operator ends it
RANK_TIMEOUT = "8"


def run_session(w: WorkerProcess, redis_url: str, session_id: str) -> dict:
    """Claim → assign → stream (the fused flag flipped on mid-session) → EndRequest → released."""
    flags = FlagStore(redis_url)
    flags.set(POOL, {"fusedGemmAllReduce": False}, actor="test")
    w.assign(session_id)
    w.streaming(session_id, FLIP_AT)
    flags.set(POOL, {"fusedGemmAllReduce": True}, actor="test")
    fused_version = flags.get(POOL).version
    # The session ends only once it reported a chunk run under the new flags, and runs CHUNKS chunks at least:
    # a fast machine can otherwise finish CHUNKS before the worker's next flag check (seen in CI).
    flipped = wait_for(f"{session_id} runs under flags v{fused_version}",
                       lambda: (s := w.stats(session_id)) and s.flag_version >= fused_version and s, 90, every=0.1)
    w.streaming(session_id, max(CHUNKS, flipped.chunks + 2))
    final = w.end(session_id)
    w.assert_released(session_id)
    return {"final": final, "traces": [w.trace(session_id, r) for r in range(w.tp + 1)],
            "latents": w.latents(session_id), "fused_version": fused_version}


def chunk_paths(trace: list[dict]) -> list[str]:
    return [e["path"] for e in trace if e["event"] == "chunk"]


def serve_one(tp: int, redis_server, tmp_path_factory, *extra: str) -> dict:
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    out = tmp_path_factory.mktemp(f"tp{tp}")
    w = WorkerProcess(redis_server.url, out, "--rank-timeout", RANK_TIMEOUT, *extra, worker_id=f"worker-tp{tp}", tp=tp)
    try:
        w.wait_idle()
        result = run_session(w, redis_server.url, f"ns/tp{tp}")
        result["worker"] = w
        result["idle_after"] = w.idle_again()
        result["pids"] = w.rank_pids()
    finally:
        result_code = w.stop()
    result["exit"] = result_code
    result["log"] = w.log()
    return result


@pytest.fixture(scope="module")
def tp1(redis_server, tmp_path_factory):
    """1 + 1 ranks, the pipeline runner (decoder + pacer → MP4), metrics served; idles longer than the ranks'
    collective timeout before its session, which only the IDLE ticks survive."""
    port = free_port()
    out = {"metrics_port": port}
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    folder = tmp_path_factory.mktemp("tp1")
    w = WorkerProcess(redis_server.url, folder, "--rank-timeout", RANK_TIMEOUT, "--runner", "pipeline",
                      "--metrics-port", str(port), "--metrics-addr", "127.0.0.1", worker_id="worker-tp1", tp=1)
    try:
        w.wait_idle()
        time.sleep(float(RANK_TIMEOUT) + 2)  # longer than a collective may wait: the ranks must be ticked
        out.update(run_session(w, redis_server.url, "ns/tp1"))
        out["metrics"] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        out["idle_after"] = w.idle_again()
        out["pids"] = w.rank_pids()
    finally:
        out["exit"] = w.stop()
    out["worker"], out["log"] = w, w.log()
    return out


@pytest.fixture(scope="module")
def tp2(redis_server, tmp_path_factory):
    return serve_one(2, redis_server, tmp_path_factory, "--runner", "pipeline")


@pytest.fixture(scope="module")
def tp4(redis_server, tmp_path_factory):
    return serve_one(4, redis_server, tmp_path_factory, "--runner", "generator", "--no-realtime")


def check_session(r: dict, tp: int) -> None:
    final = r["final"]
    assert final.phase == "Ended" and final.end_reason == "Deleted", final
    assert final.chunks >= CHUNKS and not final.numerical_fault, final
    assert r["idle_after"] == [f"worker-tp{tp}"], f"after the session the worker is not idle: {r['idle_after']}"
    assert r["exit"] == 0, f"SIGTERM should stop the worker with status 0, got {r['exit']}:\n{r['log'][-3000:]}"
    assert sorted(r["pids"]) == list(range(1, tp + 1)), f"spawned ranks {r['pids']}, expected 1 … {tp}"
    for rank, pid in r["pids"].items():
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", \
            f"rank {rank} (pid {pid}) outlived the worker"
    traces = r["traces"]
    chunks = [[e["chunk"] for e in t if e["event"] == "chunk"] for t in traces]
    assert all(c == list(range(final.chunks)) for c in chunks), \
        f"every rank (the decoder included) should have run chunks 0 … {final.chunks - 1}: {chunks}"
    assert all(t[-1]["event"] == "end" for t in traces), "a rank did not record the session's end"
    assert len(r["latents"]) == final.chunks, f"{len(r['latents'])} latents kept for {final.chunks} chunks"


def check_flag_flip(r: dict, tp: int) -> None:
    """Every DiT rank ran the same path at every chunk, and switched to the fused step at the same chunk."""
    paths = [chunk_paths(t) for t in r["traces"][:tp]]
    assert all(p == paths[0] for p in paths), f"DiT ranks disagree on the row-parallel path: {paths}"
    if tp == 1:
        assert set(paths[0]) == {NO_TP}, f"TP = 1 has nothing to fuse: {paths[0]}"
        return
    assert FUSED in paths[0], f"the session ended after reporting flags v{r['fused_version']} yet no rank ran fused: {paths[0]}"
    first = paths[0].index(FUSED)
    assert FLIP_AT <= first < len(paths[0]) and set(paths[0][:first]) == {UNFUSED} and set(paths[0][first:]) == {FUSED}, \
        f"expected unfused then fused from one chunk on, got {paths[0]}"


def test_one_plus_one_serves_a_session_from_claim_to_release(tp1):
    check_session(tp1, 1)
    check_flag_flip(tp1, 1)


def test_one_plus_one_decoder_rank_writes_the_video(tp1):
    final = tp1["final"]
    with av.open(str(tp1["worker"].folder("ns/tp1") / "video.mp4")) as f:
        frames = sum(1 for _ in f.decode(video=0))
    assert frames == 4 * final.chunks, f"{frames} frames in the MP4 for {final.chunks} chunks of 4"
    end = tp1["traces"][1][-1]
    assert end["error"] == "" and end["chunks"] == final.chunks, end


def test_kernel_path_metric_is_what_the_ranks_ran(tp1):
    """TP = 1 with the fused flag on: nothing to fuse, so the worker reports no_tp, not the requested path."""
    lines = [ln for ln in tp1["metrics"].splitlines() if ln.startswith("vivant_worker_kernel_path_info{")]
    assert any('path="no_tp"' in ln and f'flag_version="{tp1["fused_version"]}"' in ln for ln in lines), lines
    assert not any(f'path="{FUSED}"' in ln for ln in lines), f"reported the flag, not the path: {lines}"


def test_two_plus_one_serves_a_session_and_switches_every_rank_at_one_chunk(tp2):
    check_session(tp2, 2)
    check_flag_flip(tp2, 2)


@pytest.mark.slow
def test_four_plus_one_serves_a_session_and_switches_every_rank_at_one_chunk(tp4):
    check_session(tp4, 4)
    check_flag_flip(tp4, 4)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_tp2_latents_equal_tp1(tp1, tp2):
    n = min(len(tp1["latents"]), len(tp2["latents"]))
    err = _rel(tp2["latents"][:n], tp1["latents"][:n])
    assert err < 1e-4, f"TP = 2 (fused from chunk ≥ {FLIP_AT}) vs TP = 1 over {n} chunks: relative error {err:.3e}"
    assert err > 0 or n == 0, "TP = 2 equal to TP = 1 bit for bit: were the shards summed at all?"


@pytest.mark.slow
def test_tp4_latents_equal_tp1(tp1, tp4):
    n = min(len(tp1["latents"]), len(tp4["latents"]))
    err = _rel(tp4["latents"][:n], tp1["latents"][:n])
    assert err < 1e-4, f"TP = 4 vs TP = 1 over {n} chunks: relative error {err:.3e}"


# ---- faults -----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 2], ids=["dit-rank", "decoder-rank"])
def test_a_killed_rank_ends_the_session_with_its_reason_and_leaks_no_lease(redis_url, tmp_path, victim):
    w = WorkerProcess(redis_url, tmp_path, "--rank-timeout", RANK_TIMEOUT, worker_id="worker-kill", tp=2)
    try:
        w.wait_idle()
        w.assign("ns/kill")
        w.streaming("ns/kill", 2)
        pid = w.rank_pids()[victim]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        final = w.ended("ns/kill", timeout=10)
        took = time.monotonic() - t0
        role = "dit" if victim == 1 else "decoder"
        assert final.phase == "Failed", final
        assert final.end_reason == f"rank {victim} ({role}, cpu) pid {pid} died: killed by signal 9 (SIGKILL)", final
        assert took < 10, f"the session ended {took:.1f}s after the kill"
        w.assert_released("ns/kill")
        code = w.proc.wait(15)
    finally:
        w.stop(signal.SIGKILL) if w.proc.poll() is None else w._log.close()
    assert code == 3, f"after a rank failure the worker should exit with status 3, got {code}:\n{w.log()[-3000:]}"
    assert w.registry.idle_workers(POOL) == [] and w.registry.workers(POOL) == {}, "the dead worker is still registered"
    assert w.registry.worker_failures(POOL) == {"fault": 1, "lost": 0}, "the pool counts the worker's failure"
    for r, p in w.rank_pids().items():
        assert not os.path.exists(f"/proc/{p}") or open(f"/proc/{p}/stat").read().split()[2] == "Z", \
            f"rank {r} (pid {p}) was left running"


@pytest.mark.slow
def test_sigterm_to_every_rank_stops_the_worker_cleanly(redis_url, tmp_path):
    """What a terminal's Ctrl-C or a signal to the worker's whole process group does: every rank gets the signal
    (sent here to each of the worker's processes); the ranks leave stopping to rank 0, which ends the session
    (worker shutting down), releases it, shuts its ranks down and exits 0."""
    w = WorkerProcess(redis_url, tmp_path, "--rank-timeout", RANK_TIMEOUT, worker_id="worker-term", tp=1)
    try:
        w.wait_idle()
        w.assign("ns/term")
        w.streaming("ns/term", 2)
        for pid in [*w.rank_pids().values(), w.proc.pid]:
            os.kill(pid, signal.SIGTERM)
        final = w.ended("ns/term", timeout=30)
        assert (final.phase, final.end_reason) == ("Failed", "worker shutting down"), final
        w.assert_released("ns/term")
        code = w.proc.wait(30)
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
        w._log.close()
    assert code == 0, f"exit {code}:\n{w.log()[-3000:]}"
    assert "died" not in w.log(), "a rank died from the group's SIGTERM instead of being shut down by rank 0"
    assert w.registry.workers(POOL) == {}, "the stopped worker is still registered"
    assert w.registry.worker_failures(POOL) == {"fault": 0, "lost": 0}, "a clean stop is no failure"


def nan_speech(path, cfg_rate: int = 16_000, seconds: float = 1.5, nan_from_s: float = 0.6) -> int:
    """A float32 WAV at the model's rate with NaN samples from `nan_from_s` on; returns the first bad chunk."""
    x = (0.3 * np.sin(np.arange(int(seconds * cfg_rate)) * 0.05)).astype(np.float32)
    x[int(nan_from_s * cfg_rate):] = np.nan
    with av.open(str(path), "w", format="wav") as f:
        stream = f.add_stream("pcm_f32le", rate=cfg_rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(x.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = cfg_rate
        for packet in stream.encode(frame):
            f.mux(packet)
        for packet in stream.encode(None):
            f.mux(packet)
    return int(nan_from_s * cfg_rate) // 2666  # the tiny grid: 2666 or 2667 samples per chunk


def test_bad_audio_on_rank0_ends_the_session_cleanly_on_every_rank(redis_url, tmp_path):
    bad_chunk = nan_speech(tmp_path / "speech.wav")
    w = WorkerProcess(redis_url, tmp_path, "--rank-timeout", RANK_TIMEOUT, "--runner", "pipeline",
                      "--speak", str(tmp_path / "speech.wav"), worker_id="worker-bad", tp=2)
    try:
        w.wait_idle()
        for session in ("ns/bad1", "ns/bad2"):  # the second one shows every rank came back in a clean state
            w.assign(session)
            final = w.ended(session)
            assert final.phase == "Failed", final
            assert final.end_reason.startswith(f"bad input: audio for chunk {bad_chunk}: "), final
            assert "samples are not finite (NaN/Inf)" in final.end_reason, final
            w.assert_released(session)
            wait_for("idle again", lambda: w.registry.idle_workers(POOL) == ["worker-bad"], 10)
            for r in range(3):
                t = w.trace(session, r)
                chunks = [e["chunk"] for e in t if e["event"] == "chunk"]
                assert chunks == list(range(bad_chunk)), f"rank {r} ran chunks {chunks}; expected 0 … {bad_chunk - 1}"
                assert t[-1]["event"] == "end", f"rank {r} did not end session {session}: {t[-1]}"
            decoder_end = w.trace(session, 2)[-1]
            assert decoder_end["error"] == "" and decoder_end["chunks"] == bad_chunk, decoder_end
    finally:
        code = w.stop()
    assert code == 0, f"bad input must not stop the worker (exit {code}):\n{w.log()[-3000:]}"


def test_numerical_faults_end_the_session_and_three_in_a_row_stop_the_worker(redis_url, tmp_path):
    """2 + 1 ranks on a checkpoint whose every chunk overflows: each DiT rank restarts its model state after each chunk
    at the same boundary (they run in step, or rank 0 would refuse them), the session's chunk count goes on on every
    rank and on the decoder rank (which holds its last frame instead of decoding NaN), and after 5 s of video made
    of faulted chunks the session ends Failed by itself, naming the fault; the worker serves on. When such faults end
    MAX_FAULTED_SESSIONS sessions in a row, the worker process exits with the rank-failure code (3) and leaves the
    registry, so Kubernetes restarts its container; no session is left leased."""
    limit = round(MAX_FAULTED_SECONDS * 6)  # chunks: 1/6 s each
    w = WorkerProcess(redis_url, tmp_path, "--rank-timeout", RANK_TIMEOUT, "--runner", "pipeline",
                      "--checkpoint", str(overflowing_checkpoint(tmp_path)), worker_id="worker-nan", tp=2)
    try:
        w.wait_idle()
        w.assign("ns/nan")
        final = w.ended("ns/nan")
        w.assert_released("ns/nan")
        assert final.phase == "Failed" and final.numerical_fault and final.chunks == limit, final
        assert final.end_reason.startswith(f"numerical fault: {limit} chunks in a row with NaN/Inf latents"), final
        for r in range(2):
            chunks = [e["chunk"] for e in w.trace("ns/nan", r) if e["event"] == "chunk"]
            assert chunks == list(range(limit)), f"rank {r} ran chunks {chunks}"
        decoder = w.trace("ns/nan", 2)
        end = decoder[-1]
        assert end["error"] == "" and end["chunks"] == limit, end
        flags = [e["finite"] for e in decoder if e["event"] == "chunk"]
        assert flags == [False] * limit, f"the generator's fault flag did not reach the decoder rank: {flags}"
        with av.open(str(w.folder("ns/nan") / "video.mp4")) as f:
            frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
        assert len(frames) == 4 * limit, f"{len(frames)} frames for {limit} chunks of 4"
        assert max(int(fr.max()) for fr in frames) <= 16, "a faulted chunk was decoded: expected held black frames"
        wait_for("idle again", lambda: w.registry.idle_workers(POOL) == ["worker-nan"], 10)
        assert w.proc.poll() is None, "one faulted session must not stop the worker"
        for n in range(2, MAX_FAULTED_SESSIONS + 1):
            if n > 2:
                wait_for("idle again", lambda: w.registry.idle_workers(POOL) == ["worker-nan"], 10)
            w.assign(f"ns/nan-{n}")
            final = w.ended(f"ns/nan-{n}")
            w.assert_released(f"ns/nan-{n}")
            assert final.phase == "Failed" and final.numerical_fault, final
        code = w.proc.wait(30)
    finally:
        stopped = w.stop()
    assert code == stopped == EXIT_FAULT, (
        f"{MAX_FAULTED_SESSIONS} faulted sessions in a row: expected exit {EXIT_FAULT}, got {code}:\n{w.log()[-3000:]}")
    assert w.registry.workers(POOL) == {}, "the stopped worker is still registered"
    assert w.registry.worker_failures(POOL) == {"fault": 1, "lost": 0}, "the pool counts the worker's failure"
    assert f"numerical faults ended {MAX_FAULTED_SESSIONS} sessions in a row" in w.log(), w.log()[-3000:]


# ---- bad layouts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--tensor-parallel", "3"], "n_heads = 4 does not divide by tp = 3"),
    (["--tensor-parallel", "0"], "tensor_parallel = 0; expected a positive integer"),
    (["--tensor-parallel", "two"], "tensor-parallel: expected a positive integer"),
    (["--decoder-device", "gpu7"], "decoder-device: expected one of own, shared"),
    (["--device", "tpu"], "device: expected cpu, cuda or auto"),
    (["--runner", "webrtc"], "runner: expected one of generator, pipeline, livekit"),
    (["--engine", "turbo"], "engine: expected one of auto, fast, model"),
    (["--mode", "ring"], "mode: expected one of optimized, baseline"),
    (["--device", "cuda", "--tensor-parallel", "2"], "needs 3 GPUs; this host has 0"),
    (["--checkpoint", "weights.safetensors"], "checkpoint: expected an absolute path"),
    (["--vae-widths", "16"], "vae-widths: expected at least two positive integers, comma-separated, got '16'"),
    (["--vae-widths", "16,x"], "vae-widths: expected at least two positive integers"),
])
def test_bad_layouts_are_refused_before_anything_is_spawned(redis_url, capsys, args, message):
    from vivant.cli import main
    from vivant.sessions.registry import Registry

    code = main(["worker", "--pool", POOL, "--redis", redis_url, "--preset", "tiny", *args])
    out = capsys.readouterr().out
    assert code == 2, f"{args}: expected exit status 2, got {code}: {out}"
    assert message in out, f"{args}: {out!r} does not name the problem ({message!r})"
    assert Registry(redis_url).workers(POOL) == {}, f"{args}: a refused worker registered"


@pytest.mark.slow
def test_livekit_runner_that_cannot_reach_its_room_fails_the_session_and_stays_idle(redis_url, tmp_path):
    """`--runner livekit`: the decoder rank joins the assignment's room for real; with no LiveKit server listening
    the join is refused, the session is reported Failed with the decoder rank's connect error (never the token),
    every rank ends it, and the worker is idle again for the next session."""
    w = WorkerProcess(redis_url, tmp_path, "--rank-timeout", RANK_TIMEOUT, "--runner", "livekit",
                      worker_id="worker-lk", tp=1)
    try:
        w.wait_idle()
        a = assignment("ns/lk", livekit_url=f"ws://127.0.0.1:{free_port()}")
        assert w.registry.claim_idle_worker(POOL, "ns/lk") == "worker-lk"
        w.registry.send_assignment("worker-lk", a)
        final = w.ended("ns/lk", timeout=90)
        assert final.phase == "Failed" and final.end_reason.startswith("rank 1 (decoder, cpu): "), final
        assert "tok-secret" not in final.model_dump_json(), "the token leaked into the session's stats"
        w.assert_released("ns/lk")
        assert w.idle_again() == ["worker-lk"], "the worker should serve the next session"
        ends = [w.trace("ns/lk", r)[-1] for r in range(2)]
        assert all(e["event"] == "end" for e in ends) and ends[1]["error"], ends
    finally:
        code = w.stop()
    assert code == 0, w.log()[-3000:]
    assert "tok-secret" not in w.log(), "the LiveKit token appeared in the worker's log"
