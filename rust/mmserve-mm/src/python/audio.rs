//! Bindings of the audio side: the log-mel feature extractor and, with the `audio` feature,
//! probing, decoding and bytes-to-features. The work runs with the GIL released.

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::error::to_py;
use crate::audio::features::{LogMel, LogMelConfig, LogMelFeatures, Padding};

/// `(input_features [feature_size, frames] float32, valid_frames)`.
type Features<'py> = (Bound<'py, PyArray2<f32>>, usize);

fn features_array(py: Python<'_>, f: LogMelFeatures) -> PyResult<Features<'_>> {
    let array = Array2::from_shape_vec((f.feature_size, f.frames), f.data)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok((array.into_pyarray(py), f.valid_frames))
}

/// transformers' `WhisperFeatureExtractor` (the audio families' extractor) on one clip: its
/// parameters from `preprocessor_config.json`, and the processor's `padding` and `truncation`.
#[pyclass(name = "AudioFeatureExtractor", module = "mmserve._mm", frozen)]
#[derive(Debug)]
pub struct PyAudioFeatureExtractor {
    inner: LogMel,
}

impl PyAudioFeatureExtractor {
    /// The extractor `config` makes.
    pub(super) fn of(config: LogMelConfig) -> PyResult<Self> {
        let inner = LogMel::new(config).map_err(to_py)?;
        Ok(PyAudioFeatureExtractor { inner })
    }
}

#[pymethods]
impl PyAudioFeatureExtractor {
    #[new]
    #[pyo3(signature = (*, feature_size = 80, sampling_rate = 16000, hop_length = 160,
        n_fft = 400, chunk_length = 30, padding_value = 0.0, padding = "max_length",
        truncation = true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        feature_size: usize,
        sampling_rate: u32,
        hop_length: usize,
        n_fft: usize,
        chunk_length: u32,
        padding_value: f32,
        padding: &str,
        truncation: bool,
    ) -> PyResult<Self> {
        let padding = match padding {
            "max_length" => Padding::MaxLength,
            "longest" => Padding::Longest,
            other => {
                return Err(PyValueError::new_err(format!(
                    "padding must be \"max_length\" or \"longest\", not {other:?}"
                )))
            }
        };
        Self::of(LogMelConfig {
            feature_size,
            sampling_rate,
            hop_length,
            n_fft,
            chunk_length,
            padding_value,
            padding,
            truncation,
        })
    }

    /// The identity (mm_hash) of the clip whose encoded bytes are `data` when featurized by
    /// this extractor: what the request plan gives it.
    fn identity(&self, data: &[u8]) -> u64 {
        crate::identity::audio(crate::identity::content(data), self.inner.config())
    }

    #[getter]
    fn sampling_rate(&self) -> u32 {
        self.inner.config().sampling_rate
    }

    #[getter]
    fn feature_size(&self) -> usize {
        self.inner.config().feature_size
    }

    /// The samples a clip of `samples` keeps (cut to the chunk when truncating), or `None`
    /// when every sample is kept.
    #[getter]
    fn max_samples(&self) -> Option<usize> {
        let config = self.inner.config();
        config.truncation.then(|| config.chunk_samples())
    }

    /// `(frames, valid_frames)` of a clip of `samples` samples.
    fn frames(&self, samples: usize) -> (usize, usize) {
        self.inner.config().frames(samples)
    }

    /// The filter bank as a `[1 + n_fft // 2, feature_size]` float64 array (weights rounded
    /// to float32, as the extractor's torch path applies them).
    fn mel_filters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<f64>>> {
        let config = self.inner.config();
        let shape = (1 + config.n_fft / 2, config.feature_size);
        let array = Array2::from_shape_vec(shape, self.inner.filter_matrix())
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(array.into_pyarray(py))
    }

    /// `(input_features, valid_frames)` of a mono float32 clip at the extractor's rate.
    fn __call__<'py>(
        &self,
        py: Python<'py>,
        samples: PyReadonlyArray1<'py, f32>,
    ) -> PyResult<Features<'py>> {
        let samples = samples.as_slice()?;
        let features = py.detach(|| self.inner.extract(samples)).map_err(to_py)?;
        features_array(py, features)
    }
}

#[cfg(feature = "audio")]
mod ffmpeg {
    use numpy::PyArray1;
    use pyo3::types::{PyBytes, PyDict};

    use super::*;
    use crate::audio::decode::{self, AudioInfo, AudioLimits, DecodeOptions};
    use crate::audio::format::AudioFormat;
    use crate::audio::AudioError;
    use crate::common::par;
    use crate::python::deadline::deadline;

    fn limits(max_duration_s: Option<f64>, timeout_s: Option<f64>) -> PyResult<AudioLimits> {
        let defaults = AudioLimits::default();
        Ok(AudioLimits {
            max_duration_s: max_duration_s.unwrap_or(defaults.max_duration_s),
            deadline: deadline(timeout_s)?,
            ..defaults
        })
    }

    fn declared(format: Option<&str>) -> PyResult<Option<AudioFormat>> {
        format
            .map(AudioFormat::from_name)
            .transpose()
            .map_err(to_py)
    }

