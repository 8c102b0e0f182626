//! The `airlock` command line; see [`airlock::cli`].

fn main() -> std::process::ExitCode {
    // The confinement helper between the host and a confined upstream server: before
    // anything else, while this process has one thread (see airlock::upstream::confine).
    if std::env::args_os().nth(1).as_deref()
        == Some(std::ffi::OsStr::new(airlock::upstream::confine::HELPER_ARG))
    {
        airlock::upstream::confine::helper::run();
    }
    airlock::cli::main()
}
