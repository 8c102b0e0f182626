//! The host imports on a native target (anything but `wasm32`), where no host exists.
//!
//! The generated import functions cannot run natively: they panic inside an `extern "C"`
//! function, which aborts the whole test binary. The SDK's own functions
//! ([`crate::upstream`], [`crate::log`], [`crate::context`]) come here instead: with the
//! `testing` feature and a [`crate::testing::Upstream`] installed on the calling thread,
//! the kit answers; otherwise they panic with a message that names the call and the
//! remedy (an ordinary panic, which `cargo test` reports for that test alone).

use crate::log::Level;
use crate::upstream::{ResourceContents, ToolOutput, UpstreamError};

#[cfg(not(feature = "testing"))]
fn no_host(what: &str) -> ! {
    panic!(
        "airlock_sdk: {what} was called outside the Airlock host (a native build has no host); \
         enable the SDK's `testing` feature in [dev-dependencies] and install a \
         `airlock_sdk::testing::Upstream` in the test (see the SDK README, \"Testing an adapter\")"
    )
}

pub(crate) fn call_tool(name: &str, arguments_json: &str) -> Result<ToolOutput, UpstreamError> {
    #[cfg(feature = "testing")]
    return crate::testing::call_tool(name, arguments_json);
    #[cfg(not(feature = "testing"))]
    {
        let _ = arguments_json;
        no_host(&format!("upstream::call_tool(`{name}`)"))
    }
}

pub(crate) fn read_resource(uri: &str) -> Result<Vec<ResourceContents>, UpstreamError> {
    #[cfg(feature = "testing")]
    return crate::testing::read_resource(uri);
    #[cfg(not(feature = "testing"))]
    no_host(&format!("upstream::read_resource({uri:?})"))
}

pub(crate) fn log(level: Level, message: &str) {
    #[cfg(feature = "testing")]
    crate::testing::log(level, message);
    #[cfg(not(feature = "testing"))]
    {
        // Diagnostics need no host: on a native target they go to stderr.
        eprintln!("[adapter {level:?}] {message}");
    }
}

pub(crate) fn current_intent() -> Option<crate::context::Intent> {
    #[cfg(feature = "testing")]
    return crate::testing::current_intent();
    #[cfg(not(feature = "testing"))]
    no_host("context::current_intent()")
}

pub(crate) fn remaining_ms() -> u64 {
    #[cfg(feature = "testing")]
    return crate::testing::remaining_ms();
    #[cfg(not(feature = "testing"))]
    no_host("context::remaining_ms()")
}

#[cfg(all(test, not(feature = "testing")))]
mod tests {
    /// A panic (which the harness reports for this test), not the abort of the whole test
    /// binary a panic inside the generated `extern "C"` import causes.
    #[test]
    #[should_panic(
        expected = "upstream::call_tool(`read_note`) was called outside the Airlock host"
    )]
    fn an_upstream_call_without_the_kit_panics_with_the_remedy() {
        let _ = crate::upstream::call_tool("read_note", "{}");
    }
}

pub(crate) fn setting(name: &str) -> Option<crate::settings::Value> {
    #[cfg(feature = "testing")]
    return crate::testing::setting(name);
    #[cfg(not(feature = "testing"))]
    no_host(&format!("settings::get({name:?})"))
}

pub(crate) fn setting_names() -> Vec<String> {
    #[cfg(feature = "testing")]
    return crate::testing::setting_names();
    #[cfg(not(feature = "testing"))]
    no_host("settings::names()")
}
