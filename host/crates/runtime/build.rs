//! Guest build step: compiles the adapter components the host and its tests load.
//!
//! 1. Makes sure the active toolchain has the `wasm32-wasip2` target (`rustup target add`
//!    when it is missing; rustup here does not install what rust-toolchain.toml lists).
//! 2. Runs one nested `cargo build --release --target wasm32-wasip2 -p <guest>...` into
//!    `<workspace>/target/guests` (its own target dir, so it never waits on the lock of the
//!    outer build), with the outer build's environment (flags, wrappers, jobserver, build
//!    script variables) removed, and the workspace and `CARGO_HOME` paths remapped so that
//!    the components are byte-for-byte the same wherever they are built.
//! 3. Copies each component into `<workspace>/target/airlock/adapters/<mapping name>/` beside
//!    its `mapping.toml`, whose `[component]` table gains `sha256 = "<hex>"` (the pin).
//!
//! This crate finds that folder through `env!("AIRLOCK_ADAPTER_BUNDLE")`; the crates that
//! use it read it in their build scripts as `DEP_AIRLOCK_ADAPTERS_BUNDLE` (this package's
//! `links` metadata). The workspace root is three folders above this crate's
//! (`host/crates/runtime`), or `AIRLOCK_WORKSPACE_ROOT` when set.

use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

/// The guests' target triple.
const GUEST_TARGET: &str = "wasm32-wasip2";

/// Guest crates built into components: (package name, crate folder relative to the
/// workspace root). Each folder holds the mapping.toml that goes with the component.
const GUESTS: &[(&str, &str)] = &[
    ("source-library", "adapters/source-library"),
    ("fs-documents", "adapters/fs-documents"),
    ("outbox-delivery", "adapters/outbox-delivery"),
    ("memory-graph", "adapters/memory-graph"),
    ("workspace-edits", "adapters/workspace-edits"),
    ("knowledge-edits", "adapters/knowledge-edits"),
    ("version-control", "adapters/version-control"),
    ("rogue-call", "fixtures/adapters/rogue-call"),
    ("spin-forever", "fixtures/adapters/spin-forever"),
    ("hostile", "fixtures/adapters/hostile"),
    ("settings-echo", "fixtures/adapters/settings-echo"),
];

/// Inputs whose change rebuilds the guests (folders are scanned by cargo).
const WATCHED: &[&str] = &[
    "wit",
    "contracts",
    "sdk",
    "adapters",
    "fixtures/adapters",
    "Cargo.lock",
    "Cargo.toml",
    "rust-toolchain.toml",
];

/// Settings for the nested build only (small components, no debug info, the name section
/// kept for trap backtraces); the workspace's `[profile.release]` is unchanged.
const NESTED_CONFIG: &[&str] = &[
    "profile.release.debug=false",
    "profile.release.strip=\"debuginfo\"",
    "profile.release.opt-level=\"s\"",
    "profile.release.lto=true",
    "profile.release.codegen-units=1",
];

/// The first 8 bytes of a component binary: `\0asm`, version 0x0d, layer 1.
const COMPONENT_PREAMBLE: [u8; 8] = [0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00];

/// Environment variables of the outer build that must not reach the nested one.
const REMOVED_VARS: &[&str] = &[
    "RUSTFLAGS",
    "CARGO_ENCODED_RUSTFLAGS",
    "CARGO_BUILD_RUSTFLAGS",
    "CARGO_TARGET_DIR",
    "CARGO_BUILD_TARGET_DIR",
    "CARGO_BUILD_BUILD_DIR",
    "CARGO_BUILD_TARGET",
    "CARGO_BUILD_RUSTC_WRAPPER",
    "CARGO_BUILD_RUSTC_WORKSPACE_WRAPPER",
    "CARGO_MAKEFLAGS",
    "MAKEFLAGS",
    "MFLAGS",
    "CARGO_PRIMARY_PACKAGE",
    "RUSTC_WRAPPER",
    "RUSTC_WORKSPACE_WRAPPER",
    "LLVM_PROFILE_FILE",
    // Variables cargo sets for this build script.
    "OUT_DIR",
    "TARGET",
    "HOST",
    "NUM_JOBS",
    "OPT_LEVEL",
    "DEBUG",
    "PROFILE",
    "RUSTC_LINKER",
    "CARGO_MANIFEST_DIR",
    "CARGO_MANIFEST_PATH",
    "CARGO_MANIFEST_LINKS",
    "CARGO_CRATE_NAME",
    "CARGO_TARGET_TMPDIR",
    "CARGO_RUSTC_CURRENT_DIR",
];

/// Prefixes of outer-build variables that must not reach the nested one.
const REMOVED_PREFIXES: &[&str] = &[
    "CARGO_CFG_",
    "CARGO_FEATURE_",
    "CARGO_PKG_",
    "CARGO_LLVM_COV",
    "__CARGO",
    "DEP_",
];

