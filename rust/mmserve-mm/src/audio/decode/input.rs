//! The audio's open input: the bytes under the audio demuxers' whitelist, its headers read as
//! torchcodec reads them, the audio stream chosen and checked against the caps.

use std::ptr;

use ff::ffi;
use ffmpeg_next as ff;

use super::{AudioInfo, AudioLimits};
use crate::audio::error::AudioError;
use crate::audio::format::AudioFormat;
use crate::common::ffmpeg::{
    ff_failure, probe_format, FfError, InputLimits, MemoryInput, ProbeError,
};

/// The codecs decoded (libavcodec's ids): PCM in the byte orders and sizes WAV and MP4 hold,
/// A-law and mu-law, FLAC, MP3, Vorbis, Opus and AAC.
const CODECS: [ff::codec::Id; 19] = {
    use ff::codec::Id;
    [
        Id::PCM_U8,
        Id::PCM_S16LE,
        Id::PCM_S16BE,
        Id::PCM_S24LE,
        Id::PCM_S24BE,
        Id::PCM_S32LE,
        Id::PCM_S32BE,
        Id::PCM_F32LE,
        Id::PCM_F32BE,
        Id::PCM_F64LE,
        Id::PCM_F64BE,
        Id::PCM_ALAW,
        Id::PCM_MULAW,
        Id::FLAC,
        Id::MP3,
        Id::VORBIS,
        Id::OPUS,
        Id::AAC,
        Id::PCM_S8,
    ]
};

impl From<FfError> for AudioError {
    fn from(e: FfError) -> AudioError {
        match e {
            FfError::Deadline => AudioError::Deadline,
            FfError::TooManyStreams { limit } => AudioError::TooManyStreams { limit },
            other => AudioError::Corrupt(other.describe()),
        }
    }
}

/// An FFmpeg error met while `doing` something, as an [`AudioError`].
pub(super) fn ff_error(doing: &'static str) -> impl Fn(ff::Error) -> AudioError {
    let failure = ff_failure(doing);
    move |e| AudioError::from(failure(e))
}

/// libavformat probes the content of 16-bit PCM in WAV, in case it hides a compressed stream,
/// over up to 32 packets (128 KiB), running every demuxer's probe on it six times over: most
/// of the cost of opening a WAV file. Its first packet tells as much for audio that is PCM.
const WAV_PROBE_BYTES: i64 = 4096;
/// The WAV demuxer's packets once the headers are read: 32 KiB (0.19 s of CD audio) where it
/// reads 4 KiB by default, which spares most of the per-packet work of demuxing, decoding and
/// resampling. Set after the headers, whose reading probes the first packet's content. The
/// samples do not depend on it: a PCM packet decodes to its bytes' samples, and the
/// resampler's output to how its input is cut.
const WAV_PACKET_BYTES: i64 = 32 * 1024;

impl AudioLimits {
    /// The input's limits; `format` is the probed one, which decides how far libavformat may
    /// read ahead.
    pub(super) fn input(&self, format: Option<AudioFormat>) -> InputLimits {
        InputLimits {
            max_streams: self.max_streams,
            deadline: self.deadline,
            probe_bytes: (format == Some(AudioFormat::Wav)).then_some(WAV_PROBE_BYTES),
        }
    }
}

/// An open audio input and what its headers say.
pub(super) struct AudioInput<'a> {
    pub(super) source: MemoryInput<'a>,
    pub(super) info: AudioInfo,
    /// The audio stream's index, time base and first timestamp (0 where none is given).
    pub(super) index: usize,
    pub(super) time_base: ff::Rational,
    pub(super) start_time: Option<i64>,
    /// Whether packets were read (the input is no longer at its start).
    pub(super) read_packets: bool,
}

