"""A small livekit-agents TTS of our own: espeak-ng speaks the text, no model service needed.

`EspeakTTS` is a non-streaming `livekit.agents.tts.TTS`: `synthesize(text)` runs `espeak-ng --stdout`
(a WAV file on stdout: 16-bit mono PCM at espeak-ng's native 22,050 Hz) and hands the PCM to the agent
pipeline through the framework's `AudioEmitter` in 100 ms frames. An agent uses it like any TTS plugin:
`AgentSession(tts=EspeakTTS())`, then `session.say(...)`.
"""

from __future__ import annotations

import asyncio
import io
import shutil
import wave

from livekit.agents import APIConnectionError, APIConnectOptions, tts, utils
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS

ESPEAK_SAMPLE_RATE = 22050  # espeak-ng's native output rate


class EspeakTTS(tts.TTS):
    """espeak-ng as a livekit-agents TTS. `voice` is an espeak-ng voice name, `words_per_minute` its -s."""

    def __init__(self, *, voice: str = "en-us", words_per_minute: int = 160, executable: str | None = None) -> None:
        super().__init__(capabilities=tts.TTSCapabilities(streaming=False), sample_rate=ESPEAK_SAMPLE_RATE,
                         num_channels=1)
        exe = executable or shutil.which("espeak-ng")
        if exe is None:
            raise RuntimeError("EspeakTTS: espeak-ng not found on PATH (Debian: apt-get install espeak-ng)")
        if not 80 <= words_per_minute <= 450:
            raise ValueError(f"words_per_minute: expected 80..450 (espeak-ng -s), got {words_per_minute}")
        self.executable, self.voice, self.words_per_minute = exe, voice, words_per_minute

    @property
    def model(self) -> str:
        return "espeak-ng"

    @property
    def provider(self) -> str:
        return "espeak-ng"

    def synthesize(self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> EspeakStream:
        return EspeakStream(tts=self, input_text=text, conn_options=conn_options)

    async def wav(self, text: str) -> bytes:
        """The WAV file espeak-ng writes for `text` (bytes); APIConnectionError when it fails."""
        proc = await asyncio.create_subprocess_exec(
            self.executable, "-v", self.voice, "-s", str(self.words_per_minute), "--stdout", text,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        if proc.returncode != 0 or not out:
            raise APIConnectionError(f"espeak-ng exited with {proc.returncode}: {err.decode(errors='replace')[:200]}")
        return out


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
