//! Bindings of the video side: sampling, (with the `video` feature) probe and decode, and frames
//! to `pixel_values_videos`. The work runs with the GIL released.

use numpy::ndarray::{Array2, Array4};
use numpy::{IntoPyArray, PyArray2, PyArray4, PyReadonlyArray4, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::error::to_py;
use crate::family::registry::FamilyName;
use crate::image::resize::{Backend, Filter};
use crate::image::transforms::{Convention, NormalizeLut, PatchGeometry};
use crate::pipeline::DecodedImage;
use crate::video::config::{video_config_from_hf, FamilyDefaults};
use crate::video::frames::{preprocess_frames, VideoResize};
use crate::video::sampling::{sample_indices, Sampling, VideoMeta};
use crate::video::timestamps::{group_timestamps, timestamp_text};
use crate::video::{VideoError, VideoFamily};

/// The video rules of a model type, as the family registry names them.
fn family(name: &str) -> PyResult<VideoFamily> {
    FamilyName::from_model_type(name)
        .and_then(FamilyName::video_processor)
        .ok_or_else(|| {
            let with_video: Vec<&str> = FamilyName::ALL
                .iter()
                .filter(|f| f.video_processor().is_some())
                .map(|f| f.model_type())
                .collect();
            PyValueError::new_err(format!(
                "no video processor for family {name:?} ({})",
                with_video.join(", ")
            ))
        })
}

/// `(seconds, text)` of each temporal group: the text Qwen3-VL's processor writes before the
/// group's `<|vision_start|>`.
fn timestamps(indices: &[u64], video_fps: f64, temporal_patch_size: u32) -> Vec<(f64, String)> {
    group_timestamps(indices, video_fps, temporal_patch_size as usize)
        .into_iter()
        .map(|t| (t, timestamp_text(t)))
        .collect()
}

/// `(seconds, text)` of each temporal group of a video sampled at `indices` from a video of
/// `video_fps`, as Qwen3-VL's processor computes and writes them (`"<{t:.1f} seconds>"`).
#[pyfunction]
#[pyo3(name = "video_timestamps", signature = (indices, video_fps, *, temporal_patch_size = 2))]
fn py_video_timestamps(
    indices: Vec<u64>,
    video_fps: f64,
    temporal_patch_size: u32,
) -> PyResult<Vec<(f64, String)>> {
    if !(video_fps.is_finite() && video_fps > 0.0) {
        return Err(PyValueError::new_err(format!("bad video_fps {video_fps}")));
    }
    Ok(timestamps(&indices, video_fps, temporal_patch_size))
}

/// The frame indices `family`'s video processor samples from a video of `total_frames`
/// frames at `video_fps`, by `fps` or by `num_frames` (neither: all frames).
#[pyfunction]
#[pyo3(signature = (total_frames, video_fps, *, fps = None, num_frames = None,
    min_frames = 4, max_frames = 768, temporal_patch_size = 2, family = "qwen2_vl"))]
#[allow(clippy::too_many_arguments)]
fn sample_frame_indices(
    total_frames: u64,
    video_fps: f64,
    fps: Option<f64>,
    num_frames: Option<u64>,
    min_frames: u64,
    max_frames: u64,
    temporal_patch_size: u64,
    family: &str,
) -> PyResult<Vec<u64>> {
    let meta = VideoMeta {
        total_frames,
        fps: video_fps,
    };
    let sampling = Sampling {
        family: self::family(family)?,
        fps,
        num_frames,
        min_frames,
        max_frames,
        temporal_patch_size,
    };
    sample_indices(meta, sampling).map_err(|e| to_py(VideoError::from(e)))
}

/// `pixel_values_videos` and `(t, h, w)`.
type Processed<'py> = (Bound<'py, PyArray2<f32>>, (u32, u32, u32));

/// Sampled RGB frames (`[n, h, w, 3]` uint8) to `(pixel_values_videos, (t, h, w))` as
/// `family`'s video processor (torchvision backend) computes them.
#[pyfunction]
#[pyo3(signature = (frames, *, min_pixels, max_pixels, mean, std, rescale = 1.0 / 255.0,
    patch_size = 14, merge_size = 2, temporal_patch_size = 2, cap_pixels_per_frame = false,
    max_video_tokens = 128_000, family = "qwen2_vl"))]
