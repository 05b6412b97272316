//! The only fan-out seam of the crate.
//!
//! Without the `parallel` feature everything runs inline on the caller's thread and no
//! thread is ever spawned. With it, work goes to one process-wide rayon pool of
//! `min(8, cores)` threads, or `MMSERVE_MM_THREADS` when that is set to a positive number.
//! Results come back in input order either way, so output is identical.

/// Upper bound on the default pool size: past this, memory bandwidth is the limit.
pub const MAX_DEFAULT_THREADS: usize = 8;

/// Environment variable that overrides the pool size.
pub const THREADS_ENV: &str = "MMSERVE_MM_THREADS";

/// The pool size this build uses (1 without `parallel`).
pub fn num_threads() -> usize {
    imp::num_threads()
}

/// `f` over every item, results in input order.
pub fn map<T, R, F>(items: &[T], f: F) -> Vec<R>
where
    T: Sync,
    R: Send,
    F: Fn(&T) -> R + Sync + Send,
{
    imp::map(items, f)
}

/// Like [`map`], but fails with the error of the lowest-indexed failing item, so the
/// error a caller sees does not depend on scheduling.
pub fn try_map<T, R, E, F>(items: &[T], f: F) -> Result<Vec<R>, (usize, E)>
where
    T: Sync,
    R: Send,
    E: Send,
    F: Fn(&T) -> Result<R, E> + Sync + Send,
{
    map(items, f)
        .into_iter()
        .enumerate()
        .map(|(index, r)| r.map_err(|e| (index, e)))
        .collect()
}

#[cfg(any(feature = "parallel", test))]
fn pool_size(env_value: Option<&str>, cores: usize) -> usize {
    match env_value.and_then(|v| v.trim().parse::<usize>().ok()) {
        Some(n) if n > 0 => n,
        _ => cores.clamp(1, MAX_DEFAULT_THREADS),
    }
}

#[cfg(feature = "parallel")]
mod imp {
    use std::sync::OnceLock;

    use rayon::prelude::*;

    fn pool() -> Option<&'static rayon::ThreadPool> {
        static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
        POOL.get_or_init(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let env = std::env::var(super::THREADS_ENV).ok();
            rayon::ThreadPoolBuilder::new()
                .num_threads(super::pool_size(env.as_deref(), cores))
                .thread_name(|i| format!("mmserve-mm-{i}"))
                .build()
                // Without a pool the work still runs, inline.
                .ok()
        })
        .as_ref()
    }

    pub fn num_threads() -> usize {
        pool().map_or(1, |p| p.current_num_threads())
    }

    pub fn map<T, R, F>(items: &[T], f: F) -> Vec<R>
    where
        T: Sync,
        R: Send,
        F: Fn(&T) -> R + Sync + Send,
    {
        match pool() {
            Some(p) if items.len() > 1 => p.install(|| items.par_iter().map(&f).collect()),
            _ => items.iter().map(f).collect(),
        }
    }
}

#[cfg(not(feature = "parallel"))]
mod imp {
    pub fn num_threads() -> usize {
        1
    }

    pub fn map<T, R, F>(items: &[T], f: F) -> Vec<R>
    where
        F: Fn(&T) -> R,
    {
        items.iter().map(f).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_size_defaults_to_cores_capped_and_honours_a_positive_override() {
        assert_eq!(pool_size(None, 2), 2);
        assert_eq!(pool_size(None, 64), MAX_DEFAULT_THREADS);
        assert_eq!(pool_size(None, 0), 1);
        assert_eq!(pool_size(Some("3"), 64), 3);
        assert_eq!(pool_size(Some("16"), 2), 16);
        assert_eq!(pool_size(Some("0"), 4), 4);
        assert_eq!(pool_size(Some("lots"), 4), 4);
    }

    #[test]
    fn map_keeps_order_and_try_map_reports_the_first_failing_index() {
        let items: Vec<u32> = (0..100).collect();
        assert_eq!(
            map(&items, |x| x * 2),
            (0..100).map(|x| x * 2).collect::<Vec<_>>()
        );
        let r = try_map(&items, |&x| if x % 30 == 29 { Err(x) } else { Ok(x) });
        assert_eq!(r, Err((29, 29)));
    }
}