impl<'a> AudioInput<'a> {
    pub(super) fn open(
        data: &'a [u8],
        declared: Option<AudioFormat>,
        limits: &AudioLimits,
    ) -> Result<AudioInput<'a>, AudioError> {
        let demuxers = AudioFormat::ALL.map(AudioFormat::demuxer);
        let format = probe_format(data, &demuxers).map_err(|e| match e {
            ProbeError::Unknown => AudioError::UnknownFormat,
            ProbeError::NotAllowed(name) => AudioError::UnsupportedContainer(name),
        })?;
        let found = AudioFormat::from_demuxer(&format.name()).ok_or(AudioError::UnknownFormat)?;
        if let Some(declared) = declared.filter(|&d| d != found) {
            return Err(AudioError::FormatMismatch {
                declared: declared.name().into(),
                found: found.name().into(),
            });
        }
        let mut source = MemoryInput::open(data, format, &limits.input(Some(found)))?;
        // As torchcodec does: where the headers leave the sample format, the layout or the
        // first timestamp to the bitstream, libavformat reads (and decodes) the first packets.
        // SAFETY: the format context is live; null options.
        let ret =
            unsafe { ffi::avformat_find_stream_info(source.input.as_mut_ptr(), ptr::null_mut()) };
        if ret < 0 {
            return Err(ff_error("reading the stream info")(ff::Error::from(ret)));
        }
        limits.input(None).check_deadline()?;
        if found == AudioFormat::Wav {
            // SAFETY: the format context is live and its private data is the wav demuxer's,
            // which takes the option (an option it did not take would leave it unset).
            unsafe {
                let ctx = source.input.as_mut_ptr();
                ffi::av_opt_set_int((*ctx).priv_data, c"max_size".as_ptr(), WAV_PACKET_BYTES, 0);
            }
        }
        if source.input.nb_streams() as usize > limits.max_streams {
            return Err(AudioError::TooManyStreams {
                limit: limits.max_streams,
            });
        }
        let index = best_audio_stream(&mut source)?;
        let stream = source
            .input
            .stream(index)
            .ok_or(AudioError::NoAudioStream)?;
        let parameters = stream.parameters();
        let codec = parameters.id();
        if !CODECS.contains(&codec) {
            return Err(AudioError::UnsupportedCodec(codec.name().to_owned()));
        }
        // SAFETY: the parameters pointer is valid while the stream is.
        let (sample_rate, channels) = unsafe {
            let p = parameters.as_ptr();
            ((*p).sample_rate, (*p).ch_layout.nb_channels)
        };
        let sample_rate = u32::try_from(sample_rate)
            .ok()
            .filter(|&r| r > 0 && r <= limits.max_sample_rate)
            .ok_or_else(|| {
                AudioError::BadStream(format!(
                    "its sample rate {sample_rate} Hz is outside 1..={} Hz",
                    limits.max_sample_rate
                ))
            })?;
        let channels = u32::try_from(channels)
            .ok()
            .filter(|&c| c > 0 && c <= limits.max_channels)
            .ok_or_else(|| {
                AudioError::BadStream(format!(
                    "it has {channels} channels, outside 1..={}",
                    limits.max_channels
                ))
            })?;
        let time_base = stream.time_base();
        let start_time = Some(stream.start_time()).filter(|&t| t != ffi::AV_NOPTS_VALUE);
        let duration_s = header_duration(&source, &stream);
        if let Some(seconds) = duration_s {
            if seconds > limits.max_duration_s {
                return Err(AudioError::TooLong {
                    seconds,
                    limit: limits.max_duration_s,
                });
            }
        }
        let info = AudioInfo {
            container: source.container.clone(),
            codec: codec.name().to_owned(),
            sample_rate,
            channels,
            duration_s,
        };
        // Only the audio stream's packets are wanted.
        // SAFETY: the format context and its streams are live; only `discard` is written.
        unsafe {
            let ctx = source.input.as_mut_ptr();
            for i in 0..(*ctx).nb_streams as usize {
                if i != index {
                    (**(*ctx).streams.add(i)).discard = ffi::AVDiscard::AVDISCARD_ALL;
                }
            }
        }
        Ok(AudioInput {
            source,
            info,
            index,
            time_base,
            start_time,
            read_packets: false,
        })
    }
}

/// The stream torchcodec picks: libavformat's best audio stream among those it has a decoder
/// for.
fn best_audio_stream(source: &mut MemoryInput<'_>) -> Result<usize, AudioError> {
    let mut decoder: *const ffi::AVCodec = ptr::null();
    // SAFETY: the format context is live; `decoder` receives a static codec or stays null.
    let index = unsafe {
        ffi::av_find_best_stream(
            source.input.as_mut_ptr(),
            ffi::AVMediaType::AVMEDIA_TYPE_AUDIO,
            -1,
            -1,
            &mut decoder,
            0,
        )
    };
    if index == ffi::AVERROR_DECODER_NOT_FOUND {
        // An audio stream, but none libavcodec can decode: name its codec.
        let codec = source
            .input
            .streams()
            .find(|s| s.parameters().medium() == ff::media::Type::Audio)
            .map_or_else(
                || "unknown".to_owned(),
                |s| s.parameters().id().name().to_owned(),
            );
        return Err(AudioError::UnsupportedCodec(codec));
    }
    usize::try_from(index).map_err(|_| AudioError::NoAudioStream)
}

/// The duration the headers state, in seconds: the stream's, else the container's when the
/// stream is its only one (a container's duration may be another stream's); none when
/// libavformat only estimated it from the bitrate.
fn header_duration(source: &MemoryInput<'_>, stream: &ff::format::stream::Stream) -> Option<f64> {
    // SAFETY: the format context is live; the field is only read.
    let method = unsafe { (*source.input.as_ptr()).duration_estimation_method };
    if method == ffi::AVDurationEstimationMethod::AVFMT_DURATION_FROM_BITRATE {
        return None;
    }
    let time_base = f64::from(stream.time_base());
    if stream.duration() > 0 && time_base > 0.0 {
        return Some(stream.duration() as f64 * time_base);
    }
    let container = source.input.duration();
    (container > 0 && source.input.nb_streams() == 1)
        .then(|| container as f64 / f64::from(ffi::AV_TIME_BASE))
}
