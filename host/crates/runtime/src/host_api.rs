//! The versions of `airlock:host` this host provides, the `context` interface of 0.2.0
//! and the `settings` interface of 0.3.0.
//!
//! Rule: a component records the host version it targets through its imports, and the host
//! links it only when every `airlock:host` interface it imports exists at exactly the
//! version it names. The targeted version is the highest among those imports; a component
//! that imports nothing from `airlock:host` targets none. One implementation serves every
//! version: 0.2.0 imports `upstream` and `log` at 0.1.0, unchanged; 0.3.0 imports those
//! and `context` at 0.2.0, unchanged.
//!
//! Accepted imports (anything else under `airlock:host` is refused at load, naming the
//! import and its version; wasmtime's own semver matching would link `upstream@0.1.1` to
//! `upstream@0.1.0`, so the check is made before linking):
//!
//! | import | since | targets |
//! |---|---|---|
//! | `airlock:host/upstream@0.1.0` | 0.1.0 | 0.1.0 |
//! | `airlock:host/log@0.1.0` | 0.1.0 | 0.1.0 |
//! | `airlock:host/context@0.2.0` | 0.2.0 | 0.2.0 |
//! | `airlock:host/settings@0.3.0` | 0.3.0 | 0.3.0 |
//!
//! `context` answers from the call's [`CallContext`](super::CallContext) and deadline:
//! `current-intent` is present only when the call carries an idempotency key (an intent
//! with an effect, or a host-supplied key); `remaining-ms` counts down to the deadline
//! set when the call's Store was created. `settings` answers from the mapping manifest's
//! `[settings]` (the reviewed revision's; the model never reaches them).

use std::time::Instant;

use anyhow::{Result, bail};
use wasmtime::component::{HasSelf, Linker};

use super::CallState;

mod bindings {
    wasmtime::component::bindgen!({
        path: "../../../wit/worlds-v0.2.0",
        world: "airlock:host/adapter-host@0.2.0",
        imports: { default: async },
        with: {
            "airlock:host/upstream@0.1.0": crate::bindings::airlock::host::upstream,
            "airlock:host/log@0.1.0": crate::bindings::airlock::host::log,
        },
    });
}

mod bindings_0_3_0 {
    wasmtime::component::bindgen!({
        path: "../../../wit/worlds-v0.3.0",
        world: "airlock:host/adapter-host@0.3.0",
        imports: { default: async },
        with: {
            "airlock:host/upstream@0.1.0": crate::bindings::airlock::host::upstream,
            "airlock:host/log@0.1.0": crate::bindings::airlock::host::log,
            "airlock:host/context@0.2.0": super::bindings::airlock::host0_2_0::context,
        },
    });
}

use bindings::airlock::host0_2_0::context;
use bindings_0_3_0::airlock::host0_3_0::settings;

/// A released version of `airlock:host`, oldest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub enum HostVersion {
    /// `airlock:host@0.1.0`: `upstream`, `log`.
    #[serde(rename = "0.1.0")]
    V0_1_0,
    /// `airlock:host@0.2.0`: adds `context`.
    #[serde(rename = "0.2.0")]
    V0_2_0,
    /// `airlock:host@0.3.0`: adds `settings`.
    #[serde(rename = "0.3.0")]
    V0_3_0,
}

impl HostVersion {
    /// The semver text, e.g. `0.2.0`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V0_1_0 => "0.1.0",
            Self::V0_2_0 => "0.2.0",
            Self::V0_3_0 => "0.3.0",
        }
    }
}

impl std::fmt::Display for HostVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The host's package name, as imports spell it before the `/`.
pub const HOST_PACKAGE: &str = "airlock:host";

/// Every `airlock:host` interface this host provides, with the version it is imported at.
pub const HOST_INTERFACES: &[(&str, HostVersion)] = &[
    ("upstream", HostVersion::V0_1_0),
    ("log", HostVersion::V0_1_0),
    ("context", HostVersion::V0_2_0),
    ("settings", HostVersion::V0_3_0),
];

