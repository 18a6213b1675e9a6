"""Audio out, every way cosyllama writes it: the 16-bit conversions, files (``cosyllama synth``'s WAV,
``cosyllama batch``'s wav/flac), whole bodies in bytes and the streaming encoder (the HTTP server's
wav, pcm, flac, mp3, opus, aac; Wyoming's 16-bit PCM). No server dependencies; soundfile and PyAV
(aac, the ``aac`` extra) are imported when first used.

Two 16-bit conversions, kept apart because the bytes written must stay what they are:
:func:`pcm16` (clip to [-1, 1], times 32767, round half to even) for what the servers send, and
libsndfile's own (:func:`sndfile_pcm16`) for the files ``synth`` and ``batch`` write.

mp3 and opus are encoded by libsndfile (through soundfile): mp3 at a constant 80 kbit/s (MPEG-2
layer III at 24 kHz), opus in an Ogg container at libsndfile's default bitrate. Streamed, an
encoder's output goes out as libsndfile writes it:

* Ogg/Opus is written front to back, so a stream is byte for byte a file. Its pages are cut every
  100 ms of audio (libsndfile's default, 1 s, would hold back most of a chunk until the next one).
* An mp3 file's first frame is a placeholder that libsndfile fills at the end with the LAME tag
  (length, and how much encoder delay and padding to trim); a stream cannot go back for it, so a
  streamed mp3 starts with a silent frame and decoders also play the delay and padding: up to
  about 0.1 s more (silent) audio than the whole file has.
* flac goes back to write its header at the end too: a streamed flac body is the whole file, sent
  when it is complete.
* aac is ADTS (a header on every frame, as OpenAI sends it), written front to back by FFmpeg's
  encoder at 64 kbit/s, so a stream is byte for byte a file.
"""

from __future__ import annotations

import io
import logging
import struct
from pathlib import Path

import numpy as np

from .errors import InputError, MissingDependencyError

log = logging.getLogger("cosyllama.server")


def pcm16(samples: np.ndarray) -> bytes:
    """float32 samples in [-1, 1] -> 16-bit little-endian PCM (clipped): what the servers send."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def sndfile_pcm16(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    """The int16 samples libsndfile stores when it writes these floats as a 16-bit WAV (as
    ``cosyllama synth`` does); its FLAC writer would round differently."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, sample_rate, subtype="PCM_16", format="WAV")
    buf.seek(0)
    return sf.read(buf, dtype="int16")[0]


# ----------------------------------------------------------------------------------------------
# Files

FILE_FORMATS = ("wav", "flac")  # what `cosyllama batch --format` writes, 16-bit
WAV_SUBTYPES = {"pcm16": "PCM_16", "float": "FLOAT"}  # `cosyllama synth --out-format`


def write_file(file, samples: np.ndarray, sample_rate: int, fmt: str = "wav", subtype: str = "pcm16") -> None:
    """Mono audio to ``file`` (a path or an open binary file) as ``fmt`` (one of :data:`FILE_FORMATS`):
    ``subtype`` ``"pcm16"`` (16-bit; the same libsndfile samples in every format) or ``"float"``
    (32-bit float, wav only)."""
    import soundfile as sf

    samples = np.asarray(samples, dtype=np.float32)
    if fmt not in FILE_FORMATS or subtype not in WAV_SUBTYPES or (subtype == "float" and fmt != "wav"):
        raise ValueError(f"cannot write {fmt} at {subtype}; formats: {', '.join(FILE_FORMATS)} (float: wav)")
    if fmt != "wav":  # the same 16-bit samples in every format
        samples = sndfile_pcm16(samples, sample_rate)
    sf.write(file, samples, sample_rate, subtype=WAV_SUBTYPES[subtype], format=fmt.upper())


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int, out_format: str = "pcm16") -> None:
    """A mono WAV file; 16-bit PCM (default) or 32-bit float (``out_format="float"``). A file that
    cannot be written is an :class:`~cosyllama.errors.InputError` naming it."""
    try:
        write_file(path, samples, sample_rate, "wav", out_format)
    except (OSError, RuntimeError) as e:
        raise InputError(f"cannot write {str(path)!r}: {e}") from e


# ----------------------------------------------------------------------------------------------
# Bodies: whole, and chunk by chunk

