//! Bindings for the KV routing index and block hashing. Index operations take microseconds
//! and mutate shared state, so they keep the GIL; hashing a prompt releases it.

use std::collections::HashMap;

use numpy::PyReadonlyArray1;
use pyo3::create_exception;
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;

use crate::kv::{self, KvIndex, KvIndexError, MediaSpan, StoredBlock};

create_exception!(
    mmserve._mm,
    UnknownParentError,
    PyKeyError,
    "A stored KV event names a parent block the index does not hold for that worker: an event \
     was missed, so the worker should be resynchronised from a dump."
);

fn to_py(err: KvIndexError) -> PyErr {
    match err {
        KvIndexError::UnknownParent { .. } => UnknownParentError::new_err(err.to_string()),
        _ => PyValueError::new_err(err.to_string()),
    }
}

/// Local block hashes of `tokens` (uint32); `media_spans` lists `(mm_hash, start, end)` token
/// ranges, attached to every block they overlap.
#[pyfunction]
#[pyo3(signature = (tokens, block_size, media_spans = Vec::new(), lora_name = None))]
fn compute_block_hashes(
    py: Python<'_>,
    tokens: PyReadonlyArray1<'_, u32>,
    block_size: usize,
    media_spans: Vec<(u64, usize, usize)>,
    lora_name: Option<String>,
) -> PyResult<Vec<u64>> {
    let tokens = tokens.as_array().to_vec();
    let media: Vec<MediaSpan> = media_spans
        .into_iter()
        .map(|(mm_hash, start, end)| MediaSpan {
            mm_hash,
            start,
            end,
        })
        .collect();
    py.detach(|| kv::compute_block_hashes(&tokens, block_size, &media, lora_name.as_deref()))
        .map_err(to_py)
}

/// Chained sequence hashes of consecutive local hashes, continuing after `parent`.
#[pyfunction]
#[pyo3(signature = (local_hashes, parent = None))]
fn compute_seq_hashes(local_hashes: Vec<u64>, parent: Option<u64>) -> Vec<u64> {
    kv::compute_seq_hashes(&local_hashes, parent)
}

/// `(parent_hash, [(block_hash, tokens_hash), ...])`: one stored run of a dump.
type DumpedRun = (Option<u64>, Vec<(u64, u64)>);

/// Radix index of the KV blocks each worker holds.
#[pyclass(name = "KvIndex", module = "mmserve._mm")]
#[derive(Default)]
struct PyKvIndex {
    inner: KvIndex,
}

#[pymethods]
impl PyKvIndex {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// Store `(block_hash, tokens_hash)` blocks of `worker_id` in order after `parent_hash`.
    #[pyo3(signature = (worker_id, parent_hash, blocks))]
    fn apply_stored(
        &mut self,
        worker_id: &str,
        parent_hash: Option<u64>,
        blocks: Vec<(u64, u64)>,
    ) -> PyResult<()> {
        let blocks: Vec<StoredBlock> = blocks
            .into_iter()
            .map(|(block_hash, tokens_hash)| StoredBlock {
                block_hash,
                tokens_hash,
            })
            .collect();
        self.inner
            .apply_stored(worker_id, parent_hash, &blocks)
            .map_err(to_py)
    }

    fn apply_removed(&mut self, worker_id: &str, block_hashes: Vec<u64>) {
        self.inner.apply_removed(worker_id, &block_hashes);
    }

    fn clear_worker(&mut self, worker_id: &str) {
        self.inner.clear_worker(worker_id);
    }

    fn remove_worker(&mut self, worker_id: &str) {
        self.inner.remove_worker(worker_id);
    }

    /// `{worker_id: overlap_blocks}` for the workers holding a prefix of `local_hashes`.
    fn find_matches(&self, local_hashes: Vec<u64>) -> HashMap<&str, usize> {
        self.inner.find_matches(&local_hashes).into_iter().collect()
    }

    /// The worker's blocks as `(parent_hash, [(block_hash, tokens_hash), ...])` runs.
    fn dump(&self, worker_id: &str) -> Vec<DumpedRun> {
        self.inner
            .dump(worker_id)
            .into_iter()
            .map(|run| {
                let blocks = run
                    .blocks
                    .iter()
                    .map(|block| (block.block_hash, block.tokens_hash))
                    .collect();
                (run.parent, blocks)
            })
            .collect()
    }

    fn workers(&self) -> Vec<&str> {
        self.inner.workers()
    }

    fn num_blocks(&self, worker_id: &str) -> usize {
        self.inner.num_blocks(worker_id)
    }

    fn num_nodes(&self) -> usize {
        self.inner.num_nodes()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add(
        "UnknownParentError",
        m.py().get_type::<UnknownParentError>(),
    )?;
    m.add_class::<PyKvIndex>()?;
    m.add_function(wrap_pyfunction!(compute_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(compute_seq_hashes, m)?)?;
    Ok(())
}
