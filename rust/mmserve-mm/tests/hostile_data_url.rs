//! `data:` URLs a client may craft: percent escapes are exactly two hex digits, and what a
//! payload decodes to is capped like any other source.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails loudly"
)]

use mmserve_mm::source::fetch::{fetch_bytes, FetchPolicy};

#[test]
fn percent_escapes_need_two_hex_digits() {
    let policy = FetchPolicy::default();
    assert_eq!(fetch_bytes("data:,a%41%2f", &policy).unwrap(), b"aA/");
    // A sign is no hex digit, though `u8::from_str_radix("+1", 16)` reads it as 1.
    for bad in [
        "data:,%+1",
        "data:,%-1",
        "data:,% 1",
        "data:,%1",
        "data:,%",
        "data:,%g0",
    ] {
        let err = fetch_bytes(bad, &policy).unwrap_err();
        assert_eq!(err.code(), "fetch.bad_data_url", "{bad}");
    }
}

#[test]
fn decoded_payloads_are_capped() {
    let policy = FetchPolicy {
        max_bytes: 4,
        ..FetchPolicy::default()
    };
    assert_eq!(
        fetch_bytes("data:;base64,AAAAAA==", &policy).unwrap().len(),
        4
    );
    for over in ["data:;base64,AAAAAAA=", "data:,abcde", "AAAAAAA="] {
        let err = fetch_bytes(over, &policy).unwrap_err();
        assert_eq!(err.code(), "fetch.too_large", "{over}");
    }
}