fn main() {
    if let Err(message) = run() {
        eprintln!("error: airlock guest build failed: {message}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    println!("cargo:rerun-if-env-changed=AIRLOCK_WORKSPACE_ROOT");
    let root = workspace_root()?;
    for path in WATCHED {
        println!("cargo:rerun-if-changed={}", root.join(path).display());
    }

    ensure_target(&root)?;

    let guests_dir = root.join("target").join("guests");
    build_guests(&root, &guests_dir)?;

    let bundle = root.join("target").join("airlock").join("adapters");
    let artifacts = guests_dir.join(GUEST_TARGET).join("release");
    for (package, folder) in GUESTS {
        let built = artifacts.join(format!("{}.wasm", package.replace('-', "_")));
        bundle_guest(&built, &root.join(folder).join("mapping.toml"), &bundle)?;
    }

    println!(
        "cargo:rustc-env=AIRLOCK_ADAPTER_BUNDLE={}",
        bundle.display()
    );
    println!("cargo:bundle={}", bundle.display());
    Ok(())
}

/// `AIRLOCK_WORKSPACE_ROOT`, or the folder three above this crate's (`host/crates/runtime`).
fn workspace_root() -> Result<PathBuf, String> {
    if let Some(root) = env::var_os("AIRLOCK_WORKSPACE_ROOT").filter(|r| !r.is_empty()) {
        return Ok(PathBuf::from(root));
    }
    let manifest_dir = env::var_os("CARGO_MANIFEST_DIR")
        .ok_or("CARGO_MANIFEST_DIR is not set (not run by cargo?)")?;
    Path::new(&manifest_dir)
        .ancestors()
        .nth(3)
        .map(Path::to_path_buf)
        .ok_or_else(|| "the runtime crate is not three folders below the workspace root".to_owned())
}

/// Adds the guest target to the active toolchain when its standard library is missing.
fn ensure_target(root: &Path) -> Result<(), String> {
    let rustc = env::var_os("RUSTC").unwrap_or_else(|| OsString::from("rustc"));
    let mut probe = Command::new(&rustc);
    probe
        .args(["--print", "target-libdir", "--target", GUEST_TARGET])
        .current_dir(root);
    let output = probe
        .output()
        .map_err(|e| format!("could not run `{}`: {e}", command_line(&probe)))?;
    let libdir = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    if output.status.success() && !libdir.is_empty() && Path::new(&libdir).is_dir() {
        return Ok(());
    }

    println!(
        "cargo:warning=the {GUEST_TARGET} target is not installed for the active toolchain; \
         running `rustup target add {GUEST_TARGET}`"
    );
    let mut add = Command::new("rustup");
    add.args(["target", "add", GUEST_TARGET]).current_dir(root);
    if let Some(toolchain) = env::var_os("RUSTUP_TOOLCHAIN") {
        add.arg("--toolchain").arg(toolchain);
    }
    add.stdout(Stdio::from(std::io::stderr()));
    let status = add.status().map_err(|e| {
        format!(
            "could not run `{}` (is rustup installed?): {e}",
            command_line(&add)
        )
    })?;
    if !status.success() {
        return Err(format!(
            "`{}` failed ({status}); install the {GUEST_TARGET} target for this toolchain",
            command_line(&add)
        ));
    }
    Ok(())
}

/// A command as one would type it: program and arguments (environment changes left out).
fn command_line(cmd: &Command) -> String {
    let mut line = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        let arg = arg.to_string_lossy();
        line.push(' ');
        if arg.contains([' ', '"']) {
            line.push('\'');
            line.push_str(&arg);
            line.push('\'');
        } else {
            line.push_str(&arg);
        }
    }
    line
}

/// Whether the outer build's variable `key` must be kept from the nested build.
fn is_removed(key: &str) -> bool {
    REMOVED_VARS.contains(&key) || REMOVED_PREFIXES.iter().any(|p| key.starts_with(p))
}

/// Runs the one nested cargo build of every guest.
fn build_guests(root: &Path, guests_dir: &Path) -> Result<(), String> {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
    let mut cmd = Command::new(cargo);
    cmd.arg("build")
        .arg("--release")
        .arg("--target")
        .arg(GUEST_TARGET)
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"));
    for (package, _) in GUESTS {
        cmd.arg("-p").arg(package);
    }
    for setting in NESTED_CONFIG {
        cmd.arg("--config").arg(setting);
    }
    cmd.current_dir(root);
    for (key, _) in env::vars_os() {
        if let Some(key) = key.to_str().filter(|k| is_removed(k)) {
            cmd.env_remove(key);
        }
    }
    // Paths of the workspace and of the registry sources end up in panic messages; remapping
    // them makes the component (and so its pin) the same on every machine.
    let mut remaps = vec![remap(root, "/airlock")];
    if let Some(cargo_home) = cargo_home() {
        remaps.push(remap(&cargo_home, "/cargo-home"));
    }
    cmd.env("CARGO_ENCODED_RUSTFLAGS", remaps.join("\x1f"))
        .env("CARGO_TARGET_DIR", guests_dir)
        .env("CARGO_BUILD_BUILD_DIR", guests_dir)
        // Anything the nested cargo prints on stdout must not read as a build-script
        // directive of this one.
        .stdout(Stdio::from(std::io::stderr()));

    let status = cmd
        .status()
        .map_err(|e| format!("could not run `{}`: {e}", command_line(&cmd)))?;
    if !status.success() {
        return Err(format!(
            "`{}` (in {}, with CARGO_TARGET_DIR={}) failed ({status}); its messages are above",
            command_line(&cmd),
            root.display(),
            guests_dir.display()
        ));
    }
    Ok(())
}

/// A `--remap-path-prefix` flag replacing `from` with `to`.
fn remap(from: &Path, to: &str) -> String {
    format!("--remap-path-prefix={}={to}", from.display())
}

/// `CARGO_HOME`, or `$HOME/.cargo`.
fn cargo_home() -> Option<PathBuf> {
    env::var_os("CARGO_HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))
}

/// Copies one built component into `bundle/<mapping name>/` and writes its pinned mapping.
fn bundle_guest(built: &Path, mapping_path: &Path, bundle: &Path) -> Result<(), String> {
    let wasm = fs::read(built).map_err(|e| format!("could not read {}: {e}", built.display()))?;
    if !wasm.starts_with(&COMPONENT_PREAMBLE) {
        return Err(format!(
            "{} is not a WebAssembly component (wrong preamble)",
            built.display()
        ));
    }
    let mapping = fs::read_to_string(mapping_path)
        .map_err(|e| format!("could not read {}: {e}", mapping_path.display()))?;
    let context = |what: &str| format!("{}: {what}", mapping_path.display());

    let name = table_string(&mapping, "mapping", "name")
        .ok_or_else(|| context("no `name = \"...\"` in [mapping]"))?;
    let file = table_string(&mapping, "component", "file")
        .ok_or_else(|| context("no `file = \"...\"` in [component]"))?;
    for value in [&name, &file] {
        if !is_plain_file_name(value) {
            return Err(context(&format!("`{value}` is not a plain file name")));
        }
    }

    let digest = Sha256::digest(&wasm);
    let sha256 = hex(&digest);
    let pinned =
        pin_mapping(&mapping, &sha256).ok_or_else(|| context("[component] has no `file` line"))?;

    let dir = bundle.join(&name);
    fs::create_dir_all(&dir).map_err(|e| format!("could not create {}: {e}", dir.display()))?;
    write_if_changed(&dir.join(&file), &wasm)?;
    write_if_changed(&dir.join("mapping.toml"), pinned.as_bytes())?;
    Ok(())
}

/// Lowercase hex of `bytes`.
fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

/// The string value of `key` in table `[table]` of a flat TOML file (`key = "value"` lines).
fn table_string(toml: &str, table: &str, key: &str) -> Option<String> {
    let mut current = String::new();
    for line in toml.lines() {
        let line = line.trim();
        if let Some(header) = table_header(line) {
            current = header;
        } else if current == table && line_key(line) == Some(key) {
            let value = line.split_once('=')?.1.trim();
            let value = value.strip_prefix('"')?;
            return Some(value[..value.find('"')?].to_owned());
        }
    }
    None
}

/// `[name]` → `name`; `[[name]]` → `[name]` (never equal to a plain table's name).
fn table_header(line: &str) -> Option<String> {
    let inner = line.strip_prefix('[')?;
    let end = inner.rfind(']')?;
    Some(inner[..end].trim().to_owned())
}

/// The bare key of a `key = value` line.
fn line_key(line: &str) -> Option<&str> {
    if line.starts_with('#') {
        return None;
    }
    Some(line.split_once('=')?.0.trim().trim_matches('"'))
}

/// A file or folder name that stays inside the folder it is joined to.
fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0'])
}

/// `mapping` with `sha256 = "<hex>"` right after the `[component]` table's `file` line (any
/// earlier `sha256` line of that table is dropped). `None` when there is no such `file` line.
fn pin_mapping(mapping: &str, sha256: &str) -> Option<String> {
    let mut out = String::with_capacity(mapping.len() + 80);
    let mut current = String::new();
    let mut pinned = false;
    for line in mapping.lines() {
        let trimmed = line.trim();
        if let Some(header) = table_header(trimmed) {
            current = header;
        }
        let in_component = current == "component";
        if in_component && line_key(trimmed) == Some("sha256") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
        if in_component && !pinned && line_key(trimmed) == Some("file") {
            out.push_str("sha256 = \"");
            out.push_str(sha256);
            out.push_str("\"\n");
            pinned = true;
        }
    }
    pinned.then_some(out)
}

/// Writes `bytes` to `path` unless it already holds exactly them (keeps mtimes stable);
/// writes through a temporary file and a rename, so a reader never sees half a file.
fn write_if_changed(path: &Path, bytes: &[u8]) -> Result<(), String> {
    if fs::read(path).is_ok_and(|existing| existing == bytes) {
        return Ok(());
    }
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    let temporary = PathBuf::from(temporary);
    fs::write(&temporary, bytes)
        .and_then(|()| fs::rename(&temporary, path))
        .map_err(|e| format!("could not write {}: {e}", path.display()))
}
