//! An open input over bytes in memory: the custom IO callbacks FFmpeg reads them through,
//! the deadline reaching it through its interrupt callback, and the packets read.

use std::ffi::{c_int, c_void, CStr};
use std::mem::ManuallyDrop;
use std::ptr;
use std::sync::Once;
use std::time::Instant;

use ff::ffi;
use ffmpeg_next as ff;

use super::error::{ff_failure, FfError};
use super::probe::Format;

/// Bytes handed to FFmpeg per read.
const IO_BUFFER: usize = 64 * 1024;

/// The byte source FFmpeg reads through its custom IO callbacks.
struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

unsafe extern "C" fn read_packet(opaque: *mut c_void, buf: *mut u8, size: c_int) -> c_int {
    // SAFETY: `opaque` is the boxed `Reader` that outlives the IO context (see `Demuxer`).
    let reader = unsafe { &mut *(opaque as *mut Reader<'_>) };
    let left = reader.data.len().saturating_sub(reader.pos);
    let n = left.min(usize::try_from(size).unwrap_or(0));
    if n == 0 {
        return ffi::AVERROR_EOF;
    }
    // SAFETY: FFmpeg hands a buffer of `size` bytes; `n <= size` and `n <= left`.
    unsafe { ptr::copy_nonoverlapping(reader.data.as_ptr().add(reader.pos), buf, n) };
    reader.pos += n;
    n as c_int
}

unsafe extern "C" fn seek(opaque: *mut c_void, offset: i64, whence: c_int) -> i64 {
    // SAFETY: as in `read_packet`.
    let reader = unsafe { &mut *(opaque as *mut Reader<'_>) };
    let len = reader.data.len() as i64;
    if whence & ffi::AVSEEK_SIZE as c_int != 0 {
        return len;
    }
    let base = match whence & !(ffi::AVSEEK_FORCE as c_int) {
        0 => 0,
        1 => reader.pos as i64,
        2 => len,
        _ => return i64::from(ffi::AVERROR(ffi::EINVAL)),
    };
    match base.checked_add(offset) {
        Some(target) if (0..=len).contains(&target) => {
            reader.pos = target as usize;
            target
        }
        _ => i64::from(ffi::AVERROR(ffi::EINVAL)),
    }
}

unsafe extern "C" fn interrupted(opaque: *mut c_void) -> c_int {
    // SAFETY: `opaque` is the boxed deadline that outlives the format context.
    let deadline = unsafe { &*(opaque as *const Option<Instant>) };
    c_int::from(deadline.is_some_and(|d| Instant::now() >= d))
}

/// What an open input may hold, how long it may take, and how far libavformat reads ahead.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InputLimits {
    pub max_streams: usize,
    /// Opening and reading stop with [`FfError::Deadline`] after this.
    pub deadline: Option<Instant>,
    /// The bytes libavformat may read to learn a stream's codec and parameters (its
    /// `probesize`); its default (5 MB) where `None`.
    pub probe_bytes: Option<i64>,
}

impl InputLimits {
    /// [`FfError::Deadline`] once the deadline has passed.
    pub fn check_deadline(&self) -> Result<(), FfError> {
        match self.deadline {
            Some(d) if Instant::now() >= d => Err(FfError::Deadline),
            _ => Ok(()),
        }
    }
}

/// An open input over borrowed bytes. Field order is drop order: the format context
/// first, then the IO context, then what their callbacks point into.
pub struct MemoryInput<'a> {
    pub input: ManuallyDrop<ff::format::context::Input>,
    avio: *mut ffi::AVIOContext,
    _reader: Box<Reader<'a>>,
    _deadline: Box<Option<Instant>>,
    /// The bytes `_reader` reads from and their probed demuxer, for opening them again
    /// without probing again.
    data: &'a [u8],
    format: Format,
    /// libavformat's name of the demuxer, e.g. `matroska,webm`.
    pub container: String,
}

impl std::fmt::Debug for MemoryInput<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryInput")
            .field("bytes", &self.data.len())
            .field("container", &self.container)
            .finish()
    }
}

impl Drop for MemoryInput<'_> {
    fn drop(&mut self) {
        // SAFETY: the input is dropped exactly once here; with custom IO it leaves `avio`
        // alone, which is then freed with the buffer FFmpeg may have replaced.
        unsafe {
            ManuallyDrop::drop(&mut self.input);
            free_avio(&mut self.avio);
        }
    }
}

/// Frees an IO context made by `avio_alloc_context` and its current buffer.
unsafe fn free_avio(avio: &mut *mut ffi::AVIOContext) {
    if avio.is_null() {
        return;
    }
    // SAFETY: `avio` is a live IO context whose buffer FFmpeg allocated with av_malloc.
    unsafe {
        ffi::av_freep(ptr::addr_of_mut!((**avio).buffer) as *mut c_void);
        ffi::avio_context_free(avio);
    }
}

