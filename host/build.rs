//! Hands the folder of the adapters `airlock-runtime`'s build script compiled and pinned
//! to this crate as `env!("AIRLOCK_ADAPTER_BUNDLE")` (the demo includes two of them in
//! the binary). The runtime crate builds the components; see its `build.rs`.

fn main() {
    let Some(bundle) = std::env::var_os("DEP_AIRLOCK_ADAPTERS_BUNDLE") else {
        eprintln!(
            "error: airlock-runtime did not report its adapter bundle (links metadata `bundle`)"
        );
        std::process::exit(1);
    };
    println!("cargo:rerun-if-env-changed=DEP_AIRLOCK_ADAPTERS_BUNDLE");
    println!(
        "cargo:rustc-env=AIRLOCK_ADAPTER_BUNDLE={}",
        bundle.to_string_lossy()
    );
}
