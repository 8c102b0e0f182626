//! The `airlock` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use rmcp::ServiceExt as _;
use tracing_subscriber::EnvFilter;

use airlock::config::ServeConfig;
use airlock::gateway::Host;

/// Runs reviewed MCP adapters (WebAssembly components) between an AI application and
/// upstream MCP servers.
///
/// Logs go to stderr; set AIRLOCK_LOG (e.g. `debug`, `airlock=trace`) to change the level.
#[derive(Parser)]
#[command(name = "airlock", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the gateway over stdio: MCP on stdin/stdout, logs on stderr.
    ///
    /// Loads each mapping (refusing any component whose sha256 differs from its pin),
    /// starts every connection a mapping uses, then answers tools/list and tools/call
    /// until stdin closes.
    #[command(after_help = "\
Configuration (TOML; relative paths resolve against the file's folder):

  [[connection]]
  name = \"notes\"
  command = \"@airlock\"                # a path, a name on PATH, or @airlock (this binary)
  args = [\"fixture\", \"notes-server\"]  # @airlock fixture notes-server: the bundled notes server
  # cwd = \".\"  env = { KEY = \"value\" }  (the server's whole environment; default: empty)

  [[mapping]]
  manifest = \"target/airlock/adapters/source-library/mapping.toml\"

The build writes pinned mappings for the bundled adapters into target/airlock/adapters/.
See README.md (\"Serving a real MCP client\") and airlock.example.toml.")]
    Serve {
        /// Serve configuration (TOML): [[connection]] and [[mapping]] entries.
        #[arg(long, short, value_name = "FILE")]
        config: PathBuf,
        /// Cache compiled components here (private folder, mode 0700). Default:
        /// $XDG_CACHE_HOME/airlock/compiled or ~/.cache/airlock/compiled.
        #[arg(long, value_name = "DIR", env = "AIRLOCK_CACHE_DIR")]
        cache_dir: Option<PathBuf>,
        /// Compile every component at start; read and write no cache.
        #[arg(long, conflicts_with = "cache_dir")]
        no_cache: bool,
    },
    /// Review one adapter: its mapping's grants and limits, the WIT imports and exports
    /// its component actually has, and a verdict for every import.
    ///
    /// Refuses a component whose sha256 differs from the mapping's pin, as the host does.
    /// Prints no environment or secret value: only variable and secret names.
    #[command(after_help = "\
Exit status: 0 when every import is justified (by the host API, the baseline, or a grant);
2 when an import is FLAGGED (after printing the review; --allow-flagged exits 0 instead);
1 on an error (unreadable or invalid manifest or component, pin mismatch).

Example:
  airlock grants target/airlock/adapters/source-library/mapping.toml
See README.md (\"Reviewing an adapter: `airlock grants`\").")]
    Grants {
        /// The mapping manifest, e.g. target/airlock/adapters/source-library/mapping.toml.
        #[arg(value_name = "MANIFEST")]
        manifest: PathBuf,
        /// Print the review as JSON.
        #[arg(long, conflicts_with = "html")]
        json: bool,
        /// Print the review as one self-contained HTML page.
        #[arg(long)]
        html: bool,
        /// Exit 0 even when an import is flagged.
        #[arg(long)]
        allow_flagged: bool,
    },
    /// Run the embedded default: the bundled notes server and source-library adapter,
    /// driven by an in-process MCP client through the real gateway; prints each step.
    Demo,
    /// Run a bundled fixture MCP server over stdio (used by the demo and tests).
    #[command(hide = true)]
    Fixture {
        #[command(subcommand)]
        which: Fixture,
    },
}

#[derive(Subcommand)]
enum Fixture {
    /// The synthetic notes library (`search_notes`, `read_note`, `notes://` resources).
    NotesServer {
        /// Arguments for the fixture server (e.g. `--call-log FILE`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn init_logging(default: &str) {
    let filter = EnvFilter::try_from_env("AIRLOCK_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let cli_command = match cli.command {
        Command::Grants {
            manifest,
            json,
            html,
            allow_flagged,
        } => return grants(&manifest, json, html, allow_flagged),
        other => other,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("airlock: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli_command {
            Command::Grants { .. } => unreachable!("handled before the async runtime starts"),
            Command::Serve {
                config,
                cache_dir,
                no_cache,
            } => {
                init_logging("airlock=info");
                let cache_dir = match (no_cache, cache_dir) {
                    (true, _) => None,
                    (false, Some(dir)) => Some(dir),
                    (false, None) => airlock::config::default_cache_dir(),
                };
                serve(config, cache_dir).await
            }
            Command::Demo => {
                init_logging("warn,rmcp=error");
                airlock::demo::run(std::io::stdout()).await
            }
            Command::Fixture {
                which: Fixture::NotesServer { args },
            } => {
                init_logging("info");
                let options = airlock_fixture_notes::parse_args(args.into_iter())
                    .map_err(|e| anyhow::anyhow!(e))?;
                airlock_fixture_notes::serve_stdio(options).await
            }
        }
    });
    // Upstream children and background readers must not keep the process alive.
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("airlock: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `airlock grants`: prints the review; exit status 2 when an import is flagged (unless
/// `allow_flagged`), 1 on an error.
fn grants(manifest: &std::path::Path, json: bool, html: bool, allow_flagged: bool) -> ExitCode {
    let review = match airlock::review::review(manifest) {
        Ok(review) => review,
        Err(e) => {
            eprintln!("airlock: error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let out = if json {
        review.to_json() + "\n"
    } else if html {
        review.to_html()
    } else {
        review.to_text()
    };
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
    {
        eprintln!("airlock: error: writing the review: {e}");
        return ExitCode::FAILURE;
    }
    if review.has_flagged() && !allow_flagged {
        eprintln!(
            "airlock: {} flagged import(s) in mapping `{}`; exiting with status 2 (--allow-flagged to exit 0)",
            review.flagged, review.mapping.name
        );
        return ExitCode::from(2);
    }
    ExitCode::SUCCESS
}

async fn serve(config_path: PathBuf, cache_dir: Option<PathBuf>) -> Result<()> {
    let mut config = ServeConfig::load(&config_path)?;
    config.cache_dir = cache_dir;
    let host = Host::start(&config).await?;
    tracing::info!(
        capabilities = host.capabilities().len(),
        "serving MCP on stdio"
    );
    let gateway = host.session();
    let running = gateway
        .serve(rmcp::transport::stdio())
        .await
        .context("MCP initialize with the client on stdio")?;
    running.waiting().await.context("gateway session")?;
    Ok(())
}
