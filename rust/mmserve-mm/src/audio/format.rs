//! The audio formats a request may name, and the libavformat demuxer each one is.

use crate::audio::error::AudioError;

/// A container the core reads audio from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AudioFormat {
    Wav,
    Flac,
    Mp3,
    Ogg,
    /// Matroska and WebM.
    Matroska,
    /// MP4, M4A and QuickTime.
    Mp4,
}

impl AudioFormat {
    pub const ALL: [AudioFormat; 6] = [
        AudioFormat::Wav,
        AudioFormat::Flac,
        AudioFormat::Mp3,
        AudioFormat::Ogg,
        AudioFormat::Matroska,
        AudioFormat::Mp4,
    ];

    /// The format a request names (`input_audio.format`, a file extension or the subtype of
    /// an `audio/...` media type), case-insensitive.
    pub fn from_name(name: &str) -> Result<AudioFormat, AudioError> {
        let lower = name.trim().to_ascii_lowercase();
        Ok(match lower.as_str() {
            "wav" | "wave" | "x-wav" | "vnd.wave" => AudioFormat::Wav,
            "flac" | "x-flac" => AudioFormat::Flac,
            "mp3" | "mpeg" | "mpga" => AudioFormat::Mp3,
            "ogg" | "oga" | "opus" | "vorbis" => AudioFormat::Ogg,
            "webm" | "mka" | "mkv" | "matroska" | "x-matroska" => AudioFormat::Matroska,
            "m4a" | "mp4" | "x-m4a" | "aac" | "mov" => AudioFormat::Mp4,
            _ => return Err(AudioError::UnknownFormatName(name.to_owned())),
        })
    }

    /// libavformat's name of the demuxer that reads this format.
    pub fn demuxer(self) -> &'static str {
        match self {
            AudioFormat::Wav => "wav",
            AudioFormat::Flac => "flac",
            AudioFormat::Mp3 => "mp3",
            AudioFormat::Ogg => "ogg",
            AudioFormat::Matroska => "matroska,webm",
            AudioFormat::Mp4 => "mov,mp4,m4a,3gp,3g2,mj2",
        }
    }

    /// The format libavformat's demuxer `name` reads, if it is one of ours.
    pub fn from_demuxer(name: &str) -> Option<AudioFormat> {
        AudioFormat::ALL.into_iter().find(|f| f.demuxer() == name)
    }

    /// The usual name of the format, for messages.
    pub fn name(self) -> &'static str {
        match self {
            AudioFormat::Wav => "wav",
            AudioFormat::Flac => "flac",
            AudioFormat::Mp3 => "mp3",
            AudioFormat::Ogg => "ogg",
            AudioFormat::Matroska => "webm/mkv",
            AudioFormat::Mp4 => "m4a/mp4",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_one_demuxer_each() {
        assert_eq!(AudioFormat::from_name("WAV").unwrap(), AudioFormat::Wav);
        assert_eq!(AudioFormat::from_name("opus").unwrap(), AudioFormat::Ogg);
        assert_eq!(AudioFormat::from_name("m4a").unwrap(), AudioFormat::Mp4);
        assert!(matches!(
            AudioFormat::from_name("aiff"),
            Err(AudioError::UnknownFormatName(n)) if n == "aiff"
        ));
        for f in AudioFormat::ALL {
            assert_eq!(AudioFormat::from_demuxer(f.demuxer()), Some(f));
        }
    }
}
