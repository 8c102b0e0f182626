//! The `airlock` command line; see [`airlock::cli`].

fn main() -> std::process::ExitCode {
    airlock::cli::main()
}