#[allow(clippy::too_many_arguments)]
fn preprocess_video<'py>(
    py: Python<'py>,
    frames: PyReadonlyArray4<'py, u8>,
    min_pixels: u64,
    max_pixels: u64,
    mean: [f64; 3],
    std: [f64; 3],
    rescale: f64,
    patch_size: u32,
    merge_size: u32,
    temporal_patch_size: u32,
    cap_pixels_per_frame: bool,
    max_video_tokens: u64,
    family: &str,
) -> PyResult<Processed<'py>> {
    let family = self::family(family)?;
    let shape = frames.shape().to_vec();
    if shape[3] != 3 {
        return Err(PyValueError::new_err(format!(
            "frames must have shape [n, height, width, 3] (RGB), got {shape:?}"
        )));
    }
    let side = |n: usize| {
        u32::try_from(n).map_err(|_| PyValueError::new_err(format!("frame side {n} is too large")))
    };
    let (height, width) = (side(shape[1])?, side(shape[2])?);
    let plane = shape[1] * shape[2] * 3;
    let all: Vec<u8> = match frames.as_slice() {
        Ok(data) => data.to_vec(),
        Err(_) => frames.as_array().iter().copied().collect(),
    };
    let decoded: Vec<DecodedImage> = all
        .chunks_exact(plane.max(1))
        .map(|data| DecodedImage {
            width,
            height,
            data: data.to_vec(),
        })
        .collect();
    let resize = VideoResize {
        family,
        min_pixels,
        max_pixels,
        cap_pixels_per_frame,
        max_video_tokens,
        filter: Filter::Bicubic,
        backend: Backend::TorchU8,
    };
    let geometry = PatchGeometry {
        patch: patch_size,
        merge: merge_size,
        temporal: temporal_patch_size,
    };
    let lut = NormalizeLut::new(mean, std, rescale, Convention::Torchvision)
        .map_err(|e| to_py(VideoError::from(e)))?;
    let out = py
        .detach(|| preprocess_frames(&decoded, &resize, &lut, geometry))
        .map_err(to_py)?;
    let rows = out.pixel_values.len() / out.cols.max(1);
    let [t, h, w] = out.grid_thw;
    let array = Array2::from_shape_vec((rows, out.cols), out.pixel_values)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok((array.into_pyarray(py), (t, h, w)))
}

#[cfg(feature = "video")]
mod ffmpeg {
    use pyo3::types::PyDict;

    use super::*;
    use crate::identity;
    use crate::video::demux::{self, VideoInfo, VideoLimits};
    use crate::video::process::{self, VideoPlan};

    fn limits(
        max_duration_s: Option<f64>,
        max_frames: Option<u64>,
        max_pixels: Option<u64>,
        timeout_s: Option<f64>,
    ) -> PyResult<VideoLimits> {
        let defaults = VideoLimits::default();
        let deadline = super::super::deadline::deadline(timeout_s)?;
        Ok(VideoLimits {
            max_duration_s: max_duration_s.unwrap_or(defaults.max_duration_s),
            max_frames: max_frames.unwrap_or(defaults.max_frames),
            max_pixels: max_pixels.unwrap_or(defaults.max_pixels),
            deadline,
            ..defaults
        })
    }

