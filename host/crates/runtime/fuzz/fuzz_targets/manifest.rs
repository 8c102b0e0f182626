//! Any text as a mapping manifest: parsing either succeeds or returns an error; it never
//! panics, and a manifest that parses keeps the rules its module states (checked by the
//! parser itself).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = airlock_runtime::manifest::MappingManifest::parse(text, "fuzz.toml");
    }
});
