//! Media sources: the encoded bytes of one item from wherever the request points (`fetch`:
//! `data:` URLs, bare base64, local files, http(s)), and the base64 codec it uses.

pub mod base64;
pub mod fetch;
