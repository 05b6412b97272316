//! KV-aware routing: Dynamo-compatible block hashes and the index of the blocks each worker
//! holds.
//!
//! Block hashes: the local hash of a complete block of `block_size` tokens is xxh3_64 over the
//! tokens as u32 little-endian, followed, when media objects overlap the block, by their
//! mm_hashes sorted ascending as u64 little-endian; the seed is 1337, plus (wrapping add)
//! `xxh3_64(lora_name)` for a non-empty LoRA name. A partial tail block is not hashed. Sequence
//! hashes chain the local ones: `seq_0 = local_0`, `seq_i = xxh3_64(le(seq_{i-1}) ||
//! le(local_i), seed 1337)`.
//!
//! The index is a radix tree over local hashes: a node is one block after one exact prefix.
//! Each node lists the workers holding it with the block hash their KV events use for it (the
//! sequence hash); events name blocks by that hash, requests walk by local hashes. A worker's
//! overlap with a request is the number of leading blocks of the request it holds, without a
//! gap.
//!
//! `block_hash` computes the hashes; `radix` holds the index.

use thiserror::Error;

use crate::error::ErrorCode;

mod block_hash;
mod radix;

pub use block_hash::{
    block_hash_seed, compute_block_hashes, compute_seq_hashes, MediaSpan, BLOCK_HASH_SEED,
};
pub use radix::{KvIndex, StoredBlock, StoredRun};

#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvIndexError {
    #[error("block size must be positive")]
    ZeroBlockSize,
    #[error("media span [{start}, {end}) is empty or reversed")]
    BadMediaSpan { start: usize, end: usize },
    #[error("worker {worker:?} stored blocks after unknown parent {parent:#x}")]
    UnknownParent { worker: String, parent: u64 },
}

impl KvIndexError {
    /// This error's entry in the catalogue of codes.
    pub fn kind(&self) -> ErrorCode {
        match self {
            KvIndexError::ZeroBlockSize => ErrorCode::KvIndexZeroBlockSize,
            KvIndexError::BadMediaSpan { .. } => ErrorCode::KvIndexBadMediaSpan,
            KvIndexError::UnknownParent { .. } => ErrorCode::KvIndexUnknownParent,
        }
    }

    /// Stable machine-readable code, e.g. `kv_index.zero_block_size`.
    pub fn code(&self) -> &'static str {
        self.kind().code()
    }
}