PCM_BYTES = 2  # 16-bit samples on the wire
# the encodings of a response body (the server's response_format; cosyllama.server.wire has their media types)
FORMATS = ("mp3", "wav", "pcm", "flac", "opus", "aac")
# formats whose encoder can send its output as it goes; flac is whole (its header is written last)
STREAMABLE = ("mp3", "wav", "pcm", "opus", "aac")
AAC_BITRATE = 64_000
# soundfile.SoundFile arguments of the formats libsndfile encodes
_SOUNDFILE = {
    "flac": {"format": "FLAC", "subtype": "PCM_16"},
    # compression_level 0.5 at constant bitrate: 80 kbit/s at 24 kHz; a constant bitrate also lets
    # readers of a streamed file (no LAME tag) compute its length from its size
    "mp3": {"format": "MP3", "subtype": "MPEG_LAYER_III", "bitrate_mode": "CONSTANT", "compression_level": 0.5},
    "opus": {"format": "OGG", "subtype": "OPUS"},
}


def wav_header(sample_rate: int, n_data_bytes: int | None) -> bytes:
    """44-byte RIFF/WAVE header for 16-bit mono PCM. ``None``: unknown length (streaming), written
    as the largest size, which players read as "until the end of the stream"."""
    data = 0xFFFFFFFF if n_data_bytes is None else n_data_bytes
    riff = 0xFFFFFFFF if n_data_bytes is None else 36 + n_data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * PCM_BYTES, PCM_BYTES, 16)
            + b"data" + struct.pack("<I", data))


def _sf_samples(samples: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "flac":  # the same 16-bit samples as wav/pcm (soundfile's own float rounding differs)
        return np.frombuffer(pcm16(samples), "<i2")
    return np.clip(samples, -1.0, 1.0).astype(np.float32, copy=False)


def encode(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """A whole response body in ``fmt`` (one of :data:`FORMATS`) as bytes."""
    if fmt == "aac":
        enc = _AacEncoder(sample_rate)
        return enc.write(samples) + enc.close()
    if fmt in _SOUNDFILE:
        import soundfile as sf

        buf = io.BytesIO()
        sf.write(buf, _sf_samples(samples, fmt), sample_rate, **_SOUNDFILE[fmt])
        return buf.getvalue()
    body = pcm16(samples)
    return wav_header(sample_rate, len(body)) + body if fmt == "wav" else body


class _Outbox(io.RawIOBase):
    """A write-only file for libsndfile whose bytes leave as they are written: :meth:`take`
    returns what was written since the last call. A write into bytes already taken (an encoder
    going back to fill in a header) cannot be sent and is dropped."""

    def __init__(self):
        super().__init__()
        self.sent = 0  # bytes taken so far
        self.pending = bytearray()  # bytes from offset `sent` on
        self.pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def write(self, data) -> int:
        data = bytes(data)
        n = len(data)
        skip = max(0, self.sent - self.pos)  # the part that falls on bytes already sent
        start = self.pos + skip - self.sent
        if skip < n:
            if start > len(self.pending):
                self.pending.extend(bytes(start - len(self.pending)))
            self.pending[start:start + n - skip] = data[skip:]
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.sent + len(self.pending)}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, size: int = -1) -> bytes:
        return b""  # encoders do not read back what they wrote

    def take(self) -> bytes:
        out = bytes(self.pending)
        self.sent += len(out)
        self.pending.clear()
        return out


OGG_PAGE_MS = 100.0  # audio per Ogg page of a streamed opus response
_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302  # libsndfile's sf_command for it (sndfile.h, libsndfile >= 1.0.29)
_warned_page_latency = False


def _set_ogg_page_latency(f, ms: float) -> None:
    """Cut the Ogg pages of ``f`` (a soundfile.SoundFile being written) every ``ms`` of audio.
    soundfile has no call for this libsndfile command, so it goes through soundfile's handle on
    the library; a soundfile without one keeps 1 s pages, and the log says so once."""
    global _warned_page_latency
    import soundfile as sf

    try:
        value = sf._ffi.new("double *", ms)
        sf._snd.sf_command(f._file, _SFC_SET_OGG_PAGE_LATENCY_MS, value, sf._ffi.sizeof("double"))
    except AttributeError:
        if not _warned_page_latency:
            _warned_page_latency = True
            log.warning(
                "streamed opus goes out in 1 s pages: soundfile %s has no handle on libsndfile to ask for "
                "%g ms ones", sf.__version__, ms)


