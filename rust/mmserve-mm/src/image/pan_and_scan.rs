//! Pan-and-scan (Gemma 3's `do_pan_and_scan`): an image elongated enough is cut into a row or
//! column of crops, each then resized and normalised as a whole image is and written into the
//! prompt as an item of its own after the image. Mirrors `pan_and_scan` of transformers 5.24's
//! `Gemma3ImageProcessor(Pil)`.

use serde::{Deserialize, Serialize};

use crate::family::spec::SpecError;
use crate::pipeline::{DecodedImage, ProcessError};

/// Pan-and-scan's knobs, as `Gemma3ImageProcessor` names them (`pan_and_scan_*`); in the
/// spec JSON without the prefix.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PanAndScan {
    pub min_crop_size: u32,
    pub max_num_crops: u32,
    pub min_ratio_to_activate: f64,
}

/// One pan-and-scan crop of the original image: its top-left corner and its size, clipped
/// to the image as a slice is (so the last crop of a row may be narrower, even empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CropRect {
    pub x: u32,
    pub y: u32,
    pub width: u32,
    pub height: u32,
}

impl PanAndScan {
    /// `Gemma3Processor`'s defaults, for the knobs a config leaves out.
    pub const DEFAULT: Self = Self {
        min_crop_size: 256,
        max_num_crops: 4,
        min_ratio_to_activate: 1.2,
    };

    /// Refuses knobs that make the processor divide by zero.
    pub fn new(
        min_crop_size: u32,
        max_num_crops: u32,
        min_ratio_to_activate: f64,
    ) -> Result<Self, SpecError> {
        let knobs = Self {
            min_crop_size,
            max_num_crops,
            min_ratio_to_activate,
        };
        knobs.validate()?;
        Ok(knobs)
    }

    /// What [`PanAndScan::new`] checks, for knobs read from a spec JSON.
    pub fn validate(&self) -> Result<(), SpecError> {
        let invalid = |field, reason: &str| SpecError::Invalid {
            field,
            reason: reason.to_owned(),
        };
        if self.min_crop_size == 0 {
            return Err(invalid("pan_and_scan_min_crop_size", "must be at least 1"));
        }
        if self.max_num_crops == 0 {
            return Err(invalid("pan_and_scan_max_num_crops", "must be at least 1"));
        }
        if !self.min_ratio_to_activate.is_finite() {
            return Err(invalid(
                "pan_and_scan_min_ratio_to_activate",
                "must be a finite number",
            ));
        }
        Ok(())
    }

    /// The crops of a `width` x `height` image, row-major, as `pan_and_scan` computes them
    /// (the same float arithmetic, so the same rounding); none where the image is not
    /// elongated enough or a crop would be under the minimum size.
    pub fn crops(&self, width: u32, height: u32) -> Vec<CropRect> {
        if width == 0 || height == 0 {
            return Vec::new();
        }
        let (w, h) = (f64::from(width), f64::from(height));
        // Crops along the long side: near its ratio to the short side, at least 2.
        let along = |long: f64, short: f64| {
            let ratio = long / short;
            (ratio >= self.min_ratio_to_activate).then(|| {
                let ideal = (ratio + 0.5)
                    .floor()
                    .min((long / f64::from(self.min_crop_size)).floor());
                ideal.max(2.0).min(f64::from(self.max_num_crops)) as u64
            })
        };
        let grid = if width >= height {
            along(w, h).map(|n| (n, 1))
        } else {
            along(h, w).map(|n| (1, n))
        };
        let Some((across, down)) = grid else {
            return Vec::new();
        };
        let crop_w = (w / across as f64).ceil() as u64;
        let crop_h = (h / down as f64).ceil() as u64;
        if crop_w.min(crop_h) < u64::from(self.min_crop_size) {
            return Vec::new();
        }
        // Start and length of a crop clipped to `size`; all within u32 once clipped.
        let clip = |start: u64, len: u64, size: u32| {
            let size = u64::from(size);
            let start = start.min(size);
            let len = len.min(size - start);
            (start as u32, len as u32)
        };
        (0..down)
            .flat_map(|row| (0..across).map(move |col| (row, col)))
            .map(|(row, col)| {
                let (x, width) = clip(col * crop_w, crop_w, width);
                let (y, height) = clip(row * crop_h, crop_h, height);
                CropRect {
                    x,
                    y,
                    width,
                    height,
                }
            })
            .collect()
    }
}

