//! Any text as a serve configuration, resolved against a folder that exists: an error or
//! a configuration, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = airlock_gateway::config::ServeConfig::parse(text, std::path::Path::new("/tmp"));
    }
});
