//! Large buffers backed by transparent huge pages where the kernel allows it.
//!
//! A buffer above glibc's mmap threshold is fresh memory on every call, and faulting it in
//! 4 KiB at a time cost more than the work at 1920x1080 and above (the 200 MB of
//! `pixel_values` of a 3840x2160 image are about 50,000 faults). `MADV_HUGEPAGE` on the
//! buffer before its first write makes them about 100 faults of 2 MiB. Only the whole 2 MiB
//! pages inside the buffer are advised, so no memory outside it is affected; the advice is a
//! hint, ignored where THP is `never` or absent (and off Linux). `MMSERVE_MM_HUGE_PAGES=0`
//! turns it off: with THP defrag `madvise`, a host whose free memory is fragmented compacts
//! memory on the first touch instead of faulting 4 KiB pages.

/// The x86-64 and aarch64 (4 KiB base pages) PMD size.
const HUGE_PAGE: usize = 2 << 20;

fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("MMSERVE_MM_HUGE_PAGES").map_or(true, |v| v != "0"))
}

/// `Vec::with_capacity(len)`, its allocation advised for huge pages.
pub fn with_capacity<T>(len: usize) -> Vec<T> {
    let buf = Vec::with_capacity(len);
    advise(&buf);
    buf
}

/// `vec![0u8; len]`, advised for huge pages. The zeroed allocation of a large buffer is a
/// fresh mapping that is not written, so the advice comes before its first touch.
pub fn zeroed_bytes(len: usize) -> Vec<u8> {
    let buf = vec![0u8; len];
    advise(&buf);
    buf
}

/// Advises the whole 2 MiB pages within `buf`'s allocation (its capacity) for huge pages.
/// Has an effect only on pages not yet touched: call it before the first write.
pub fn advise<T>(buf: &Vec<T>) {
    let bytes = buf.capacity().saturating_mul(std::mem::size_of::<T>());
    if bytes < 2 * HUGE_PAGE || !enabled() {
        return;
    }
    let start = buf.as_ptr() as usize;
    let first = start.next_multiple_of(HUGE_PAGE);
    let end = start.saturating_add(bytes) / HUGE_PAGE * HUGE_PAGE;
    if end <= first {
        return;
    }
    #[cfg(target_os = "linux")]
    // SAFETY: `first..end` lies inside `buf`'s own allocation (rounded inward to whole huge
    // pages, so page-aligned as madvise requires). MADV_HUGEPAGE changes only how the kernel
    // backs those pages, never their contents or mapping, so no Rust reference is affected;
    // a failure (EINVAL without THP) leaves the 4 KiB pages, which is what the return value
    // being ignored accepts.
    unsafe {
        libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_keep_their_length_and_contents() {
        let zeroed = zeroed_bytes(5 * HUGE_PAGE + 3);
        assert_eq!(zeroed.len(), 5 * HUGE_PAGE + 3);
        assert!(zeroed.iter().all(|&b| b == 0));
        let mut floats: Vec<f32> = with_capacity(HUGE_PAGE + 1);
        assert!(floats.capacity() > HUGE_PAGE);
        floats.extend((0..HUGE_PAGE + 1).map(|i| i as f32));
        assert_eq!(floats[HUGE_PAGE], HUGE_PAGE as f32);
        // Small and empty buffers are left alone.
        assert_eq!(zeroed_bytes(7), vec![0u8; 7]);
        assert!(with_capacity::<u64>(0).is_empty());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn large_buffers_are_advised_where_thp_allows_it() {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
        let Ok(mode) = mode else { return };
        if mode.contains("[never]") || !enabled() {
            return;
        }
        let buf = zeroed_bytes(8 * HUGE_PAGE);
        let (start, end) = (
            buf.as_ptr() as usize,
            buf.as_ptr() as usize + buf.capacity(),
        );
        // The advised range is a mapping of its own inside the buffer, with the `hg`
        // (VM_HUGEPAGE) flag.
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
        let mut inside = false;
        let mut flagged = false;
        for line in smaps.lines() {
            let range = line.split_once(' ').and_then(|(r, _)| r.split_once('-'));
            let bounds = range.and_then(|(lo, hi)| {
                Some((
                    usize::from_str_radix(lo, 16).ok()?,
                    usize::from_str_radix(hi, 16).ok()?,
                ))
            });
            if let Some((lo, hi)) = bounds {
                inside = lo >= start && hi <= end;
            } else if inside && line.starts_with("VmFlags:") && line.contains(" hg") {
                flagged = true;
            }
        }
        assert!(flagged, "no VM_HUGEPAGE mapping inside the buffer");
    }
}
