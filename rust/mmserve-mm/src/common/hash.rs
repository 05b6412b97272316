//! The identity of a media item: blake3 of its raw encoded bytes, truncated to u64.
//! The same value keys the encoder cache and becomes `mm_hash` for KV-aware routing.

/// blake3 of `bytes`, the first 8 digest bytes read as a little-endian u64.
pub fn content_hash(bytes: &[u8]) -> u64 {
    let digest = blake3::hash(bytes);
    let mut head = [0u8; 8];
    head.copy_from_slice(&digest.as_bytes()[..8]);
    u64::from_le_bytes(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_blake3_reference_vector_for_empty_input() {
        // blake3("") = af1349b9f5f9a1a6a0404dea36dcc949...; first 8 bytes read little-endian.
        assert_eq!(content_hash(b""), 0xa6a1_f9f5_b949_13af);
    }

    #[test]
    fn differs_for_different_bytes() {
        assert_ne!(content_hash(b"a"), content_hash(b"b"));
        assert_eq!(content_hash(b"abc"), content_hash(b"abc"));
    }
}
