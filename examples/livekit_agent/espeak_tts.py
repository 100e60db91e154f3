"""A small livekit-agents TTS of our own: espeak-ng speaks the text, no model service needed.

`EspeakTTS` is a non-streaming `livekit.agents.tts.TTS`: `synthesize(text)` runs `espeak-ng --stdout`
(a WAV file on stdout: 16-bit mono PCM at espeak-ng's native 22,050 Hz) and hands the PCM to the agent
pipeline through the framework's `AudioEmitter` in 100 ms frames. An agent uses it like any TTS plugin:
`AgentSession(tts=EspeakTTS())`, then `session.say(...)`.

With `cache_dir` (env `VIVANT_TTS_CACHE` in the example agent), a sentence already spoken is read back from
`<cache_dir>/<key>.wav` (`cache_key`: voice, rate and text) instead of running espeak-ng again, and a new one is
written there; `fill_cache` speaks a script ahead of time. That lets the scripted call run on a machine without
espeak-ng (the GPU machine), its speech made beforehand where espeak-ng exists.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import shutil
import subprocess
import wave
from pathlib import Path

from livekit.agents import APIConnectionError, APIConnectOptions, tts, utils
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS

ESPEAK_SAMPLE_RATE = 22050  # espeak-ng's native output rate


class EspeakTTS(tts.TTS):
    """espeak-ng as a livekit-agents TTS. `voice` is an espeak-ng voice name, `words_per_minute` its -s."""

    def __init__(self, *, voice: str = "en-us", words_per_minute: int = 160, executable: str | None = None,
                 cache_dir: str | Path | None = None) -> None:
        super().__init__(capabilities=tts.TTSCapabilities(streaming=False), sample_rate=ESPEAK_SAMPLE_RATE,
                         num_channels=1)
        exe = executable or shutil.which("espeak-ng")
        if exe is None and cache_dir is None:
            raise RuntimeError("EspeakTTS: espeak-ng not found on PATH (Debian: apt-get install espeak-ng) and no "
                               "cache_dir of speech made beforehand")
        if not 80 <= words_per_minute <= 450:
            raise ValueError(f"words_per_minute: expected 80..450 (espeak-ng -s), got {words_per_minute}")
        self.executable, self.voice, self.words_per_minute = exe, voice, words_per_minute
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None

    @property
    def model(self) -> str:
        return "espeak-ng"

    @property
    def provider(self) -> str:
        return "espeak-ng"

    def synthesize(self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> EspeakStream:
        return EspeakStream(tts=self, input_text=text, conn_options=conn_options)

    def cached(self, text: str) -> Path | None:
        """Where `text`'s WAV file is (or would be) kept; None without a cache."""
        if self.cache_dir is None:
            return None
        return self.cache_dir / f"{cache_key(self.voice, self.words_per_minute, text)}.wav"

    def command(self, text: str) -> list[str]:
        return [self.executable, "-v", self.voice, "-s", str(self.words_per_minute), "--stdout", text]

    async def wav(self, text: str) -> bytes:
        """The WAV file espeak-ng writes for `text` (bytes), from the cache when it holds it; APIConnectionError when
        espeak-ng fails or is missing and the cache lacks the sentence."""
        path = self.cached(text)
        if path is not None and path.is_file():
            return path.read_bytes()
        if self.executable is None:
            raise APIConnectionError(f"EspeakTTS: {path} is not in the speech cache and espeak-ng is not installed")
        proc = await asyncio.create_subprocess_exec(*self.command(text), stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        if proc.returncode != 0 or not out:
            raise APIConnectionError(f"espeak-ng exited with {proc.returncode}: {err.decode(errors='replace')[:200]}")
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(out)
        return out

    def fill_cache(self, texts: list[str]) -> list[Path]:
        """Speak each of `texts` into the cache now (blocking; needs espeak-ng); returns the files."""
        if self.cache_dir is None or self.executable is None:
            raise RuntimeError("EspeakTTS.fill_cache: needs a cache_dir and espeak-ng")
        paths = []
        for text in texts:
            path = self.cached(text)
            if not path.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(subprocess.run(self.command(text), capture_output=True, check=True).stdout)
            paths.append(path)
        return paths


def cache_key(voice: str, words_per_minute: int, text: str) -> str:
    """A file name for one sentence spoken by one voice at one rate."""
    return hashlib.sha256(f"{voice}\n{words_per_minute}\n{text}".encode()).hexdigest()[:24]


def wav_to_pcm(data: bytes) -> tuple[bytes, int, int]:
    """(16-bit interleaved PCM, sample rate in Hz, channels) of a WAV file; ValueError when it is not 16-bit."""
    with wave.open(io.BytesIO(data)) as w:
        if w.getsampwidth() != 2:
            raise ValueError(f"espeak-ng WAV: expected 16-bit samples, got {8 * w.getsampwidth()}-bit")
        return w.readframes(w.getnframes()), w.getframerate(), w.getnchannels()


class EspeakStream(tts.ChunkedStream):
    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        assert isinstance(self._tts, EspeakTTS)
        pcm, rate, channels = wav_to_pcm(await self._tts.wav(self.input_text))
        output_emitter.initialize(request_id=utils.shortuuid("espeak-"), sample_rate=rate, num_channels=channels,
                                  mime_type="audio/pcm", frame_size_ms=100)
        output_emitter.push(pcm)
        output_emitter.flush()