AAC_HINT = "aac needs PyAV: pip install 'cosyllama[aac]'"


def _import_av():
    try:
        import av
    except ImportError as e:
        raise MissingDependencyError(AAC_HINT) from e
    return av


def aac_available() -> bool:
    """Whether PyAV can be imported (the ``aac`` extra)."""
    try:
        _import_av()
    except MissingDependencyError:
        return False
    return True


class _AacEncoder:
    """ADTS AAC through PyAV (FFmpeg's native encoder): :meth:`write` returns the frames ready."""

    def __init__(self, sample_rate: int):
        from fractions import Fraction

        av = _import_av()
        self._av, self._rate, self._n = av, sample_rate, 0
        self._out = _Outbox()
        # flush_packets: each frame leaves FFmpeg's I/O buffer as soon as it is muxed
        self._container = av.open(self._out, mode="w", format="adts", container_options={"flush_packets": "1"})
        self._stream = self._container.add_stream("aac", rate=sample_rate)
        self._stream.layout = "mono"
        self._stream.bit_rate = AAC_BITRATE
        self._time_base = Fraction(1, sample_rate)

    def _mux(self, frame) -> None:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def write(self, samples: np.ndarray) -> bytes:
        if samples.size:
            x = np.ascontiguousarray(np.clip(samples, -1.0, 1.0), dtype=np.float32).reshape(1, -1)
            frame = self._av.AudioFrame.from_ndarray(x, format="flt", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = self._rate, self._n, self._time_base
            self._n += x.shape[1]
            self._mux(frame)
        return self._out.take()

    def close(self) -> bytes:
        if self._container is None:
            return b""
        self._mux(None)
        self._container.close()
        self._container = None
        return self._out.take()


class StreamEncoder:
    """A response body in ``fmt`` (one of :data:`FORMATS`), chunk by chunk: :meth:`write` returns
    the bytes ready to send (possibly none), :meth:`close` the rest. flac is kept until :meth:`close`,
    which returns the whole file (the same bytes as :func:`encode`)."""

    def __init__(self, fmt: str, sample_rate: int):
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
        self.fmt, self.sample_rate = fmt, sample_rate
        self._header = wav_header(sample_rate, None) if fmt == "wav" else b""
        self._out = self._file = self._aac = None
        self._whole: list[np.ndarray] | None = [] if fmt not in STREAMABLE else None
        if fmt == "aac":
            self._aac = _AacEncoder(sample_rate)
        elif fmt in _SOUNDFILE and fmt in STREAMABLE:
            import soundfile as sf

            self._out = _Outbox()
            self._file = sf.SoundFile(self._out, "w", samplerate=sample_rate, channels=1, **_SOUNDFILE[fmt])
            if fmt == "opus":
                _set_ogg_page_latency(self._file, OGG_PAGE_MS)

    def _head(self) -> bytes:
        head, self._header = self._header, b""
        return head

    def write(self, samples: np.ndarray) -> bytes:
        if self._whole is not None:
            self._whole.append(samples)
            return b""
        if self._aac is not None:
            return self._aac.write(samples)
        if self._file is None:
            return self._head() + pcm16(samples)
        if samples.size:
            self._file.write(_sf_samples(samples, self.fmt))
        return self._out.take()

    def close(self) -> bytes:
        """The end of the stream (idempotent: later calls return nothing)."""
        if self._whole is not None:
            parts, self._whole = self._whole, None
            return encode(np.concatenate(parts) if parts else np.zeros(0, np.float32), self.sample_rate, self.fmt)
        if self._aac is not None:
            aac, self._aac = self._aac, None
            return aac.close()
        if self._file is None:
            return self._head()
        self._file.close()
        self._file = None
        tail = self._out.take()
        self._out = None
        self._header = b""
        return tail


__all__ = ["AAC_HINT", "FILE_FORMATS", "FORMATS", "PCM_BYTES", "STREAMABLE", "WAV_SUBTYPES", "StreamEncoder",
           "aac_available", "encode", "pcm16", "sndfile_pcm16", "wav_header", "write_file", "write_wav"]