    fn info_dict<'py>(py: Python<'py>, info: &AudioInfo) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("container", &info.container)?;
        d.set_item("codec", &info.codec)?;
        d.set_item("sample_rate", info.sample_rate)?;
        d.set_item("channels", info.channels)?;
        d.set_item("duration_s", info.duration_s)?;
        Ok(d)
    }

    /// What the headers of an audio file say (`container`, `codec`, `sample_rate`,
    /// `channels`, `duration_s`: `None` where they state none), its caps checked; nothing is
    /// decoded past what libavformat needs to name the format. `format` is the format the
    /// request names (`wav`, `mp3`, ...): data of another is refused. With `sample_rate`,
    /// `sample_bounds` is `(min, max)`, the samples the clip decodes to at that rate (cut at
    /// `max_samples`) as the headers bound them, or `None` where only decoding tells.
    #[pyfunction]
    #[pyo3(signature = (data, *, format = None, sample_rate = None, max_samples = None,
        max_duration_s = None, timeout_s = None))]
    #[allow(clippy::too_many_arguments)]
    pub fn probe_audio<'py>(
        py: Python<'py>,
        data: &[u8],
        format: Option<&str>,
        sample_rate: Option<u32>,
        max_samples: Option<usize>,
        max_duration_s: Option<f64>,
        timeout_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let declared = declared(format)?;
        let limits = limits(max_duration_s, timeout_s)?;
        let Some(sample_rate) = sample_rate else {
            let info = py
                .detach(|| decode::probe_audio(data, declared, &limits))
                .map_err(to_py)?;
            return info_dict(py, &info);
        };
        let options = DecodeOptions {
            sample_rate,
            max_samples,
        };
        let (info, bounds) = py
            .detach(|| decode::probe_samples(data, declared, &options, &limits))
            .map_err(to_py)?;
        let d = info_dict(py, &info)?;
        d.set_item("sample_bounds", bounds.map(|b| (b.min, b.max)))?;
        Ok(d)
    }

    /// `(info, samples)`: the clip as mono float32 at `sample_rate`, sample for sample what
    /// torchcodec's `AudioDecoder(data, sample_rate=..., num_channels=1)` returns; cut at
    /// `max_samples` (decoding stops there), when given. `info["complete"]` says whether the
    /// samples are the whole clip.
    #[pyfunction]
    #[pyo3(signature = (data, *, sample_rate, format = None, max_samples = None,
        max_duration_s = None, timeout_s = None))]
    pub fn decode_audio<'py>(
        py: Python<'py>,
        data: &[u8],
        sample_rate: u32,
        format: Option<&str>,
        max_samples: Option<usize>,
        max_duration_s: Option<f64>,
        timeout_s: Option<f64>,
    ) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyArray1<f32>>)> {
        let declared = declared(format)?;
        let limits = limits(max_duration_s, timeout_s)?;
        let options = DecodeOptions {
            sample_rate,
            max_samples,
        };
        let (info, decoded) = py
            .detach(|| decode::decode_audio(data, declared, &options, &limits))
            .map_err(to_py)?;
        let d = info_dict(py, &info)?;
        d.set_item("complete", decoded.complete)?;
        Ok((d, decoded.samples.into_pyarray(py)))
    }

    /// One clip's features: `(info, input_features, valid_frames, samples)`, `samples` being
    /// the count the clip decoded to (up to the chunk when the extractor truncates).
    type ClipFeatures<'py> = (Bound<'py, PyDict>, Bound<'py, PyArray2<f32>>, usize, usize);

    /// The log-mel features of each encoded clip, bytes to `input_features` in one call per
    /// list: decoded at the extractor's rate (stopping at the chunk when it truncates), then
    /// featurized, the clips fanned out over the core's pool. `formats`, when given, names
    /// each clip's format. A failure names the clip at fault.
    #[pyfunction]
    #[pyo3(signature = (clips, extractor, *, formats = None, max_duration_s = None,
        timeout_s = None))]
    pub fn audio_features<'py>(
        py: Python<'py>,
        clips: Vec<Bound<'py, PyBytes>>,
        extractor: &PyAudioFeatureExtractor,
        formats: Option<Vec<Option<String>>>,
        max_duration_s: Option<f64>,
        timeout_s: Option<f64>,
    ) -> PyResult<Vec<ClipFeatures<'py>>> {
        let formats = formats.unwrap_or_else(|| vec![None; clips.len()]);
        if formats.len() != clips.len() {
            return Err(PyValueError::new_err(format!(
                "{} formats for {} clips",
                formats.len(),
                clips.len()
            )));
        }
        let declared: Vec<Option<AudioFormat>> = formats
            .iter()
            .map(|f| declared(f.as_deref()))
            .collect::<PyResult<_>>()?;
        let limits = limits(max_duration_s, timeout_s)?;
        let config = extractor.inner.config();
        let options = DecodeOptions {
            sample_rate: config.sampling_rate,
            max_samples: config.truncation.then(|| config.chunk_samples()),
        };
        let items: Vec<(&[u8], Option<AudioFormat>)> =
            clips.iter().map(|b| b.as_bytes()).zip(declared).collect();
        let mel = &extractor.inner;
        let results = py
            .detach(|| {
                par::try_map(&items, |&(data, format)| {
                    let (info, decoded) = decode::decode_audio(data, format, &options, &limits)?;
                    let features = mel.extract(&decoded.samples)?;
                    Ok::<_, AudioError>((info, features, decoded.samples.len()))
                })
            })
            .map_err(|(index, e)| to_py(crate::Error::from(e).at_item(index)))?;
        results
            .into_iter()
            .map(|(info, features, samples)| {
                let (array, valid) = features_array(py, features)?;
                Ok((info_dict(py, &info)?, array, valid, samples))
            })
            .collect()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyAudioFeatureExtractor>()?;
    #[cfg(feature = "audio")]
    {
        m.add_function(wrap_pyfunction!(ffmpeg::probe_audio, m)?)?;
        m.add_function(wrap_pyfunction!(ffmpeg::decode_audio, m)?)?;
        m.add_function(wrap_pyfunction!(ffmpeg::audio_features, m)?)?;
    }
    Ok(())
}