    fn info_dict<'py>(py: Python<'py>, info: &VideoInfo) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("width", info.width)?;
        d.set_item("height", info.height)?;
        d.set_item("rotation", info.rotation)?;
        d.set_item("total_frames", info.total_frames)?;
        d.set_item("fps", info.fps)?;
        d.set_item("duration_s", info.duration_s)?;
        d.set_item("codec", &info.codec)?;
        d.set_item("container", &info.container)?;
        d.set_item("pixel_format", &info.pixel_format)?;
        Ok(d)
    }

    impl PyVideoOptions {
        /// The core's options, the deadline `timeout_s` from now.
        pub(crate) fn video_options(
            &self,
            timeout_s: Option<f64>,
        ) -> PyResult<crate::video::process::VideoOptions> {
            Ok(crate::video::process::VideoOptions {
                sampling: self.sampling,
                resize: self.resize,
                geometry: self.geometry,
                limits: limits(
                    self.max_duration_s,
                    self.max_frames_decoded,
                    self.max_pixels_per_frame,
                    timeout_s,
                )?,
                max_tokens: self.max_tokens,
                audio_track: self.audio_track,
            })
        }
    }

    fn plan_dict<'py>(
        py: Python<'py>,
        plan: &VideoPlan,
        options: &PyVideoOptions,
    ) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("info", info_dict(py, &plan.info)?)?;
        d.set_item("indices", plan.indices.clone())?;
        let [t, h, w] = plan.grid_thw;
        d.set_item("grid_thw", (t, h, w))?;
        d.set_item("resized_size", (plan.resized_width, plan.resized_height))?;
        d.set_item("tokens", plan.tokens)?;
        d.set_item("mm_hash", plan.mm_hash)?;
        let groups = timestamps(&plan.indices, plan.info.fps, options.geometry.temporal);
        // Qwen3-VL's processor writes each temporal group after its timestamp, an item of its
        // own with an identity of its own.
        let (texts, group_hashes): (Vec<&str>, Vec<u64>) = match options.sampling.family {
            VideoFamily::Qwen3Vl => groups
                .iter()
                .zip(0..)
                .map(|((_, text), group)| {
                    (text.as_str(), identity::video_group(plan.mm_hash, group))
                })
                .unzip(),
            VideoFamily::Qwen2Vl => (Vec::new(), Vec::new()),
        };
        d.set_item("timestamp_texts", texts)?;
        d.set_item("group_mm_hashes", group_hashes)?;
        d.set_item(
            "timestamps",
            groups.iter().map(|(t, _)| *t).collect::<Vec<f64>>(),
        )?;
        Ok(d)
    }

    /// The count-only plan of a video: info, sampled indices, grid, token count and identity
    /// (mm_hash), from its headers; no frame is decoded.
    #[pyfunction]
    #[pyo3(signature = (data, options, *, timeout_s = None))]
    pub fn plan_video<'py>(
        py: Python<'py>,
        data: &[u8],
        options: &PyVideoOptions,
        timeout_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let core = options.video_options(timeout_s)?;
        let plan = py
            .detach(|| process::plan_video(data, &core))
            .map_err(to_py)?;
        plan_dict(py, &plan, options)
    }

    /// `(plan, pixel_values_videos)`: the plan and the model inputs of a video.
    #[pyfunction]
    #[pyo3(signature = (data, options, *, timeout_s = None))]
    pub fn process_video<'py>(
        py: Python<'py>,
        data: &[u8],
        options: &PyVideoOptions,
        timeout_s: Option<f64>,
    ) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyArray2<f32>>)> {
        let lut = options.lut.clone();
        let core = options.video_options(timeout_s)?;
        let (plan, processed) = py
            .detach(|| process::process_video(data, &core, &lut))
            .map_err(to_py)?;
        let rows = processed.pixel_values.len() / processed.cols.max(1);
        let array = Array2::from_shape_vec((rows, processed.cols), processed.pixel_values)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok((plan_dict(py, &plan, options)?, array.into_pyarray(py)))
    }

    /// A video's frame count, rate, size and codec from its headers, without decoding.
    #[pyfunction]
    #[pyo3(signature = (data, *, max_duration_s = None, max_frames = None, max_pixels = None,
        timeout_s = None))]
    pub fn probe_video<'py>(
        py: Python<'py>,
        data: &[u8],
        max_duration_s: Option<f64>,
        max_frames: Option<u64>,
        max_pixels: Option<u64>,
        timeout_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let limits = limits(max_duration_s, max_frames, max_pixels, timeout_s)?;
        let info = py
            .detach(|| demux::probe_video(data, &limits))
            .map_err(to_py)?;
        info_dict(py, &info)
    }

    /// `(info, frames)`: the frames at `indices` (ascending) as `[n, h, w, 3]` uint8 RGB.
    #[pyfunction]
    #[pyo3(signature = (data, indices, *, max_duration_s = None, max_frames = None,
        max_pixels = None, timeout_s = None))]
    #[allow(clippy::too_many_arguments)]
    pub fn decode_video<'py>(
        py: Python<'py>,
        data: &[u8],
        indices: Vec<u64>,
        max_duration_s: Option<f64>,
        max_frames: Option<u64>,
        max_pixels: Option<u64>,
        timeout_s: Option<f64>,
    ) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyArray4<u8>>)> {
        let limits = limits(max_duration_s, max_frames, max_pixels, timeout_s)?;
        let (info, frames) = py
            .detach(|| demux::decode_frames(data, &indices, &limits))
            .map_err(to_py)?;
        let shape = (
            frames.len(),
            info.height as usize,
            info.width as usize,
            3usize,
        );
        let data: Vec<u8> = frames.into_iter().flat_map(|f| f.data).collect();
        let array = Array4::from_shape_vec(shape, data)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok((info_dict(py, &info)?, array.into_pyarray(py)))
    }
}