/// The pixels of `rect` (which lies within `image`, as [`PanAndScan::crops`] gives it).
pub fn crop(image: &DecodedImage, rect: CropRect) -> Result<DecodedImage, ProcessError> {
    image.check_rgb()?;
    let stride = image.width as usize * 3;
    let (x, width) = (rect.x as usize * 3, rect.width as usize * 3);
    let mut data = Vec::with_capacity(width * rect.height as usize);
    for row in image
        .data
        .chunks_exact(stride)
        .skip(rect.y as usize)
        .take(rect.height as usize)
    {
        data.extend_from_slice(row.get(x..x + width).unwrap_or_default());
    }
    let cropped = DecodedImage {
        width: rect.width,
        height: rect.height,
        data,
    };
    cropped.check_rgb()?;
    Ok(cropped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::resize::{resize, Backend, Filter};

    /// (min crop size, max crops, min ratio, width, height, crops as (x, y, width, height)),
    /// as transformers 5.24's `Gemma3ImageProcessorPil.pan_and_scan` and
    /// `Gemma3ImageProcessor.pan_and_scan_batched` (which agree) slice them; an empty crop
    /// is the slice's empty shape.
    type Golden = (u32, u32, f64, u32, u32, &'static [(u32, u32, u32, u32)]);
    #[rustfmt::skip]
    const PAN_AND_SCAN_GOLDEN: &[Golden] = &[
        (256, 4, 1.2, 1, 1, &[]),
        (256, 4, 1.2, 2, 3, &[]),
        (256, 4, 1.2, 896, 896, &[]),
        (256, 4, 1.2, 1000, 832, &[(0, 0, 500, 832), (500, 0, 500, 832)]),
        (256, 4, 1.2, 1100, 896, &[(0, 0, 550, 896), (550, 0, 550, 896)]),
        (256, 4, 1.2, 1200, 600, &[(0, 0, 600, 600), (600, 0, 600, 600)]),
        (256, 4, 1.2, 600, 1200, &[(0, 0, 600, 600), (0, 600, 600, 600)]),
        (256, 4, 1.2, 1920, 1080, &[(0, 0, 960, 1080), (960, 0, 960, 1080)]),
        (256, 4, 1.2, 1080, 1920, &[(0, 0, 1080, 960), (0, 960, 1080, 960)]),
        (256, 4, 1.2, 3000, 20, &[]),
        (256, 4, 1.2, 20, 3000, &[]),
        (256, 4, 1.2, 3000, 300, &[(0, 0, 750, 300), (750, 0, 750, 300), (1500, 0, 750, 300), (2250, 0, 750, 300)]),
        (256, 4, 1.2, 300, 3000, &[(0, 0, 300, 750), (0, 750, 300, 750), (0, 1500, 300, 750), (0, 2250, 300, 750)]),
        (256, 4, 1.2, 1023, 257, &[(0, 0, 341, 257), (341, 0, 341, 257), (682, 0, 341, 257)]),
        (256, 4, 1.2, 513, 512, &[]),
        (256, 4, 1.2, 7, 1, &[]),
        (256, 4, 1.2, 1, 7, &[]),
        (256, 4, 1.2, 2000, 500, &[(0, 0, 500, 500), (500, 0, 500, 500), (1000, 0, 500, 500), (1500, 0, 500, 500)]),
        (256, 4, 1.2, 999, 333, &[(0, 0, 333, 333), (333, 0, 333, 333), (666, 0, 333, 333)]),
        (1, 5, 1.2, 1, 1, &[]),
        (1, 5, 1.2, 2, 3, &[(0, 0, 2, 2), (0, 2, 2, 1)]),
        (1, 5, 1.2, 896, 896, &[]),
        (1, 5, 1.2, 1000, 832, &[(0, 0, 500, 832), (500, 0, 500, 832)]),
        (1, 5, 1.2, 1100, 896, &[(0, 0, 550, 896), (550, 0, 550, 896)]),
        (1, 5, 1.2, 1200, 600, &[(0, 0, 600, 600), (600, 0, 600, 600)]),
        (1, 5, 1.2, 600, 1200, &[(0, 0, 600, 600), (0, 600, 600, 600)]),
        (1, 5, 1.2, 1920, 1080, &[(0, 0, 960, 1080), (960, 0, 960, 1080)]),
        (1, 5, 1.2, 1080, 1920, &[(0, 0, 1080, 960), (0, 960, 1080, 960)]),
        (1, 5, 1.2, 3000, 20, &[(0, 0, 600, 20), (600, 0, 600, 20), (1200, 0, 600, 20), (1800, 0, 600, 20), (2400, 0, 600, 20)]),
        (1, 5, 1.2, 20, 3000, &[(0, 0, 20, 600), (0, 600, 20, 600), (0, 1200, 20, 600), (0, 1800, 20, 600), (0, 2400, 20, 600)]),
        (1, 5, 1.2, 3000, 300, &[(0, 0, 600, 300), (600, 0, 600, 300), (1200, 0, 600, 300), (1800, 0, 600, 300), (2400, 0, 600, 300)]),
        (1, 5, 1.2, 300, 3000, &[(0, 0, 300, 600), (0, 600, 300, 600), (0, 1200, 300, 600), (0, 1800, 300, 600), (0, 2400, 300, 600)]),
        (1, 5, 1.2, 1023, 257, &[(0, 0, 256, 257), (256, 0, 256, 257), (512, 0, 256, 257), (768, 0, 255, 257)]),
        (1, 5, 1.2, 513, 512, &[]),
        (1, 5, 1.2, 7, 1, &[(0, 0, 2, 1), (2, 0, 2, 1), (4, 0, 2, 1), (6, 0, 1, 1), (7, 0, 0, 1)]),
        (1, 5, 1.2, 1, 7, &[(0, 0, 1, 2), (0, 2, 1, 2), (0, 4, 1, 2), (0, 6, 1, 1), (0, 7, 1, 0)]),
        (1, 5, 1.2, 2000, 500, &[(0, 0, 500, 500), (500, 0, 500, 500), (1000, 0, 500, 500), (1500, 0, 500, 500)]),
        (1, 5, 1.2, 999, 333, &[(0, 0, 333, 333), (333, 0, 333, 333), (666, 0, 333, 333)]),
        (16, 3, 2.0, 1, 1, &[]),
        (16, 3, 2.0, 2, 3, &[]),
        (16, 3, 2.0, 896, 896, &[]),
        (16, 3, 2.0, 1000, 832, &[]),
        (16, 3, 2.0, 1100, 896, &[]),
        (16, 3, 2.0, 1200, 600, &[(0, 0, 600, 600), (600, 0, 600, 600)]),
        (16, 3, 2.0, 600, 1200, &[(0, 0, 600, 600), (0, 600, 600, 600)]),
        (16, 3, 2.0, 1920, 1080, &[]),
        (16, 3, 2.0, 1080, 1920, &[]),
        (16, 3, 2.0, 3000, 20, &[(0, 0, 1000, 20), (1000, 0, 1000, 20), (2000, 0, 1000, 20)]),
        (16, 3, 2.0, 20, 3000, &[(0, 0, 20, 1000), (0, 1000, 20, 1000), (0, 2000, 20, 1000)]),
        (16, 3, 2.0, 3000, 300, &[(0, 0, 1000, 300), (1000, 0, 1000, 300), (2000, 0, 1000, 300)]),
        (16, 3, 2.0, 300, 3000, &[(0, 0, 300, 1000), (0, 1000, 300, 1000), (0, 2000, 300, 1000)]),
        (16, 3, 2.0, 1023, 257, &[(0, 0, 341, 257), (341, 0, 341, 257), (682, 0, 341, 257)]),
        (16, 3, 2.0, 513, 512, &[]),
        (16, 3, 2.0, 7, 1, &[]),
        (16, 3, 2.0, 1, 7, &[]),
        (16, 3, 2.0, 2000, 500, &[(0, 0, 667, 500), (667, 0, 667, 500), (1334, 0, 666, 500)]),
        (16, 3, 2.0, 999, 333, &[(0, 0, 333, 333), (333, 0, 333, 333), (666, 0, 333, 333)]),
        (300, 1, 1.0, 1, 1, &[]),
        (300, 1, 1.0, 2, 3, &[]),
        (300, 1, 1.0, 896, 896, &[(0, 0, 896, 896)]),
        (300, 1, 1.0, 1000, 832, &[(0, 0, 1000, 832)]),
        (300, 1, 1.0, 1100, 896, &[(0, 0, 1100, 896)]),
        (300, 1, 1.0, 1200, 600, &[(0, 0, 1200, 600)]),
        (300, 1, 1.0, 600, 1200, &[(0, 0, 600, 1200)]),
        (300, 1, 1.0, 1920, 1080, &[(0, 0, 1920, 1080)]),
        (300, 1, 1.0, 1080, 1920, &[(0, 0, 1080, 1920)]),
        (300, 1, 1.0, 3000, 20, &[]),
        (300, 1, 1.0, 20, 3000, &[]),
        (300, 1, 1.0, 3000, 300, &[(0, 0, 3000, 300)]),
        (300, 1, 1.0, 300, 3000, &[(0, 0, 300, 3000)]),
        (300, 1, 1.0, 1023, 257, &[]),
        (300, 1, 1.0, 513, 512, &[(0, 0, 513, 512)]),
        (300, 1, 1.0, 7, 1, &[]),
        (300, 1, 1.0, 1, 7, &[]),
        (300, 1, 1.0, 2000, 500, &[(0, 0, 2000, 500)]),
        (300, 1, 1.0, 999, 333, &[(0, 0, 999, 333)]),
    ];

    #[test]
    fn pan_and_scan_crops_as_transformers_slices_them() {
        for &(min_crop, max_crops, ratio, w, h, expected) in PAN_AND_SCAN_GOLDEN {
            let knobs = PanAndScan::new(min_crop, max_crops, ratio).unwrap();
            let crops: Vec<_> = knobs
                .crops(w, h)
                .iter()
                .map(|c| (c.x, c.y, c.width, c.height))
                .collect();
            assert_eq!(crops, expected, "{w}x{h} with {knobs:?}");
        }
        assert_eq!(PanAndScan::DEFAULT, PanAndScan::new(256, 4, 1.2).unwrap());
        assert!(PanAndScan::DEFAULT.crops(0, 900).is_empty());
    }

    #[test]
    fn pan_and_scan_refuses_knobs_that_divide_by_zero() {
        for (knobs, field) in [
            ((0, 4, 1.2), "pan_and_scan_min_crop_size"),
            ((256, 0, 1.2), "pan_and_scan_max_num_crops"),
            ((256, 4, f64::NAN), "pan_and_scan_min_ratio_to_activate"),
        ] {
            let err = PanAndScan::new(knobs.0, knobs.1, knobs.2).unwrap_err();
            assert_eq!(err.code(), "spec.invalid");
            assert!(err.to_string().contains(field), "{err}");
        }
    }

    #[test]
    fn a_crop_copies_its_rectangle_and_an_empty_one_is_refused_by_resize() {
        // Pixel i of a 7x3 image holds (i, i, i).
        let image = DecodedImage {
            width: 7,
            height: 3,
            data: (0..21u8).flat_map(|i| [i; 3]).collect(),
        };
        let rect = CropRect {
            x: 5,
            y: 1,
            width: 2,
            height: 2,
        };
        let cropped = crop(&image, rect).unwrap();
        assert_eq!((cropped.width, cropped.height), (2, 2));
        assert_eq!(
            cropped.data,
            [12, 12, 12, 13, 13, 13, 19, 19, 19, 20, 20, 20]
        );
        let knobs = PanAndScan::new(1, 5, 1.2).unwrap();
        let last = *knobs.crops(7, 1).last().unwrap();
        assert_eq!((last.x, last.width), (7, 0));
        let row = DecodedImage {
            width: 7,
            height: 1,
            data: vec![0; 21],
        };
        let empty = crop(&row, last).unwrap();
        assert!(resize(&empty, 896, 896, Filter::Bilinear, Backend::TorchU8).is_err());
    }
}
