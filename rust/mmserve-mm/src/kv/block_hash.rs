//! Dynamo-compatible block hashes: local hashes of complete token blocks (with the media
//! objects each block overlaps) and the chained sequence hashes KV events carry.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::KvIndexError;

pub const BLOCK_HASH_SEED: u64 = 1337;

/// A media item's identity and its token range `[start, end)` in the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaSpan {
    pub mm_hash: u64,
    pub start: usize,
    pub end: usize,
}

/// The seed of the local block hashes: 1337, shifted for a named (non-empty) LoRA adapter.
pub fn block_hash_seed(lora_name: Option<&str>) -> u64 {
    match lora_name {
        Some(name) if !name.is_empty() => BLOCK_HASH_SEED.wrapping_add(xxh3_64(name.as_bytes())),
        _ => BLOCK_HASH_SEED,
    }
}

/// Local hashes of the complete blocks of `tokens`; each media span is attached to every block
/// it overlaps (as Dynamo's frontend builds `block_mm_infos`).
pub fn compute_block_hashes(
    tokens: &[u32],
    block_size: usize,
    media: &[MediaSpan],
    lora_name: Option<&str>,
) -> Result<Vec<u64>, KvIndexError> {
    if block_size == 0 {
        return Err(KvIndexError::ZeroBlockSize);
    }
    if let Some(span) = media.iter().find(|span| span.end <= span.start) {
        return Err(KvIndexError::BadMediaSpan {
            start: span.start,
            end: span.end,
        });
    }
    let seed = block_hash_seed(lora_name);
    // All tokens as u32 little-endian once (a plain copy on little-endian targets).
    let mut bytes = vec![0u8; 4 * tokens.len()];
    for (slot, token) in bytes.chunks_exact_mut(4).zip(tokens) {
        slot.copy_from_slice(&token.to_le_bytes());
    }
    let block_bytes = 4 * block_size;
    let mut buffer = Vec::with_capacity(block_bytes + 8 * media.len());
    let mut mm_hashes = Vec::with_capacity(media.len());
    let hashes = bytes
        .chunks_exact(block_bytes)
        .enumerate()
        .map(|(index, block)| {
            let (start, end) = (index * block_size, (index + 1) * block_size);
            mm_hashes.clear();
            mm_hashes.extend(
                media
                    .iter()
                    .filter(|span| span.start < end && start < span.end)
                    .map(|span| span.mm_hash),
            );
            if mm_hashes.is_empty() {
                return xxh3_64_with_seed(block, seed);
            }
            mm_hashes.sort_unstable();
            buffer.clear();
            buffer.extend_from_slice(block);
            for hash in &mm_hashes {
                buffer.extend_from_slice(&hash.to_le_bytes());
            }
            xxh3_64_with_seed(&buffer, seed)
        })
        .collect();
    Ok(hashes)
}

/// Chained sequence hashes of consecutive local hashes; `parent` is the sequence hash of the
/// block before the first one, if any.
pub fn compute_seq_hashes(local_hashes: &[u64], parent: Option<u64>) -> Vec<u64> {
    let mut previous = parent;
    local_hashes
        .iter()
        .map(|&local| {
            let current = match previous {
                None => local,
                Some(prev) => {
                    let mut bytes = [0u8; 16];
                    bytes[..8].copy_from_slice(&prev.to_le_bytes());
                    bytes[8..].copy_from_slice(&local.to_le_bytes());
                    xxh3_64_with_seed(&bytes, BLOCK_HASH_SEED)
                }
            };
            previous = Some(current);
            current
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_hash_by_hand() {
        let tokens: Vec<u32> = (0..16).collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let expected = xxh3_64_with_seed(&bytes, 1337);
        assert_eq!(
            compute_block_hashes(&tokens, 16, &[], None),
            Ok(vec![expected])
        );
        // Media hashes sorted and appended; the seed shifted for a LoRA name.
        let mut with_media = bytes.clone();
        with_media.extend(3u64.to_le_bytes());
        with_media.extend(5u64.to_le_bytes());
        let media = [
            MediaSpan {
                mm_hash: 5,
                start: 0,
                end: 4,
            },
            MediaSpan {
                mm_hash: 3,
                start: 10,
                end: 40,
            },
        ];
        let seed = 1337u64.wrapping_add(xxh3_64(b"lora"));
        assert_eq!(
            compute_block_hashes(&tokens, 16, &media, Some("lora")),
            Ok(vec![xxh3_64_with_seed(&with_media, seed)])
        );
        assert_eq!(block_hash_seed(Some("")), BLOCK_HASH_SEED);
    }

    #[test]
    fn seq_hashes_chain() {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&11u64.to_le_bytes());
        bytes[8..].copy_from_slice(&22u64.to_le_bytes());
        let second = xxh3_64_with_seed(&bytes, 1337);
        assert_eq!(compute_seq_hashes(&[11, 22], None), vec![11, second]);
        assert_eq!(compute_seq_hashes(&[22], Some(11)), vec![second]);
    }

    #[test]
    fn bad_block_inputs_are_errors() {
        assert_eq!(
            compute_block_hashes(&[1, 2], 0, &[], None),
            Err(KvIndexError::ZeroBlockSize)
        );
        let reversed = MediaSpan {
            mm_hash: 1,
            start: 5,
            end: 5,
        };
        assert_eq!(
            compute_block_hashes(&[1, 2], 1, &[reversed], None),
            Err(KvIndexError::BadMediaSpan { start: 5, end: 5 })
        );
    }
}
