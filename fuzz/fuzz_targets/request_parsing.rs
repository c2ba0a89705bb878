//! The sidecar's request parsing, fed arbitrary bytes: JSON bodies for every route
//! that takes one, and path segments. Nothing may panic, and what is accepted must
//! be what the API promises: identifiers of 1 to 256 bytes without control
//! characters, quantities in range, exactly the fields asked for, and a parsed
//! reserve that reads back the same when written out again.
#![no_main]

use dropgate_sidecar::input::{self, Fields, Reserve};
use libfuzzer_sys::fuzz_target;

/// What every accepted identifier satisfies.
fn assert_id(value: &str) {
    assert!(!value.is_empty());
    assert!(value.len() <= 256, "{} bytes accepted", value.len());
    assert!(!value.chars().any(char::is_control), "control character accepted");
}

fuzz_target!(|data: &[u8]| {
    // The reserve body.
    if let Ok(reserve) = Reserve::parse(data) {
        assert_id(&reserve.key);
        assert_id(&reserve.user);
        assert!((1..=i64::from(i32::MAX)).contains(&reserve.quantity));
        let again = serde_json::json!({
            "key": reserve.key,
            "user": reserve.user,
            "quantity": reserve.quantity,
        })
        .to_string();
        assert_eq!(Reserve::parse(again.as_bytes()), Ok(reserve));
    }
    // The lock bodies (acquire, renew, release): fields taken as the routes take them.
    for allowed in [&["owner", "ttlMs", "waitMs"][..], &["token", "ttlMs"], &["token"]] {
        if let Ok(mut fields) = Fields::parse(data, allowed) {
            if let Ok(owner) = fields.id(allowed[0]) {
                assert_id(&owner);
            }
            if let Ok(n) = fields.int("ttlMs", 1, 86_400_000) {
                assert!((1..=86_400_000).contains(&n));
            }
        }
    }
    // Path segments, as warp hands them over (percent-encoded text).
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(segment) = input::path_id("drop", text) {
            assert_id(&segment);
        }
    }
});
