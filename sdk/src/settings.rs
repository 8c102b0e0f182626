//! The operator's settings for the mapping this adapter serves
//! (`airlock:host/settings@0.3.0`).
//!
//! Settings are the values of the reviewed manifest's `[settings]` table — a repository
//! path, a folder, a tenant id — the same for every call of one mapping revision. They
//! are part of what a reviewer approves (changing one is a new revision), and the model
//! never sees or sets them. Read them instead of compiling operator values into the
//! component: moving a repository then changes the manifest, not the component's pin.
//!
//! Calling anything here makes the component import `airlock:host/settings@0.3.0`, so it
//! **targets `airlock:host@0.3.0`**: its world is `airlock:worlds/<contract>-adapter@0.3.0`
//! (`wit/worlds-v0.3.0/worlds.wit`), which exports the same contract interface as the
//! older worlds. A host older than 0.3.0 refuses such a component at load.
//!
//! In a native test (the `testing` feature), `testing::Upstream::from_mapping` answers the
//! mapping's `[settings]`, and `testing::Upstream::setting` sets one.

pub use crate::bindings_host_0_3_0::airlock::host0_3_0::settings::Value;

#[cfg(target_arch = "wasm32")]
use crate::bindings_host_0_3_0::airlock::host0_3_0::settings as raw;

/// The value of setting `name`; `None` when the manifest does not set it.
pub fn get(name: &str) -> Option<Value> {
    #[cfg(target_arch = "wasm32")]
    return raw::get(name);
    #[cfg(not(target_arch = "wasm32"))]
    return crate::native::setting(name);
}

/// The names of every setting the manifest sets, sorted.
pub fn names() -> Vec<String> {
    #[cfg(target_arch = "wasm32")]
    return raw::names();
    #[cfg(not(target_arch = "wasm32"))]
    return crate::native::setting_names();
}

/// Setting `name` as text.
///
/// # Errors
/// It is not set, or it is not a string: the message names it and says what to add to
/// the manifest (an adapter maps it to its contract's error).
pub fn text(name: &str) -> Result<String, String> {
    match get(name) {
        Some(Value::Text(t)) => Ok(t),
        Some(other) => Err(format!(
            "setting `{name}` is {}, not a string; write `{name} = \"...\"` in the mapping's [settings]",
            kind(&other)
        )),
        None => Err(missing(name, "\"...\"")),
    }
}

/// Setting `name` as an integer.
///
/// # Errors
/// It is not set, or it is not an integer.
pub fn integer(name: &str) -> Result<i64, String> {
    match get(name) {
        Some(Value::Integer(i)) => Ok(i),
        Some(other) => Err(format!(
            "setting `{name}` is {}, not an integer; write `{name} = 10` in the mapping's [settings]",
            kind(&other)
        )),
        None => Err(missing(name, "10")),
    }
}

/// Setting `name` as a boolean.
///
/// # Errors
/// It is not set, or it is not a boolean.
pub fn boolean(name: &str) -> Result<bool, String> {
    match get(name) {
        Some(Value::Boolean(b)) => Ok(b),
        Some(other) => Err(format!(
            "setting `{name}` is {}, not a boolean; write `{name} = true` in the mapping's [settings]",
            kind(&other)
        )),
        None => Err(missing(name, "true")),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Text(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Boolean(_) => "a boolean",
    }
}

fn missing(name: &str, example: &str) -> String {
    format!("the mapping sets no `{name}`; add `{name} = {example}` to its [settings]")
}