/// Judges one import name: `Ok(None)` when it is not under `airlock:host`, `Ok(Some(v))`
/// for an interface this host provides at version `v`.
///
/// # Errors
/// An `airlock:host` import this host does not provide; the message names the import and
/// its version.
pub fn host_import(name: &str) -> Result<Option<HostVersion>> {
    let Some(rest) = name
        .strip_prefix(HOST_PACKAGE)
        .and_then(|r| r.strip_prefix('/'))
    else {
        return Ok(None);
    };
    let provided = || {
        HOST_INTERFACES
            .iter()
            .map(|(i, v)| format!("{HOST_PACKAGE}/{i}@{v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some((interface, version)) = rest.split_once('@') else {
        bail!(
            "the component imports `{name}` without a version; this host provides {}",
            provided()
        );
    };
    let known = [
        HostVersion::V0_1_0,
        HostVersion::V0_2_0,
        HostVersion::V0_3_0,
    ]
    .into_iter()
    .find(|v| v.as_str() == version);
    let Some(known) = known else {
        bail!(
            "the component imports `{name}`, built against airlock:host {version}, which this host does not provide (it provides airlock:host 0.1.0, 0.2.0 and 0.3.0: {})",
            provided()
        );
    };
    match HOST_INTERFACES.iter().find(|(i, _)| *i == interface) {
        Some((_, v)) if *v == known => Ok(Some(known)),
        _ => bail!(
            "the component imports `{name}`, but airlock:host {version} has no interface `{interface}` (this host provides {})",
            provided()
        ),
    }
}

/// The `airlock:host` version a component targets, from its import names: the highest
/// version among its `airlock:host` imports, `None` when it has none.
///
/// # Errors
/// Any import [`host_import`] refuses.
pub fn host_version<'a>(imports: impl IntoIterator<Item = &'a str>) -> Result<Option<HostVersion>> {
    let mut highest = None;
    for name in imports {
        if let Some(v) = host_import(name)? {
            highest = highest.max(Some(v));
        }
    }
    Ok(highest)
}

/// The `airlock:host` version the component `bytes` targets (see [`host_version`]),
/// decoded (and compiled) with a plain engine; for reviewers' commands.
///
/// # Errors
/// Not a component; an `airlock:host` import this host does not provide.
pub fn component_host_version(bytes: &[u8]) -> Result<Option<HostVersion>> {
    let mut config = wasmtime::Config::new();
    config.wasm_component_model(true);
    let engine = wasmtime::Engine::new(&config).map_err(anyhow::Error::from)?;
    let component =
        wasmtime::component::Component::new(&engine, bytes).map_err(anyhow::Error::from)?;
    host_version(
        component
            .component_type()
            .imports(&engine)
            .map(|(name, _)| name),
    )
}

/// Adds `airlock:host/context@0.2.0` and `airlock:host/settings@0.3.0` to `linker`
/// (0.1.0's interfaces are linked by the caller, once, for every version).
pub(super) fn add_to_linker(linker: &mut Linker<CallState>) -> Result<()> {
    context::add_to_linker::<CallState, HasSelf<CallState>>(linker, |s| s)
        .map_err(anyhow::Error::from)?;
    settings::add_to_linker::<CallState, HasSelf<CallState>>(linker, |s| s)
        .map_err(anyhow::Error::from)
}

impl settings::Host for CallState {
    async fn get(&mut self, name: String) -> Option<settings::Value> {
        self.settings.get(&name).map(|v| match v {
            crate::manifest::SettingValue::Text(t) => settings::Value::Text(t.clone()),
            crate::manifest::SettingValue::Integer(i) => settings::Value::Integer(*i),
            crate::manifest::SettingValue::Boolean(b) => settings::Value::Boolean(*b),
        })
    }

    async fn names(&mut self) -> Vec<String> {
        self.settings.keys().cloned().collect()
    }
}

impl context::Host for CallState {
    async fn current_intent(&mut self) -> Option<context::Intent> {
        let c = &self.bridge.context;
        match (&c.intent_id, &c.idempotency_key) {
            (Some(id), Some(key)) => Some(context::Intent {
                id: id.clone(),
                idempotency_key: key.clone(),
                attempt: c.attempt,
            }),
            _ => None,
        }
    }

    async fn remaining_ms(&mut self) -> u64 {
        let left = self
            .bridge
            .deadline
            .saturating_duration_since(Instant::now());
        u64::try_from(left.as_millis()).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_version_is_the_highest_airlock_host_import() {
        let wasi = ["wasi:io/streams@0.2.6", "wasi:cli/stdout@0.2.6"];
        assert_eq!(host_version(wasi).unwrap(), None);
        let v1 = ["wasi:io/streams@0.2.6", "airlock:host/upstream@0.1.0"];
        assert_eq!(host_version(v1).unwrap(), Some(HostVersion::V0_1_0));
        let v1_log = ["airlock:host/log@0.1.0"];
        assert_eq!(host_version(v1_log).unwrap(), Some(HostVersion::V0_1_0));
        let v2 = [
            "airlock:host/upstream@0.1.0",
            "airlock:host/context@0.2.0",
            "airlock:host/log@0.1.0",
        ];
        assert_eq!(host_version(v2).unwrap(), Some(HostVersion::V0_2_0));
        assert_eq!(
            host_version(["airlock:host/context@0.2.0"]).unwrap(),
            Some(HostVersion::V0_2_0)
        );
        let v3 = [
            "airlock:host/upstream@0.1.0",
            "airlock:host/settings@0.3.0",
            "airlock:host/context@0.2.0",
        ];
        assert_eq!(host_version(v3).unwrap(), Some(HostVersion::V0_3_0));
        // A look-alike package is not the host's.
        assert_eq!(
            host_version(["airlock:hostile/context@9.0.0"]).unwrap(),
            None
        );
    }

    #[test]
    fn host_imports_at_versions_this_host_lacks_are_refused_by_name() {
        for (import, needle) in [
            ("airlock:host/context@0.4.0", "airlock:host 0.4.0"),
            (
                "airlock:host/context@0.3.0",
                "airlock:host 0.3.0 has no interface `context`",
            ),
            (
                "airlock:host/settings@0.2.0",
                "airlock:host 0.2.0 has no interface `settings`",
            ),
            ("airlock:host/upstream@0.1.1", "airlock:host 0.1.1"),
            ("airlock:host/upstream@1.0.0", "airlock:host 1.0.0"),
            (
                "airlock:host/context@0.1.0",
                "airlock:host 0.1.0 has no interface `context`",
            ),
            (
                "airlock:host/upstream@0.2.0",
                "airlock:host 0.2.0 has no interface `upstream`",
            ),
            (
                "airlock:host/filesystem@0.2.0",
                "has no interface `filesystem`",
            ),
            ("airlock:host/upstream", "without a version"),
        ] {
            let err = host_version(["wasi:io/streams@0.2.6", import])
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{import}: {err}");
            assert!(err.contains(import), "{import}: {err}");
        }
    }
}