/// The largest block FFmpeg may allocate (its own default is 2 GiB). Some demuxers allocate
/// what a header claims before reading it: a 3.5 kB WAV whose INFO chunk claims 1.3 GB had
/// that much zeroed. The largest block a file within the caps needs is a frame of the largest
/// video allowed converted to RGB (8192 x 8192 x 3 bytes, 192 MiB).
pub const MAX_ALLOC: usize = 256 << 20;

/// Sets FFmpeg up once per process: its log silenced (it would print every complaint about a
/// hostile file to stderr) and its allocations bounded by [`MAX_ALLOC`].
pub fn configure() {
    static CONFIGURED: Once = Once::new();
    CONFIGURED.call_once(|| {
        ff::util::log::set_level(ff::util::log::Level::Quiet);
        // SAFETY: av_max_alloc only stores the bound, read by every later allocation.
        unsafe { ffi::av_max_alloc(MAX_ALLOC) };
    });
}

impl<'a> MemoryInput<'a> {
    /// Opens `data` with the demuxer `format` alone (named by
    /// [`probe_format`](super::probe::probe_format)), so no other demuxer reads the data.
    pub fn open(
        data: &'a [u8],
        format: Format,
        limits: &InputLimits,
    ) -> Result<MemoryInput<'a>, FfError> {
        configure();
        let mut reader = Box::new(Reader { data, pos: 0 });
        let deadline = Box::new(limits.deadline);
        let oom = || FfError::OutOfMemory;
        // SAFETY: every pointer below is checked before use; on each failure path what was
        // allocated so far is freed, and on success `Demuxer` owns it all.
        unsafe {
            let buffer = ffi::av_malloc(IO_BUFFER) as *mut u8;
            if buffer.is_null() {
                return Err(oom());
            }
            let mut avio = ffi::avio_alloc_context(
                buffer,
                IO_BUFFER as c_int,
                0,
                ptr::addr_of_mut!(*reader) as *mut c_void,
                Some(read_packet),
                None,
                Some(seek),
            );
            if avio.is_null() {
                ffi::av_free(buffer as *mut c_void);
                return Err(oom());
            }
            let mut ctx = ffi::avformat_alloc_context();
            if ctx.is_null() {
                free_avio(&mut avio);
                return Err(oom());
            }
            (*ctx).pb = avio;
            (*ctx).flags |= ffi::AVFMT_FLAG_CUSTOM_IO as c_int;
            (*ctx).max_streams = c_int::try_from(limits.max_streams).unwrap_or(c_int::MAX);
            if let Some(bytes) = limits.probe_bytes {
                (*ctx).probesize = bytes;
            }
            (*ctx).interrupt_callback = ffi::AVIOInterruptCB {
                callback: Some(interrupted),
                opaque: ptr::addr_of!(*deadline) as *mut c_void,
            };
            let ret = ffi::avformat_open_input(&mut ctx, ptr::null(), format.0, ptr::null_mut());
            if ret < 0 {
                // avformat_open_input freed the context; the IO context is still ours.
                free_avio(&mut avio);
                // A demuxer that meets one stream past `max_streams` fails with ENOMEM; so does
                // one whose header asks for a block over `MAX_ALLOC`, which FFmpeg refuses.
                if ret == ffi::AVERROR(ffi::ENOMEM) {
                    return Err(FfError::TooManyStreams {
                        limit: limits.max_streams,
                    });
                }
                return Err(ff_failure("reading the headers")(ff::Error::from(ret)));
            }
            let container = CStr::from_ptr((*format.0).name)
                .to_string_lossy()
                .into_owned();
            Ok(MemoryInput {
                input: ManuallyDrop::new(ff::format::context::Input::wrap(ctx)),
                avio,
                _reader: reader,
                _deadline: deadline,
                data,
                format,
                container,
            })
        }
    }

    /// The same bytes from the top, with the demuxer already probed (probing every demuxer
    /// over the first MiB is most of an open's cost).
    pub fn reopen(&self, limits: &InputLimits) -> Result<MemoryInput<'a>, FfError> {
        Self::open(self.data, self.format, limits)
    }

    /// The next packet of stream `index`; `None` at the end of the data.
    pub fn next_packet(
        &mut self,
        index: usize,
        limits: &InputLimits,
    ) -> Result<Option<ff::Packet>, FfError> {
        loop {
            // A fresh packet per read: av_read_frame may overwrite one that still holds a
            // buffer, which would leak it.
            let mut packet = ff::Packet::empty();
            match packet.read(&mut self.input) {
                Ok(()) if packet.stream() == index => return Ok(Some(packet)),
                Ok(()) => limits.check_deadline()?,
                Err(ff::Error::Eof) => return Ok(None),
                Err(e) => return Err(ff_failure("reading a packet")(e)),
            }
        }
    }
}