/// The options that decide a video's model inputs, as `family`'s video processor
/// (`Qwen2VLVideoProcessor` or `Qwen3VLVideoProcessor`) reads them (its class defaults where
/// not given).
#[pyclass(name = "VideoOptions", frozen, module = "mmserve._mm")]
#[derive(Debug, Clone)]
pub struct PyVideoOptions {
    sampling: Sampling,
    resize: VideoResize,
    geometry: PatchGeometry,
    lut: NormalizeLut,
    max_duration_s: Option<f64>,
    max_frames_decoded: Option<u64>,
    max_pixels_per_frame: Option<u64>,
    max_tokens: Option<usize>,
    audio_track: bool,
}

#[pymethods]
impl PyVideoOptions {
    #[new]
    #[pyo3(signature = (*, family = "qwen2_vl", fps = None, num_frames = None, min_frames = 4,
        max_frames = 768, min_pixels = None, max_pixels = None, cap_pixels_per_frame = false,
        max_video_tokens = None, mean = None, std = None, rescale = 1.0 / 255.0,
        patch_size = None, merge_size = 2, temporal_patch_size = 2,
        max_duration_s = None, max_frames_decoded = None, max_pixels_per_frame = None,
        max_tokens = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        family: &str,
        fps: Option<f64>,
        num_frames: Option<u64>,
        min_frames: u64,
        max_frames: u64,
        min_pixels: Option<u64>,
        max_pixels: Option<u64>,
        cap_pixels_per_frame: bool,
        max_video_tokens: Option<u64>,
        mean: Option<[f64; 3]>,
        std: Option<[f64; 3]>,
        rescale: f64,
        patch_size: Option<u32>,
        merge_size: u32,
        temporal_patch_size: u32,
        max_duration_s: Option<f64>,
        max_frames_decoded: Option<u64>,
        max_pixels_per_frame: Option<u64>,
        max_tokens: Option<usize>,
    ) -> PyResult<Self> {
        let family = self::family(family)?;
        let defaults = FamilyDefaults::of(family);
        let lut = NormalizeLut::new(
            mean.unwrap_or(defaults.mean),
            std.unwrap_or(defaults.std),
            rescale,
            Convention::Torchvision,
        )
        .map_err(|e| to_py(VideoError::from(e)))?;
        Ok(PyVideoOptions {
            sampling: Sampling {
                family,
                fps,
                num_frames,
                min_frames,
                max_frames,
                temporal_patch_size: u64::from(temporal_patch_size),
            },
            resize: VideoResize {
                min_pixels: min_pixels.unwrap_or(defaults.resize.min_pixels),
                max_pixels: max_pixels.unwrap_or(defaults.resize.max_pixels),
                cap_pixels_per_frame,
                max_video_tokens: max_video_tokens.unwrap_or(defaults.resize.max_video_tokens),
                ..defaults.resize
            },
            geometry: PatchGeometry {
                patch: patch_size.unwrap_or(defaults.patch_size),
                merge: merge_size,
                temporal: temporal_patch_size,
            },
            lut,
            max_duration_s,
            max_frames_decoded,
            max_pixels_per_frame,
            max_tokens,
            audio_track: false,
        })
    }

    /// The options a checkpoint's `video_preprocessor_config.json` (or, without one, its
    /// `preprocessor_config.json`) gives, as transformers' video processor reads them, with
    /// the per-frame pixel bounds the family's processor imposes where it does (the Omni
    /// thinkers').
    #[staticmethod]
    #[pyo3(signature = (json, *, family = "qwen2_vl", max_duration_s = None,
        max_frames_decoded = None, max_pixels_per_frame = None, max_tokens = None))]
    fn from_hf_config(
        json: &str,
        family: &str,
        max_duration_s: Option<f64>,
        max_frames_decoded: Option<u64>,
        max_pixels_per_frame: Option<u64>,
        max_tokens: Option<usize>,
    ) -> PyResult<Self> {
        let mut config = video_config_from_hf(json, self::family(family)?).map_err(to_py)?;
        if let Some((min_pixels, max_pixels)) =
            FamilyName::from_model_type(family).and_then(FamilyName::video_pixel_bounds)
        {
            config.resize.min_pixels = min_pixels;
            config.resize.max_pixels = max_pixels;
        }
        let lut = NormalizeLut::new(
            config.mean,
            config.std,
            config.rescale,
            Convention::Torchvision,
        )
        .map_err(|e| to_py(VideoError::from(e)))?;
        Ok(PyVideoOptions {
            sampling: config.sampling,
            resize: config.resize,
            geometry: config.geometry,
            lut,
            max_duration_s,
            max_frames_decoded,
            max_pixels_per_frame,
            max_tokens,
            audio_track: false,
        })
    }

    /// These options with the sampling and per-frame pixel bounds replaced (the fields of
    /// the plan's `VideoSampling`), and whether the video's own audio track is served with its
    /// frames (`use_audio_in_video`); everything else, the caps included, kept.
    #[pyo3(signature = (*, fps, num_frames, min_frames, max_frames, min_pixels, max_pixels,
        use_audio_in_video = false))]
    #[allow(clippy::too_many_arguments)]
    fn with_sampling(
        &self,
        fps: Option<f64>,
        num_frames: Option<u64>,
        min_frames: u64,
        max_frames: u64,
        min_pixels: u64,
        max_pixels: u64,
        use_audio_in_video: bool,
    ) -> Self {
        PyVideoOptions {
            sampling: Sampling {
                fps,
                num_frames,
                min_frames,
                max_frames,
                ..self.sampling
            },
            resize: VideoResize {
                min_pixels,
                max_pixels,
                ..self.resize
            },
            audio_track: use_audio_in_video,
            ..self.clone()
        }
    }

    #[getter]
    fn use_audio_in_video(&self) -> bool {
        self.audio_track
    }

    #[getter]
    fn fps(&self) -> Option<f64> {
        self.sampling.fps
    }

    #[getter]
    fn num_frames(&self) -> Option<u64> {
        self.sampling.num_frames
    }

    #[getter]
    fn min_frames(&self) -> u64 {
        self.sampling.min_frames
    }

    #[getter]
    fn max_frames(&self) -> u64 {
        self.sampling.max_frames
    }

    #[getter]
    fn min_pixels(&self) -> u64 {
        self.resize.min_pixels
    }

    #[getter]
    fn max_pixels(&self) -> u64 {
        self.resize.max_pixels
    }

    #[getter]
    fn temporal_patch_size(&self) -> u32 {
        self.geometry.temporal
    }

    fn __repr__(&self) -> String {
        format!("VideoOptions({:?}, {:?})", self.sampling, self.resize)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyVideoOptions>()?;
    m.add_function(wrap_pyfunction!(sample_frame_indices, m)?)?;
    m.add_function(wrap_pyfunction!(preprocess_video, m)?)?;
    m.add_function(wrap_pyfunction!(py_video_timestamps, m)?)?;
    #[cfg(feature = "video")]
    {
        m.add_function(wrap_pyfunction!(ffmpeg::probe_video, m)?)?;
        m.add_function(wrap_pyfunction!(ffmpeg::decode_video, m)?)?;
        m.add_function(wrap_pyfunction!(ffmpeg::plan_video, m)?)?;
        m.add_function(wrap_pyfunction!(ffmpeg::process_video, m)?)?;
    }
    Ok(())
}
