//! The `airlock` command line: argument parsing (clap), then one function per command.
//!
//! Rule: [`main`] parses and dispatches; each command is one function named after it
//! (`serve`, `grants`, `discover`, `snapshots`, `review`, `trace`, `approvals`, `intents`,
//! `policy`, `new`, `pack`, `test`, `demo`, `fixture`) that opens what it needs and prints
//! its answer through [`output`] — text, or JSON with `--json` — on stdout. Errors go to
//! stderr as `airlock: error: …` (as safe lines where they can quote a server's words).
//! Exit status: 0 done; 1 an error, or a `test` fixture failed or is stale; 2 a command
//! line that clap or `--store` refuses, a `grants` review that flags an import, or `test`
//! inputs that cannot be used; 3 the trace does not verify.
//!
//! The commands' own work lives beside this file: [`operate`] (discover, snapshots,
//! review, trace; its reports and [`review`] (`airlock grants`) are the gateway's
//! [`crate::review`], shared with the console), [`approvals`], [`intents`], [`policy`],
//! [`author`] (new, pack), [`replay`] (test), [`demo`].

pub mod approvals;
pub mod author;
pub mod contracts;
pub mod demo;
pub mod intents;
pub mod learn;
pub mod operate;
pub mod output;
pub mod policy;
pub mod replay;
pub mod status;

/// `airlock grants`: the gateway's security review of one adapter.
pub use crate::review::grants as review;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use rmcp::ServiceExt as _;
use tracing_subscriber::EnvFilter;

use crate::config::ServeConfig;
use crate::host::Host;

/// Runs reviewed MCP adapters (WebAssembly components) between an AI application and
/// upstream MCP servers.
///
/// Logs go to stderr; set AIRLOCK_LOG (e.g. `debug`, `airlock=trace`) to change the level.
#[derive(Parser)]
#[command(name = "airlock", version)]
struct Cli {
    /// The store's folder (SQLite database `airlock.db`). This flag (or AIRLOCK_STATE_DIR)
    /// overrides the configuration's `state_dir`; without either, $XDG_STATE_HOME/airlock
    /// or ~/.local/state/airlock.
    #[arg(long, global = true, value_name = "DIR", env = "AIRLOCK_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// The store the operator commands (review, approvals, intents, trace, snapshots, …)
    /// read and write: `sqlite` (the default: airlock.db in the state folder) or the
    /// shared PostgreSQL store several hosts use — the same text as the configuration's
    /// `store` (a postgres:// URL or libpq key/value text). The host key comes from
    /// AIRLOCK_TRACE_KEY, else the state folder's trace.key. `serve` takes its store from
    /// the configuration instead.
    #[arg(long, global = true, value_name = "TARGET", env = "AIRLOCK_STORE")]
    store: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the gateway over stdio (MCP on stdin/stdout, logs on stderr), or over
    /// Streamable HTTP with --http.
    ///
    /// Loads each mapping (refusing, alone, any component whose sha256 differs from its
    /// pin), starts every connection a mapping uses in parallel (each within
    /// start_timeout) and snapshots its catalogue, offers the mappings whose pins match,
    /// then answers tools/list, tools/call and (2026-07-28) subscriptions/listen until
    /// stdin closes (stdio) or SIGTERM/SIGINT; then drains the calls in flight (at most
    /// 10 s) and stops every upstream server and its process group. Every request with an
    /// id is answered: lines that are not JSON, longer than 16 MiB or batches get a
    /// JSON-RPC error, and arguments a tool refuses are a tool result with isError (README
    /// "What the front answers").
    #[command(after_help = "\
Configuration (TOML; relative paths resolve against the file's folder):

  [[connection]]
  name = \"notes\"
  command = \"@airlock\"                # a path, a name on PATH, or @airlock (this binary)
  args = [\"fixture\", \"notes-server\"]  # @airlock fixture notes-server: the bundled notes server
  # cwd = \".\"  env = { KEY = \"value\" }  (the server's whole environment; default: empty)
  # or, over Streamable HTTP: url = \"https://mcp.example.com/mcp\" (http:// only to loopback)
  #   headers = { \"Authorization\" = { secret = \"notes-token\", prefix = \"Bearer \" } }
  #   with [secrets] notes-token = { env = \"NOTES_TOKEN\" }; see README \"HTTP upstream connections\"

  [[mapping]]
  manifest = \"target/airlock/adapters/source-library/mapping.toml\"

  # Top-level keys (before any table): mappings_dir = \"mappings\" (watched, hot-reloaded),
  # state_dir = \"state\", snapshot_interval = \"10m\", start_timeout = \"10s\" (spawn +
  # initialize + discovery of one connection; one that fails or takes longer is retried in
  # the background, 0.5 s doubling to 30 s, and offered once it is ready).
  # [http] and [http.auth]: allow-lists, body ceiling, bearer tokens for --http;
  #   [http] console = true also serves the operator console under /console.
  # [trace]: key (a [secrets] entry; default AIRLOCK_TRACE_KEY, else <state_dir>/trace.key),
  #   checkpoint_file, checkpoint_interval = \"5m\" (checkpoints also at shutdown).
  # [telemetry] metrics = \"127.0.0.1:9464\": also serve Prometheus metrics (GET /metrics) there;
  #   otlp = \"http://127.0.0.1:4318\": export OpenTelemetry spans (OTLP/HTTP) to that collector.

A mapping is offered only once a reviewer approved it (`airlock discover CONNECTION`,
then `airlock review approve MAPPING`), and only while its pinned tools do not drift.
The build writes pinned mappings for the bundled adapters into target/airlock/adapters/.
See README.md (\"Serving a real MCP client\") and airlock.example.toml.")]
    Serve(ServeArgs),
    /// Review one adapter: its mapping's grants and limits, the WIT imports and exports
    /// its component actually has, and a verdict for every import.
    ///
    /// Refuses a component whose sha256 differs from the mapping's pin, as the host does.
    /// Prints no environment or secret value: only variable and secret names.
    #[command(after_help = "\
With --state-dir (or AIRLOCK_STATE_DIR), the review also shows the registry's record: the
mapping's revision and state, each upstream tool's pinned schema and description digests
with the server's own hints, and the contract's effect class.

Exit status: 0 when every import is justified (by the host API, the baseline, or a grant)
and the host would load the mapping; 2 when an import is FLAGGED or the host would refuse
the mapping (a capability naming a function the contract lacks or the component does not
export, a missing contract export), after printing the review (--allow-flagged exits 0);
1 on an error (unreadable or invalid manifest or component, pin mismatch).

With --config FILE, it shows how that configuration launches the mapping's connection
and which of the server's tools (latest snapshot in its store) the mapping leaves
unreachable.

Example:
  airlock grants target/airlock/adapters/source-library/mapping.toml
  airlock grants my-notes/mapping.toml --config my-notes/airlock.toml
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
        /// Also show what changed since this earlier revision of the mapping (pins,
        /// component, connection, and every grant and limit). Needs the store.
        #[arg(long, value_name = "REV")]
        diff: Option<i64>,
        /// Serve configuration: show how it launches the mapping's connection (env and
        /// header names only) and, from its store's latest snapshot, the server's tools
        /// the mapping leaves unreachable; a connection it does not define is FLAGGED.
        #[arg(long, short, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Start one connection, take a discovery snapshot now, and print the classified drift
    /// against the previous snapshot and each mapping's pins.
    ///
    /// Records the snapshot (and a new configuration revision, if the connection's
    /// configuration changed); changes no mapping's state.
    #[command(after_help = "\
Example:
  airlock discover notes --config airlock.example.toml
  airlock discover docs --config airlock.toml --learn
The connection may be a command (stdio) or a url (Streamable HTTP; both protocol
generations, the negotiated one is printed). Lines marked `!` are meaning-bearing drift;
`·` is informational.")]
    Discover {
        /// The connection's configured name.
        #[arg(value_name = "CONNECTION")]
        connection: String,
        /// Serve configuration (TOML).
        #[arg(long, short, value_name = "FILE")]
        config: PathBuf,
        /// Also report what the confined server was refused while it started and answered
        /// discovery — each destination its egress proxy refused, each path its stderr
        /// says it was denied — and the grants that would allow it (printed, never
        /// applied; the state folder is never suggested).
        #[arg(long)]
        learn: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List or show recorded discovery snapshots.
    Snapshots {
        #[command(subcommand)]
        action: SnapshotsAction,
    },
    /// Review mappings: list them, show one (pins, drift, revisions), approve or retire.
    #[command(after_help = "\
A mapping serves only when a reviewer approved it against a snapshot of its connection's
current configuration revision, and only while the pinned tools' digests match.

Example:
  airlock discover notes --config airlock.example.toml
  airlock review show source-library
  airlock review approve source-library --config airlock.example.toml --reviewer alice")]
    Review {
        #[command(subcommand)]
        action: ReviewAction,
    },
    /// Read and verify the MACed, hash-chained trace; print checkpoints of its head.
    #[command(after_help = "\
Each event is MACed (HMAC-SHA256) with the host key: the state folder's trace.key, or
[trace] key (a named secret) / AIRLOCK_TRACE_KEY. A checkpoint (sequence number + head MAC,
MACed with the key) anchors the head outside the database: `airlock serve` appends one to
<state_dir>/trace-checkpoints.jsonl every [trace] checkpoint_interval and at shutdown.

Retention: with [trace] retain = \"30d\" (and/or retain_events = N), `serve` seals older
events into segment files (<state_dir>/trace-archive, or [trace] archive_dir) and deletes
them from the store, keeping what is still needed; a `trace-archived` event in the chain
names each segment, so `verify` still proves everything after it and `verify --archive DIR`
checks the segments themselves.

Example:
  airlock trace checkpoint >> /mnt/elsewhere/airlock-checkpoints.jsonl
  airlock trace verify --checkpoint /mnt/elsewhere/airlock-checkpoints.jsonl
  airlock trace archive --older-than 30d
  airlock trace verify --archive ~/.local/state/airlock/trace-archive")]
    Trace {
        #[command(subcommand)]
        action: TraceAction,
    },
    /// What the store says now: connections and the state each last entered, mappings
    /// and their states, approvals pending, intents open and held, the trace's head,
    /// archive and journal backlog, the newest checkpoint. Reads only; runs beside a
    /// serving host, against the state folder or the shared PostgreSQL store (--store).
    #[command(after_help = "\
A connection's state is the one its host last traced (with how long ago): a host that
stopped leaves its last state. Live figures of one running host are its metrics
(`serve --metrics ADDR`, or /metrics of `serve --http`; README \"Observability\").

Example:
  airlock status
  airlock status --json --limit 100")]
    Status {
        /// The checkpoint file whose newest line to show [default:
        /// <state_dir>/trace-checkpoints.jsonl].
        #[arg(long, value_name = "FILE")]
        checkpoint: Option<PathBuf>,
        /// List at most N pending approvals and N held intents, oldest first (the counts
        /// cover all).
        #[arg(long, value_name = "N", default_value_t = 10)]
        limit: usize,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The operator console: web pages where a person decides what waits for a person
    /// (the approvals inbox, held intents, mappings, connections, the trace). Reads and
    /// writes the same store as the CLI, beside a serving host or without one.
    #[command(after_help = "\
The console binds a loopback address only and prints a login link with a one-time
token to stderr: open it once in a browser on this machine (it sets an HttpOnly,
SameSite=Strict session cookie). Every decision is a form post carrying the session's
CSRF token, is checked against the trace first, and is recorded as made by
`USER (console)`; the session lasts until the console stops (restart it for a new
link). No JavaScript. For a team, serve the same pages from
`airlock serve --http` with `[http] console = true`: with [http.auth] people log in
with their bearer tokens and Cedar decides who may approve. See README \"Console\".

With --config, the mapping pages can also show each adapter's grants and approve a
mapping against its connection's latest snapshot (as `airlock review approve`).

Example:
  airlock console
  airlock console --addr 127.0.0.1:0 --config airlock.toml")]
    Console {
        /// The loopback address to listen on (port 0 picks a free one).
        #[arg(long, value_name = "ADDR", default_value = crate::console::DEFAULT_ADDR)]
        addr: String,
        /// The serve configuration (TOML): its store, and the adapters the mapping pages
        /// review and approve.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Approval requests: list, show, approve, deny, revoke (the out-of-band flow).
    #[command(after_help = "\
A call that policy marks require-approval asks a person. A client that can elicit asks at
the client; any other gets a tool error naming an approval request. Approve it here, then
make the same call again: it runs once. A receipt is bound to the requester, session,
capability, normalized arguments, mapping revision, snapshot and policy; if any of them
changes before the call is repeated, the call asks anew.

Example:
  airlock approvals list --state pending
  airlock approvals show apr_0123456789ab
  airlock approvals approve apr_0123456789ab --by alice     # shows it, asks you to type `approve`")]
    Approvals {
        #[command(subcommand)]
        action: ApprovalsAction,
    },
    /// Intents: the durable record of each effect, its attempts, and how unknown ones end.
    #[command(after_help = "\
Every call with an effect gets an intent: one id and one idempotency key for every attempt,
recorded before anything is sent. An attempt moves prepared → sent → acknowledged → result
observed → receipt verified → committed, each written when it becomes true. When the answer
to a sent request is lost (the upstream closed, timed out, the call was cancelled) the
outcome is `unknown`: the host never retries it blindly. It asks the contract's query (by
idempotency key) where the mapping says it can; a capability the mapping keeps idempotent but
not queryable is sent again with the same key; otherwise the intent is held for a person.

Example:
  airlock intents list --state unknown
  airlock intents show int_0123456789abcdef0123456789abcdef
  airlock intents resolve int_0123… --as completed --evidence \"outbox has delivery dlv_42\"
  airlock intents compensate int_0123… --config airlock.toml")]
    Intents {
        #[command(subcommand)]
        action: IntentsAction,
    },
    /// Policy: explain a decision, validate the policy files, print the Cedar schema.
    #[command(after_help = "\
Policies are Cedar files listed by `policy = [...]` in the serve configuration (none:
the built-in policy, `airlock policy show-builtin`). Decisions are allow, deny or
require-approval: a call denied with `context.approved == false` but permitted with
`context.approved == true` requires a person's approval.

Example:
  airlock policy check --config airlock.example.toml --requester alice \\
      --capability deliver_artifact --args '{\"artifact\":\"file-0001\",\"destination\":\"team-reports\"}'")]
    Policy {
        #[command(subcommand)]
        action: PolicyAction,
    },
    /// Contract packages: what each offers and does, and their review.
    #[command(after_help = "\
A contract package is a WIT package with a contract.toml beside it declaring, for every
function, its effect class (read, local-transformation, reversible-mutation,
external-effect), whether it is idempotent, which function reconciles an unknown outcome
(queryable-by) or undoes it (compensable-by), which are host-only, which string aliases are
handles and what identifies their objects. One sha256 covers the WIT and contract.toml.
The built-in packages (wit/v0.1.0, wit/v0.2.0) need no approval; a configuration adds its
own with [[contract]] path = \"FOLDER\", and a mapping may bind one once a reviewer
approved its digest. A released name@version never changes: a changed package is a new
version.

Example:
  airlock contracts list --config airlock.toml
  airlock contracts show example:workspace-edits@1.1.0 --config airlock.toml
  airlock contracts diff example:workspace-edits@1.0.0 contracts/workspace-edits-1.1 --config airlock.toml
  airlock contracts diff approved:example:workspace-edits@1.0.0 example:workspace-edits@1.1.0 --config airlock.toml
  airlock contracts approve example:workspace-edits@1.1.0 --config airlock.toml --reviewer alice")]
    Contracts {
        #[command(subcommand)]
        action: ContractsAction,
    },
    /// Write a ready adapter crate for one contract: Cargo.toml (the SDK by path),
    /// rust-toolchain.toml, src/lib.rs, mapping.toml (deny by default), airlock.toml; for a
    /// contract package folder also wit/ (its files) and bindings generated from it.
    #[command(after_help = "\
Example:
  airlock new --list
  airlock new source-retrieval my-notes --connection notes
  airlock new contracts/workspace-edits-1.1 my-edits
  airlock pack my-notes/mapping.toml
The crate depends on the SDK by path: --sdk PATH, or the `sdk` folder of the checkout this
airlock was built from (printed). src/lib.rs implements every contract function with its
first upstream call; mapping.toml lists no upstream tool and no grant until you add them.
See README.md (\"Writing an adapter\").")]
    New {
        /// The contract: a built-in one's full name (airlock:contracts/source-retrieval@0.1.0)
        /// or short name (source-retrieval), or a contract package folder (a path with a
        /// `/`, or an existing folder; README "Defining a contract").
        #[arg(value_name = "CONTRACT", required_unless_present = "list")]
        contract: Option<String>,
        /// The adapter's name: crate, mapping and component (a-z, 0-9, -, _).
        #[arg(value_name = "NAME", required_unless_present = "list")]
        name: Option<String>,
        /// The connection the mapping names (default: NAME).
        #[arg(long, value_name = "C")]
        connection: Option<String>,
        /// The folder to create (default: ./NAME); must not exist or be empty.
        #[arg(long, value_name = "D")]
        dir: Option<PathBuf>,
        /// The SDK folder to depend on (default: this airlock's own checkout).
        #[arg(long, value_name = "PATH")]
        sdk: Option<PathBuf>,
        /// List the contracts this host supports instead.
        #[arg(long, conflicts_with_all = ["connection", "dir", "sdk"])]
        list: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Build an adapter for wasm32-wasip2, place the component beside its manifest and
    /// write its sha256 pin; prints the next commands.
    #[command(after_help = "\
Runs `cargo build --release --target wasm32-wasip2` in the manifest's folder (adding the
target with rustup when the toolchain lacks it, and saying so), copies the component to
the manifest's [component] file, writes `sha256 = \"...\"` under it, and checks the
pinned manifest as the host would. The mapping still serves only once a reviewer
approves it: `airlock review approve NAME --config FILE --reviewer YOU`.")]
    Pack {
        /// The mapping manifest, in the adapter crate's folder (e.g. my-notes/mapping.toml).
        #[arg(value_name = "MANIFEST")]
        manifest: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Replay recorded fixtures against a mapping's real component: no live connection,
    /// no process started, no credentials.
    #[command(after_help = "\
Each fixture file (written by `airlock serve --config FILE --record DIR`) is one contract
call with the upstream exchanges it made. The component named by MANIFEST (pin checked)
runs in wasmtime under the manifest's limits; its upstream answers only from the fixture:
a request the fixture does not hold fails with `missing fixture: ...` naming the tool or
URI and its arguments. Each result is converted through the contract's result type and
compared with the recorded one. The report names the contract functions and the error
paths exercised.

A fixture recorded under another mapping revision or snapshot than the mapping under test
(the store's revision of this manifest; --state-dir or --config names the store; with
neither and no store in the default state folder, both are unknown) is refused, naming
both, unless --allow-stale. Passing moves a candidate revision to
fixture-tested (traced with the fixture digest; `airlock review show` prints it).

Exit status: 0 every fixture passed; 1 a fixture failed or is stale; 2 the manifest, the
component, the store or a fixture file cannot be used.

Example:
  airlock serve --config my-notes/airlock.toml --record my-notes/fixtures
  airlock test my-notes/mapping.toml --fixtures my-notes/fixtures --config my-notes/airlock.toml")]
    Test {
        /// The mapping manifest (its component beside it, as `airlock pack` placed it).
        #[arg(value_name = "MANIFEST")]
        manifest: PathBuf,
        /// The fixture folder (`*.json`, replayed in file-name order).
        #[arg(long, value_name = "DIR")]
        fixtures: PathBuf,
        /// Replay fixtures recorded under another mapping revision or snapshot anyway.
        #[arg(long)]
        allow_stale: bool,
        /// Serve configuration whose store (state_dir, [trace] key) records the mapping.
        /// Nothing it configures is started.
        #[arg(long, short, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run the embedded default: the bundled notes server and source-library adapter, then
    /// the delivery fixture under the example policy (a denial, an approval, a delivery
    /// once) and an operator's own contract (an edit approved, done once, undone), driven
    /// by an in-process MCP client through the real gateway; prints each step.
    #[command(after_help = "\
With --console, the demo instead leaves a delivery waiting for a person and serves the
console (README \"Console\") on --addr: open the login link it prints, approve (or deny)
the delivery in the browser, and the demo makes the same call again and shows it delivered
once. Stop it with Ctrl-C. Either way the demo keeps its state in a temporary folder
(--state-dir does not apply).")]
    Demo {
        /// Leave a pending approval and serve the console to decide it.
        #[arg(long)]
        console: bool,
        /// With --console: the loopback address of the console (port 0 picks one).
        #[arg(long, value_name = "ADDR", default_value = crate::console::DEFAULT_ADDR, requires = "console")]
        addr: String,
    },
    /// Run a bundled fixture MCP server over stdio (used by the demo and tests).
    #[command(hide = true)]
    Fixture {
        #[command(subcommand)]
        which: Fixture,
    },
}

/// `airlock serve`'s arguments (the command's help is on `Command::Serve`).
#[derive(clap::Args)]
struct ServeArgs {
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
    /// Bind the session to this profile (default: the configuration's default_profile,
    /// or its only profile). The requester is `[requester]` (default: the OS user), and
    /// policy must let it use the profile.
    #[arg(long, value_name = "NAME")]
    profile: Option<String>,
    /// Serve MCP over Streamable HTTP on ADDR instead of stdio (default ADDR
    /// 127.0.0.1:8787; port 0 picks a free one), endpoint /mcp, both protocol
    /// generations; prints the URL to stderr. Without [http.auth] only a loopback
    /// address is accepted and every request acts as [requester]; with it, each
    /// request needs a bearer JWT whose `sub` is the requester. --profile is then the
    /// profile of a token that names none. See README.md ("Serving over HTTP").
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = crate::front::http::DEFAULT_ADDR)]
    http: Option<String>,
    /// Record every adapter call into DIR as a fixture file (created if missing): the
    /// contract call, each upstream request and the server's raw answer, the mapping
    /// revision, connection and snapshot. Secret values of the configuration (every
    /// [secrets] value, header value and connection env value) are replaced by
    /// "[redacted]". Replay with `airlock test MANIFEST --fixtures DIR`. Stdio only.
    #[arg(long, value_name = "DIR", conflicts_with = "http")]
    record: Option<PathBuf>,
    /// With --record: also replace the value of every JSON member named FIELD
    /// (case-insensitive, at any depth; repeatable) by "[redacted]".
    #[arg(long, value_name = "FIELD", requires = "record")]
    redact: Vec<String>,
    /// Runtime worker threads that run the front, the pipeline and the guests.
    /// Default: 1 (a call then stays on one thread, which measured faster than one
    /// worker per core, see BENCHMARKS.md §1), except one per core with --http on a
    /// shared PostgreSQL store (`store` in the configuration), whose commits leave
    /// their worker (BENCHMARKS.md §10). A spinning guest still yields to its
    /// neighbours at every epoch tick.
    #[arg(long, value_name = "N", env = "AIRLOCK_WORKERS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    workers: Option<u16>,
    /// Also serve Prometheus metrics (GET /metrics, text format, no authentication) on
    /// ADDR, e.g. 127.0.0.1:9464 (port 0 picks a free one; the URL goes to stderr).
    /// Overrides [telemetry] metrics. With --http they are served at /metrics of the
    /// front too, behind the same bearer tokens. See README.md ("Observability").
    #[arg(long, value_name = "ADDR", value_parser = crate::config::parse_metrics_addr)]
    metrics: Option<std::net::SocketAddr>,
    /// Export OpenTelemetry spans (OTLP over HTTP, protobuf) to this collector, e.g.
    /// http://127.0.0.1:4318 (/v1/traces is added to a URL without a path). Overrides
    /// [telemetry] otlp. Spans follow the client's trace context (params._meta
    /// traceparent, or the HTTP traceparent header) and carry it on to the upstream
    /// servers. See README.md ("Observability").
    #[arg(long, value_name = "URL", value_parser = OtlpUrl)]
    otlp: Option<String>,
}

/// `--otlp URL`, checked as `[telemetry] otlp` is. Its own parser (not a function one):
/// clap would quote the refused value back, and a URL with `user:password@` is refused
/// precisely so that its password is printed nowhere.
#[derive(Clone)]
struct OtlpUrl;

impl clap::builder::TypedValueParser for OtlpUrl {
    type Value = String;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> std::result::Result<String, clap::Error> {
        let refused = |why: String| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("--otlp: {why}\n"),
            )
            .with_cmd(cmd)
        };
        let text = value
            .to_str()
            .ok_or_else(|| refused("the URL is not UTF-8".into()))?;
        crate::telemetry::traces_url(text).map_err(|e| refused(format!("{e:#}")))
    }
}

/// The `[telemetry]` settings given on the command line (`--metrics`, `--otlp`), which
/// override the configuration's.
#[derive(Default)]
struct TelemetryArgs {
    metrics: Option<std::net::SocketAddr>,
    otlp: Option<String>,
}

impl TelemetryArgs {
    fn apply(self, config: &mut crate::config::ServeConfig) {
        if self.metrics.is_some() {
            config.telemetry.metrics = self.metrics;
        }
        if self.otlp.is_some() {
            config.telemetry.otlp = self.otlp;
        }
    }
}

#[derive(Subcommand)]
enum SnapshotsAction {
    /// Snapshots, newest first.
    List {
        /// Only this connection's (configured name).
        #[arg(long, value_name = "NAME")]
        connection: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// One snapshot: server, lists, and each item's schema and description digests; or,
    /// with --tool, one upstream tool's input and output schema.
    #[command(after_help = "\
Example (an adapter author reading the shapes of the tools to call):
  airlock snapshots list --connection notes
  airlock snapshots show 3f2a9c1e --tool search_notes
With --tool, each schema is printed as an outline (JSON pointer, type, required or
optional, bounds, description) and as its raw JSON; --json prints the tool's raw
definition. Descriptions are the server's words: untrusted text, shown quoted.")]
    Show {
        /// Full digest or a unique prefix (8+ hex characters).
        #[arg(value_name = "DIGEST")]
        digest: String,
        /// Show only this upstream tool (its name as the server reports it).
        #[arg(long, value_name = "NAME")]
        tool: Option<String>,
        /// Print the stored snapshot as JSON (the raw catalogue), or with --tool the
        /// tool's raw definition.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum ContractsAction {
    /// Every contract package: the built-in ones and those the configuration names, each
    /// served or withheld (and why), with its review.
    List {
        /// Serve configuration (TOML) whose [[contract]] packages to list.
        #[arg(long, short, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// One package (by package or interface name): each function's semantics and the
    /// schema the model would be asked to fill, and each handle kind.
    Show {
        #[arg(value_name = "NAME")]
        name: String,
        /// Serve configuration (TOML) whose [[contract]] packages to search too.
        #[arg(long, short, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// What changed between two packages: functions, their semantics, the arguments the
    /// model is asked for, results and handle kinds; breaking changes marked `!`.
    Diff {
        /// The old package: a name, a folder, or `approved:NAME` (the files its review
        /// pinned).
        #[arg(value_name = "OLD")]
        old: String,
        /// The new package, in the same forms.
        #[arg(value_name = "NEW")]
        new: String,
        /// Serve configuration (TOML) whose packages and store to use.
        #[arg(long, short, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Approve a configured package: pin its digest and files, recording the reviewer
    /// and time in the store and the trace. Mappings may bind it from their next load.
    Approve {
        #[arg(value_name = "PACKAGE")]
        package: String,
        /// Serve configuration (TOML) that names the package.
        #[arg(long, short, value_name = "FILE")]
        config: PathBuf,
        /// Who approves.
        #[arg(long, value_name = "NAME")]
        reviewer: String,
        /// Why (recorded with the approval).
        #[arg(long, value_name = "TEXT", default_value = "")]
        reason: String,
        /// The digest you read (`airlock contracts show`): refused if the package on disk
        /// has another one now.
        #[arg(long, value_name = "SHA256")]
        digest: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Mark an approved package erroneous: its mappings serve no new calls from their next
    /// load; the review and its files stay. Final: a correction is a new version.
    MarkErroneous {
        #[arg(value_name = "PACKAGE")]
        package: String,
        /// Serve configuration (TOML) naming the store.
        #[arg(long, short, value_name = "FILE")]
        config: PathBuf,
        /// Who marks it.
        #[arg(long, value_name = "NAME")]
        reviewer: String,
        /// What is wrong with it.
        #[arg(long, value_name = "TEXT")]
        reason: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum ReviewAction {
    /// Every recorded mapping with its latest revision and state.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// One mapping: pins, drift against its connection's latest snapshot, the effect
    /// semantics its capabilities serve with, the host version its component targets,
    /// revisions.
    Show {
        #[arg(value_name = "MAPPING")]
        mapping: String,
        /// Serve configuration (TOML) that lists the mapping: its component is read for
        /// the `airlock:host` version it targets (without it, that version is unknown).
        #[arg(long, short, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Approve a mapping: pin its upstream tools' digests from a snapshot as a new
    /// revision in state `active`, recording the reviewer and time.
    Approve {
        #[arg(value_name = "MAPPING")]
        mapping: String,
        /// Serve configuration (TOML) that lists the mapping.
        #[arg(long, short, value_name = "FILE")]
        config: PathBuf,
        /// Who approves (recorded in the revision and the trace).
        #[arg(long, value_name = "NAME")]
        reviewer: String,
        /// The snapshot to pin (digest or prefix). Default: the connection's latest.
        #[arg(long, value_name = "DIGEST")]
        snapshot: Option<String>,
        /// Approve this manifest file (its component beside it) instead of the one the
        /// configuration lists: review a change before deploying it into a watched
        /// mappings folder, so it serves the moment it lands.
        #[arg(long, value_name = "FILE")]
        manifest: Option<PathBuf>,
        /// Approve the revision as `limited`: offered only to these profiles and
        /// requesters (`profile:NAME`, `requester:NAME`; repeat or separate with commas)
        /// until `airlock review promote` makes it `active`.
        #[arg(long, value_name = "WHO", value_delimiter = ',')]
        limited_to: Vec<String>,
        /// Approve although the server does not call a pinned tool read-only while the
        /// mapping offers it only as a read (or local transformation): you read the tool
        /// and it does not write. Recorded in the trace with each such tool.
        #[arg(long)]
        acknowledge_annotations: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Promote a limited mapping revision to `active`: offered to every session its
    /// profile includes.
    Promote {
        #[arg(value_name = "MAPPING")]
        mapping: String,
        /// Who promotes it.
        #[arg(long, value_name = "NAME")]
        reviewer: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Retire a mapping: it serves no new calls.
    Retire {
        #[arg(value_name = "MAPPING")]
        mapping: String,
        /// Who retires it.
        #[arg(long, value_name = "NAME")]
        reviewer: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum TraceAction {
    /// Recompute the MAC chain and say what it covers; exit status 3 when an event was
    /// altered, removed, reordered or recomputed without the key, or (with --checkpoint)
    /// newest events or the whole trace were deleted.
    Verify {
        /// Also check the trace against every checkpoint in FILE (JSON lines, as `airlock
        /// trace checkpoint` prints and `serve` appends).
        #[arg(long, value_name = "FILE")]
        checkpoint: Option<PathBuf>,
        /// Also check the segment files in DIR (the archive folder, or a copy of it with
        /// `trace export`'s file): each one's MACs and links from event 1, each against
        /// the `trace-archived` event that sealed it, and any checkpoint naming an archived
        /// event.
        #[arg(long, value_name = "DIR")]
        archive: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Seal the oldest events into segment files in the archive folder and delete them
    /// from the store, keeping what is still needed (what `serve` does every so often
    /// under [trace] retain); repeats until nothing more is old enough.
    Archive {
        /// Archive events older than this (e.g. "30d", "12h").
        #[arg(long, value_name = "DURATION", required_unless_present = "keep_events")]
        older_than: Option<String>,
        /// Archive all but the newest N events, whatever their age.
        #[arg(long, value_name = "N")]
        keep_events: Option<i64>,
        /// The archive folder [default: <state_dir>/trace-archive].
        #[arg(long, value_name = "DIR")]
        archive: Option<PathBuf>,
        /// Print JSON (one report per pass).
        #[arg(long)]
        json: bool,
    },
    /// Write the events not yet archived (all of them when nothing was) as one segment
    /// file in DIR; with the archive folder's segments copied beside it, `trace verify
    /// --archive DIR` checks the whole trace from event 1.
    Export {
        /// The folder to write into (created private; an existing file is not replaced).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print a checkpoint of the trace head now (one JSON line: seq, head MAC, key id,
    /// time, MAC), to keep outside the database.
    Checkpoint,
    /// Events, oldest first.
    List {
        /// Only events after this sequence number.
        #[arg(long, default_value_t = 0)]
        after: i64,
        /// At most this many events.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Print JSON lines.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum IntentsAction {
    /// Intents, newest first.
    List {
        /// Only those in this state: prepared, completed, failed, unknown.
        #[arg(long, value_name = "STATE")]
        state: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// One intent with its attempts and, if resolved, how.
    Show {
        /// The intent id (int_…).
        #[arg(value_name = "ID")]
        id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Resolve an unknown intent: say whether it happened, and why you know.
    Resolve {
        /// The intent id (int_…).
        #[arg(value_name = "ID")]
        id: String,
        /// `completed` (it happened) or `failed` (it did not).
        #[arg(long = "as", value_name = "STATE")]
        state: String,
        /// What you saw upstream that decides it (recorded, traced).
        #[arg(long, value_name = "TEXT")]
        evidence: String,
        /// Who decides (recorded). Default: the operating-system user.
        #[arg(long, value_name = "NAME")]
        by: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Undo a completed effect through the undo its contract declares (compensable-by).
    #[command(after_help = "\
Runs the undo's capability as the configuration's requester, through the same pipeline as
any call: policy decides it, and when policy asks a person, the summary (which intent it
undoes, the handle and what its result reported, such as the digest a file is restored to)
is printed and the command waits for `airlock approvals approve ID` from another terminal.
The undo is an intent of its own that records the one it compensates; an intent has at most
one compensation open or completed. Only what the original's result carried is undone, and
only when the trace proves it.

Example:
  airlock intents compensate int_0123456789abcdef0123456789abcdef --config airlock.toml")]
    Compensate {
        /// The completed intent to undo (int_…).
        #[arg(value_name = "ID")]
        id: String,
        /// The serve configuration whose mapping serves the undo.
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// The profile the undo is called under (default: as `airlock serve`).
        #[arg(long, value_name = "NAME")]
        profile: Option<String>,
        /// How long to wait for a person's approval, in seconds.
        #[arg(long, value_name = "SECONDS", default_value_t = 600)]
        wait: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum ApprovalsAction {
    /// Approval requests, newest first.
    List {
        /// Only those in this state: pending, approved, denied, revoked, consumed, expired.
        #[arg(long, value_name = "STATE")]
        state: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// One approval request: what it lets happen and what it is bound to.
    Show {
        /// The approval id (apr_…) or a unique prefix of at least 12 characters.
        #[arg(value_name = "ID")]
        id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Approve a pending request: it becomes a receipt the same call can use once.
    Approve {
        #[arg(value_name = "ID")]
        id: String,
        /// Who approves (recorded). Default: the operating-system user.
        #[arg(long, value_name = "NAME")]
        by: Option<String>,
        /// How long the receipt lives from now (e.g. 15m). Default: 15m.
        #[arg(long, value_name = "DURATION", default_value = "15m")]
        ttl: String,
        /// Approve without the confirmation on the terminal (the summary is still printed).
        #[arg(long)]
        yes: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Deny a pending request.
    Deny {
        #[arg(value_name = "ID")]
        id: String,
        /// Who denies (recorded). Default: the operating-system user.
        #[arg(long, value_name = "NAME")]
        by: Option<String>,
        /// Why (recorded).
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a pending request or an unused receipt.
    Revoke {
        #[arg(value_name = "ID")]
        id: String,
        /// Who revokes (recorded). Default: the operating-system user.
        #[arg(long, value_name = "NAME")]
        by: Option<String>,
        /// Why (recorded).
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum PolicyAction {
    /// Explain the decision a serving host would make for one call.
    Check {
        /// Serve configuration (TOML) naming the policy files and mappings.
        #[arg(long, short, value_name = "FILE")]
        config: PathBuf,
        /// The requester (default: the configuration's [requester]).
        #[arg(long, value_name = "NAME")]
        requester: Option<String>,
        /// A role of the requester (repeatable; default: the configuration's roles when
        /// the requester is the configured one).
        #[arg(long, value_name = "ROLE")]
        role: Vec<String>,
        /// The profile (default: the configuration's default).
        #[arg(long, value_name = "NAME")]
        profile: Option<String>,
        /// The capability's local name.
        #[arg(long, value_name = "NAME")]
        capability: String,
        /// The call's arguments as JSON, with handles given as adapter locators.
        #[arg(long, value_name = "JSON")]
        args: Option<String>,
        /// The size of the artifact the call names, in bytes.
        #[arg(long, value_name = "BYTES")]
        artifact_bytes: Option<u64>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Load and validate the configuration's policy files; print their digest.
    Validate {
        /// Serve configuration (TOML).
        #[arg(long, short, value_name = "FILE")]
        config: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the Cedar schema policies are validated against.
    Schema,
    /// Print the built-in policy (used when the configuration names no policy files).
    ShowBuiltin,
}

#[derive(Subcommand)]
#[allow(
    clippy::enum_variant_names,
    reason = "each variant is named for its subcommand: notes-server, delivery-server, hostile-server, workspace-server"
)]
enum Fixture {
    /// The synthetic notes library (`search_notes`, `read_note`, `notes://` resources).
    NotesServer {
        /// Arguments for the fixture server (e.g. `--call-log FILE`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The outbox delivery server (`stage_file`, `list_outboxes`, `send_file`,
    /// `lookup_delivery`), delivering into `--outbox DIR`.
    DeliveryServer {
        /// Arguments for the fixture server (e.g. `--outbox DIR --call-log FILE`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// A hostile server with the notes server's tools: huge results, wrong media types,
    /// too many items, malformed JSON-RPC, instructions in errors (`--mode MODE`).
    HostileServer {
        /// Arguments for the fixture server (e.g. `--mode huge --call-log FILE`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Five tools of the reference filesystem server (`list_allowed_directories`,
    /// `read_text_file`, `write_file`, `edit_file`, `create_directory`) confined to
    /// `--root DIR`.
    WorkspaceServer {
        /// Arguments for the fixture server (e.g. `--root DIR --call-log FILE`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Runs a real stdio server and loses one answer: the first `tools/call` of `--tool`
    /// whose arguments contain `--arguments-contain` reaches the server, and when its answer
    /// comes back the server is killed and this exits 75 (once per `--once FILE`).
    LoseAnswer {
        /// `--tool NAME --arguments-contain TEXT --once FILE -- COMMAND ARGS...`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn init_logging(default: &str) {
    let filter = EnvFilter::try_from_env("AIRLOCK_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let format = std::env::var(LOG_FORMAT_ENV).unwrap_or_default();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false);
    match format.as_str() {
        // One JSON object per line: time, level, target, the event's fields (the message
        // among them) and the spans it happened in.
        "json" => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .init(),
        "" | "text" => builder.init(),
        other => {
            builder.init();
            tracing::warn!(
                "{LOG_FORMAT_ENV}={:?} is not a log format (text or json): logging text",
                airlock_core::text::safe(other, 64)
            );
        }
    }
}

/// The environment variable that chooses the log format: `text` (default) or `json`.
pub const LOG_FORMAT_ENV: &str = "AIRLOCK_LOG_FORMAT";

/// Runs the command line; returns the process exit status.
///
/// `grants` and `test` run without an async runtime and choose their own exit statuses;
/// every other command runs through `run`.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let state_dir = cli.state_dir;
    let store = match cli.store.as_deref().map(crate::config::StoreSetting::parse) {
        None | Some(Ok(crate::config::StoreSetting::Sqlite)) => None,
        Some(Ok(crate::config::StoreSetting::Postgres(target))) => Some(target),
        Some(Err(e)) => {
            eprintln!("airlock: --store: {e:#}");
            return ExitCode::from(2);
        }
    };
    let _ = STORE.set(store);
    match cli.command {
        Command::Grants {
            manifest,
            json,
            html,
            allow_flagged,
            diff,
            config,
        } => grants(
            &manifest,
            json,
            html,
            allow_flagged,
            diff,
            config,
            state_dir,
        ),
        Command::Test {
            manifest,
            fixtures,
            allow_stale,
            config,
            json,
        } => test(
            &replay::TestOptions {
                manifest: &manifest,
                fixtures: &fixtures,
                allow_stale,
                state_dir,
                config: config.as_deref(),
            },
            json,
        ),
        command => run(command, state_dir),
    }
}

/// Runs `command` on a tokio runtime with [`serve_workers`] workers, then stops the
/// runtime (upstream children and background readers must not keep the process alive).
/// Exit status: 0 done; 3 the trace does not verify ([`Tampered`]); 1 any other error,
/// printed to stderr as safe lines (error chains can quote a server's words).
fn run(command: Command, state_dir: Option<PathBuf>) -> ExitCode {
    // `serve --http` reads its configuration before the runtime starts: how many workers
    // it runs on depends on the store the configuration names.
    let http_config = match &command {
        Command::Serve(ServeArgs {
            config,
            http: Some(_),
            ..
        }) => Some(load_config(config, state_dir.clone())),
        _ => None,
    };
    let shared = matches!(
        &http_config,
        Some(Ok(config)) if matches!(config.store, crate::config::StoreSetting::Postgres(_))
    );
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if let Some(n) = serve_workers(&command, shared) {
        builder.worker_threads(n);
    }
    let runtime = match builder.build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("airlock: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(dispatch(command, state_dir, http_config));
    // Upstream children and background readers must not keep the process alive.
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<Tampered>() => ExitCode::from(3),
        Err(e) => {
            // Error chains can quote a server's words (its stderr, its JSON-RPC errors):
            // never let them drive the terminal.
            eprintln!(
                "airlock: error: {}",
                crate::cli::operate::safe_lines(&format!("{e:#}"))
            );
            ExitCode::FAILURE
        }
    }
}

/// One function per command. `http_config` is `serve --http`'s configuration, read before
/// the runtime started.
async fn dispatch(
    command: Command,
    state_dir: Option<PathBuf>,
    http_config: Option<Result<ServeConfig>>,
) -> Result<()> {
    match command {
        Command::Grants { .. } | Command::Test { .. } => {
            unreachable!("handled before the async runtime starts")
        }
        Command::Serve(args) => serve(args, state_dir, http_config).await,
        Command::Discover {
            connection,
            config,
            learn,
            json,
        } => discover(&connection, &config, learn, json, state_dir).await,
        Command::Snapshots { action } => snapshots(action, state_dir),
        Command::Review { action } => review(action, state_dir),
        Command::Contracts { action } => contracts(action, state_dir),
        Command::Trace { action } => trace(action, state_dir),
        Command::Approvals { action } => approvals(action, state_dir),
        Command::Console { addr, config } => {
            init_logging("warn");
            let (registry, checkpoints, config) = match config {
                Some(path) => {
                    let config = load_config(&path, state_dir.clone())?;
                    let registry = match crate::cli::operate::registry_of_config(&config)? {
                        Some(r) => r,
                        None => registry_for(config.state_dir.clone())?,
                    };
                    let checkpoints = crate::registry::anchor::checkpoint_path(&config);
                    (registry, checkpoints, Some(config))
                }
                None => {
                    let dir = state_dir.clone().or_else(crate::config::default_state_dir);
                    let checkpoints =
                        dir.map(|d| crate::config::TraceSettings::default().checkpoint_path(&d));
                    (registry_for(state_dir)?, checkpoints, None)
                }
            };
            crate::console::serve(registry, &addr, checkpoints, config).await
        }
        Command::Status {
            checkpoint,
            limit,
            json,
        } => status(checkpoint, limit, json, state_dir),
        Command::Intents {
            action:
                IntentsAction::Compensate {
                    id,
                    config,
                    profile,
                    wait,
                    json,
                },
        } => {
            init_logging("warn");
            let config = load_config(&config, state_dir)?;
            let host = Host::start(&config).await?;
            let done = intents::compensate(
                &host,
                &id,
                profile.as_deref(),
                std::time::Duration::from_secs(wait),
                &mut std::io::stderr(),
            )
            .await?;
            output::emit(json, &done, |d| {
                format!(
                    "compensated {id}: intent {} completed\n{}\n",
                    d["intent"]["id"].as_str().unwrap_or("?"),
                    serde_json::to_string_pretty(&d["result"]).unwrap_or_default()
                )
            })
        }
        Command::Intents { action } => intents(action, state_dir),
        Command::Policy { action } => policy(action, state_dir),
        Command::New {
            list: true, json, ..
        } => new_list(json),
        Command::New {
            contract,
            name,
            connection,
            dir,
            sdk,
            json,
            ..
        } => new(
            &author::NewOptions {
                contract: contract.as_deref().unwrap_or_default(),
                name: name.as_deref().unwrap_or_default(),
                connection: connection.as_deref(),
                dir: dir.as_deref(),
                sdk: sdk.as_deref(),
            },
            json,
        ),
        Command::Pack { manifest, json } => pack(&manifest, json),
        Command::Demo { console, addr } => demo(console, &addr).await,
        Command::Fixture { which } => fixture(which).await,
    }
}

/// `airlock serve`: over Streamable HTTP with `--http` (its configuration `http_config`,
/// read before the runtime started), else over stdio ([`serve_stdio`]).
async fn serve(
    args: ServeArgs,
    state_dir: Option<PathBuf>,
    http_config: Option<Result<ServeConfig>>,
) -> Result<()> {
    let ServeArgs {
        config,
        cache_dir,
        no_cache,
        profile,
        http,
        record,
        redact,
        workers: _,
        metrics,
        otlp,
    } = args;
    let telemetry = TelemetryArgs { metrics, otlp };
    init_logging("airlock=info");
    tracing::info!(
        workers = tokio::runtime::Handle::current().metrics().num_workers(),
        "runtime started (--workers)"
    );
    let cache_dir = match (no_cache, cache_dir) {
        (true, _) => None,
        (false, Some(dir)) => Some(dir),
        (false, None) => crate::config::default_cache_dir(),
    };
    if let Some(addr) = http {
        let mut config = http_config.unwrap_or_else(|| load_config(&config, state_dir))?;
        config.cache_dir = cache_dir;
        telemetry.apply(&mut config);
        return crate::front::http::serve(config, &addr, profile).await;
    }
    serve_stdio(
        config,
        cache_dir,
        state_dir,
        profile,
        record.map(|dir| (dir, redact)),
        telemetry,
    )
    .await
}

/// `airlock discover CONNECTION`: one discovery now, its drift.
async fn discover(
    connection: &str,
    config: &std::path::Path,
    learn: bool,
    json: bool,
    state_dir: Option<PathBuf>,
) -> Result<()> {
    init_logging("warn,rmcp=error");
    let config = load_config(config, state_dir)?;
    let report = crate::cli::operate::discover(&config, connection, learn).await?;
    output::emit(json, &report, operate::DiscoverReport::to_text)
}

/// `airlock snapshots list | show`.
fn snapshots(action: SnapshotsAction, state_dir: Option<PathBuf>) -> Result<()> {
    init_logging("warn");
    let registry = registry_for(state_dir)?;
    match action {
        SnapshotsAction::List { connection, json } => {
            let list = crate::cli::operate::snapshots_list(&registry, connection.as_deref())?;
            output::emit(json, &list, |list| {
                crate::cli::operate::snapshots_text(list)
            })
        }
        SnapshotsAction::Show {
            digest,
            tool: Some(tool),
            json,
        } => {
            let (raw, text) = crate::cli::operate::tool_show(&registry, &digest, &tool)?;
            output::emit(json, &raw, |_| text)
        }
        SnapshotsAction::Show {
            digest,
            tool: None,
            json,
        } => {
            let (snap, text) = crate::cli::operate::snapshot_show(&registry, &digest)?;
            output::emit(json, &snap, |_| text)
        }
    }
}

/// `airlock review list | show | approve | retire`.
fn contracts(action: ContractsAction, state_dir: Option<PathBuf>) -> Result<()> {
    init_logging("warn,rmcp=error");
    // The configuration and its store as a host of it would read them.
    let judged = |config: &Option<PathBuf>| -> Result<(
        crate::registry::contracts::ContractSet,
        Option<crate::registry::Registry>,
    )> {
        match config {
            None => Ok((crate::registry::contracts::ContractSet::built_in(), None)),
            Some(path) => {
                let config = load_config(path, state_dir.clone())?;
                let registry = crate::cli::operate::registry_of_config(&config)?;
                let set = crate::registry::contracts::ContractSet::judge(
                    &config,
                    registry.as_ref().map(|r| r.store()),
                )?;
                Ok((set, registry))
            }
        }
    };
    match action {
        ContractsAction::List { config, json } => {
            let (set, registry) = judged(&config)?;
            let list = contracts::list(&set, registry.as_ref().map(|r| r.store()))?;
            output::emit(json, &list, |l| contracts::list_text(l))
        }
        ContractsAction::Show { name, config, json } => {
            let (set, _) = judged(&config)?;
            let shown = contracts::show(&set, &name)?;
            output::emit(json, &shown, contracts::ShownPackage::to_text)
        }
        ContractsAction::Diff {
            old,
            new,
            config,
            json,
        } => {
            let (set, registry) = judged(&config)?;
            let d = contracts::diff(&set, registry.as_ref().map(|r| r.store()), &old, &new)?;
            output::emit(json, &d, contracts::PackageDiff::to_text)
        }
        ContractsAction::Approve {
            package,
            config,
            reviewer,
            reason,
            digest,
            json,
        } => {
            let config = load_config(&config, state_dir)?;
            let registry = crate::registry::live::open_registry(&config)?;
            let record = contracts::approve(
                &config,
                registry.store(),
                &package,
                &reviewer,
                &reason,
                digest.as_deref(),
            )?;
            output::emit(json, &record, |r| {
                format!(
                    "contract package `{}` is approved (digest {}) by {}; mappings may bind it from their next load\n",
                    r.package, r.digest, r.reviewer
                )
            })
        }
        ContractsAction::MarkErroneous {
            package,
            config,
            reviewer,
            reason,
            json,
        } => {
            let config = load_config(&config, state_dir)?;
            let registry = crate::registry::live::open_registry(&config)?;
            let record = registry
                .store()
                .mark_contract_erroneous(&package, &reviewer, &reason)?;
            output::emit(json, &record, |r| match r {
                Some(r) => format!(
                    "contract package `{}` (digest {}) is marked erroneous; its mappings serve no new calls from their next load\n",
                    r.package, r.digest
                ),
                None => format!("contract package `{package}` was marked erroneous already\n"),
            })
        }
    }
}

fn review(action: ReviewAction, state_dir: Option<PathBuf>) -> Result<()> {
    init_logging("warn,rmcp=error");
    match action {
        ReviewAction::List { json } => {
            let registry = registry_for(state_dir)?;
            let list = registry.store().mappings()?;
            output::emit(json, &list, |list| {
                crate::cli::operate::review_list_text(list)
            })
        }
        ReviewAction::Show {
            mapping,
            config,
            json,
        } => {
            let config = config
                .map(|c| load_config(&c, state_dir.clone()))
                .transpose()?;
            let registry = match &config {
                Some(c) => registry_for(c.state_dir.clone())?,
                None => registry_for(state_dir)?,
            };
            let show = crate::cli::operate::review_show(&registry, &mapping, config.as_ref())?;
            output::emit(json, &show, operate::ReviewShow::to_text)
        }
        ReviewAction::Approve {
            mapping,
            config,
            reviewer,
            snapshot,
            manifest,
            limited_to,
            acknowledge_annotations,
            json,
        } => {
            let config = load_config(&config, state_dir)?;
            let record = crate::cli::operate::approve(
                &config,
                &mapping,
                &reviewer,
                snapshot.as_deref(),
                manifest.as_deref(),
                &limited_to,
                acknowledge_annotations,
            )?;
            output::emit(json, &record, |record| {
                format!(
                    "mapping `{}` revision {} is {}: approved by {} against snapshot {}\n",
                    record.name,
                    record.revision,
                    record.state,
                    reviewer,
                    record.snapshot_digest.as_deref().unwrap_or("?")
                )
            })
        }
        ReviewAction::Promote {
            mapping,
            reviewer,
            json,
        } => {
            let registry = registry_for(state_dir)?;
            let record = registry.promote(&mapping, &reviewer)?;
            output::emit(json, &record, |record| {
                format!(
                    "mapping `{}` revision {} is {}: offered to every session its profile includes\n",
                    record.name, record.revision, record.state
                )
            })
        }
        ReviewAction::Retire {
            mapping,
            reviewer,
            json,
        } => {
            let registry = registry_for(state_dir)?;
            let record = registry.retire(&mapping, &reviewer)?;
            output::emit(json, &record, |record| {
                format!(
                    "mapping `{}` revision {} is {}\n",
                    record.name, record.revision, record.state
                )
            })
        }
    }
}

/// `airlock trace verify | checkpoint | list`; a trace that does not verify is
/// [`Tampered`] (exit status 3) once the verification is printed.
fn trace(action: TraceAction, state_dir: Option<PathBuf>) -> Result<()> {
    init_logging("warn");
    let registry = registry_for(state_dir.clone())?;
    match action {
        TraceAction::Checkpoint => {
            output::emit_text(&registry.store().trace_checkpoint()?.to_line())
        }
        TraceAction::Verify {
            checkpoint,
            archive,
            json,
        } => {
            let checkpoints = match &checkpoint {
                None => Vec::new(),
                Some(file) => crate::store::Checkpoint::parse_lines(
                    &std::fs::read_to_string(file)
                        .with_context(|| format!("reading checkpoints from {}", file.display()))?,
                )
                .with_context(|| format!("checkpoint file {}", file.display()))?,
            };
            let v = registry.store().verify_trace_against(&checkpoints)?;
            let Some(dir) = archive else {
                output::emit(json, &v, crate::cli::operate::verification_text)?;
                if v.first_bad.is_some() {
                    return Err(anyhow::Error::new(Tampered));
                }
                return Ok(());
            };
            // A mark that does not verify is already the store's finding.
            let mark = registry.store().archive_mark().unwrap_or(None);
            let segments = crate::store::archive::verify_segments(
                &dir,
                registry.store().trace_key(),
                mark.as_ref(),
                &checkpoints,
            )?;
            let shown = output::WithMember {
                value: &v,
                name: "archive",
                extra: &segments,
            };
            output::emit(json, &shown, |_| {
                crate::cli::operate::verification_text(&v)
                    + &crate::cli::operate::segments_text(&segments)
            })?;
            if v.first_bad.is_some() || segments.first_bad.is_some() {
                return Err(anyhow::Error::new(Tampered));
            }
            Ok(())
        }
        TraceAction::Archive {
            older_than,
            keep_events,
            archive,
            json,
        } => {
            let retain = older_than
                .as_deref()
                .map(|text| {
                    humantime::parse_duration(text).with_context(|| {
                        format!("--older-than `{text}`: expected a duration such as \"30d\"")
                    })
                })
                .transpose()?;
            if let Some(n) = keep_events
                && n < 0
            {
                anyhow::bail!("--keep-events {n} must be at least 0");
            }
            let dir = match archive {
                Some(dir) => dir,
                None => state_dir
                    .clone()
                    .or_else(crate::config::default_state_dir)
                    .context("no state folder to hold the archive: pass --archive DIR")?
                    .join(crate::config::ARCHIVE_DIR),
            };
            let settings = crate::config::TraceSettings {
                retain,
                retain_events: keep_events,
                ..crate::config::TraceSettings::default()
            };
            let mut reports = Vec::new();
            loop {
                let request = crate::registry::retention::request(
                    &settings,
                    dir.clone(),
                    crate::store::now_ms(),
                );
                let report = registry.store().archive_trace(&request)?;
                // Another pass only after a full segment: each pass appends its own mark,
                // which a count bound would otherwise seal next, forever.
                let again = report
                    .sealed
                    .as_ref()
                    .is_some_and(|a| a.mark.to_seq - a.mark.from_seq + 1 >= request.max_events);
                if !json {
                    match crate::registry::retention::report_line(&report) {
                        Some(line) => eprintln!("{line}"),
                        None if reports.is_empty() => {
                            eprintln!("nothing to archive: no event is old enough")
                        }
                        None => {}
                    }
                }
                reports.push(report);
                if !again {
                    break;
                }
            }
            if json {
                output::emit_lines(true, &reports, |_| String::new())?;
            }
            Ok(())
        }
        TraceAction::Export { out, json } => {
            let exported = registry.store().export_trace(&out)?;
            output::emit(json, &exported, |e| {
                format!(
                    "events {}..={} written to {} ({} bytes, sha256 {})\n",
                    e.from_seq,
                    e.to_seq,
                    e.path.display(),
                    e.bytes,
                    e.sha256
                )
            })
        }
        TraceAction::List { after, limit, json } => {
            let events = registry.store().trace(after, limit)?;
            output::emit_lines(json, &events, crate::cli::operate::trace_text)
        }
    }
}

/// "No approval `ID`", pointing at the command that lists them.
fn no_approval(id: &str) -> String {
    format!("no approval `{id}` (`airlock approvals list` shows them)")
}

/// `airlock status`.
fn status(
    checkpoint: Option<PathBuf>,
    limit: usize,
    json: bool,
    state_dir: Option<PathBuf>,
) -> Result<()> {
    init_logging("warn");
    let dir = state_dir.clone().or_else(crate::config::default_state_dir);
    let registry = registry_for(state_dir)?;
    let checkpoints = checkpoint
        .or_else(|| dir.map(|d| crate::config::TraceSettings::default().checkpoint_path(&d)));
    let read = status::read(&registry, checkpoints.as_deref(), limit)?;
    output::emit(json, &read, status::text)
}

/// `airlock approvals list | show | approve | deny | revoke`. Every record is shown with
/// whether the trace proves it ([`approvals::tampered`]).
fn approvals(action: ApprovalsAction, state_dir: Option<PathBuf>) -> Result<()> {
    init_logging("warn");
    let registry = registry_for(state_dir)?;
    let now = crate::store::now_ms();
    let me = || crate::config::os_user_name();
    let show = |r: &crate::store::ApprovalRecord, json: bool| -> Result<()> {
        let now = crate::store::now_ms();
        let tampered = approvals::tampered(&registry, r, now)?;
        let shown = output::WithMember {
            value: r,
            name: "tampered",
            extra: &tampered,
        };
        output::emit(json, &shown, |_| {
            approvals::show_text(r, now, tampered.as_deref())
        })
    };
    let (id, decision, by, reason, json) = match action {
        ApprovalsAction::List { state, limit, json } => {
            let wanted = state.as_deref().map(approvals::parse_state).transpose()?;
            let list: Vec<_> = registry
                .store()
                .approvals(None, usize::MAX)?
                .into_iter()
                .filter(|r| wanted.is_none_or(|w| r.state_at(now) == w))
                .take(limit)
                .collect();
            return output::emit(json, &list, |list| approvals::list_text(list, now));
        }
        ApprovalsAction::Show { id, json } => {
            let r = registry
                .store()
                .approval(&id)?
                .with_context(|| no_approval(&id))?;
            return show(&r, json);
        }
        ApprovalsAction::Approve {
            id,
            by,
            ttl,
            yes,
            json,
        } => {
            let ttl = humantime::parse_duration(&ttl)
                .with_context(|| format!("--ttl `{ttl}`: expected a duration such as 15m"))?;
            let pending = registry
                .store()
                .approval(&id)?
                .with_context(|| no_approval(&id))?;
            approvals::refuse_tampered(&registry, &pending)?;
            if !yes {
                approvals::confirm_on_terminal(&pending)?;
            }
            let by = by.unwrap_or_else(me);
            let decision = crate::store::ApprovalDecision::Approve;
            let r = approvals::decide(&registry, &id, decision, &by, None, ttl)?;
            return show(&r, json);
        }
        ApprovalsAction::Deny {
            id,
            by,
            reason,
            json,
        } => (id, crate::store::ApprovalDecision::Deny, by, reason, json),
        ApprovalsAction::Revoke {
            id,
            by,
            reason,
            json,
        } => (id, crate::store::ApprovalDecision::Revoke, by, reason, json),
    };
    let by = by.unwrap_or_else(me);
    let r = approvals::decide(
        &registry,
        &id,
        decision,
        &by,
        reason.as_deref(),
        std::time::Duration::ZERO,
    )?;
    show(&r, json)
}

/// `airlock intents list | show | resolve`. Every record is shown with whether the trace
/// proves it ([`intents::tampered`]).
fn intents(action: IntentsAction, state_dir: Option<PathBuf>) -> Result<()> {
    init_logging("warn");
    let registry = registry_for(state_dir)?;
    let show = |r: &crate::store::IntentRecord, json: bool| -> Result<()> {
        let attempts = registry.store().attempts(&r.intent.id)?;
        let tampered = intents::tampered(&registry, r)?;
        let shown = serde_json::json!({
            "intent": r,
            "attempts": attempts,
            "tampered": tampered,
        });
        output::emit(json, &shown, |_| {
            let text = intents::show_text(r, &attempts);
            match &tampered {
                Some(why) => format!(
                    "TAMPERED: the trace does not prove this intent, so it is neither reconciled nor resolvable: {why}\n{text}"
                ),
                None => text,
            }
        })
    };
    match action {
        IntentsAction::List { state, limit, json } => {
            let wanted = state.as_deref().map(intents::parse_state).transpose()?;
            let list = intents::list(&registry, wanted, limit)?;
            let proven = list
                .iter()
                .map(|r| intents::tampered(&registry, r))
                .collect::<Result<Vec<_>>>()?;
            let rows: Vec<_> = list
                .iter()
                .zip(&proven)
                .map(|(r, tampered)| output::WithMember {
                    value: r,
                    name: "tampered",
                    extra: tampered,
                })
                .collect();
            output::emit(json, &rows, |_| intents::list_text(&list, &proven))
        }
        IntentsAction::Show { id, json } => {
            let r = registry
                .store()
                .intent(&id)?
                .with_context(|| format!("no intent `{id}` (`airlock intents list` shows them)"))?;
            show(&r, json)
        }
        IntentsAction::Resolve {
            id,
            state,
            evidence,
            by,
            json,
        } => {
            let state = intents::parse_state(&state)?;
            let by = by.unwrap_or_else(crate::config::os_user_name);
            let r = intents::resolve(&registry, &id, state, &by, &evidence)?;
            show(&r, json)
        }
        IntentsAction::Compensate { .. } => {
            anyhow::bail!("`intents compensate` runs a host: it is dispatched with one")
        }
    }
}

/// `airlock policy check | validate | schema | show-builtin`.
fn policy(action: PolicyAction, state_dir: Option<PathBuf>) -> Result<()> {
    init_logging("warn");
    match action {
        PolicyAction::Schema => output::emit_text(crate::policy::SCHEMA_TEXT),
        PolicyAction::ShowBuiltin => output::emit_text(crate::policy::DEFAULT_POLICY),
        PolicyAction::Validate { config, json } => {
            let config = load_config(&config, state_dir)?;
            let policy = crate::policy::Policy::load(&config.policy_files)?;
            let shown = serde_json::json!({
                "digest": &**policy.digest(),
                "files": policy.files(),
            });
            output::emit(json, &shown, |_| {
                let mut out = format!("policy valid: digest {}\n", policy.digest());
                for f in policy.files() {
                    out.push_str(&format!("  {} ({} policies)\n", f.label, f.policies));
                }
                out
            })
        }
        PolicyAction::Check {
            config,
            requester,
            role,
            profile,
            capability,
            args,
            artifact_bytes,
            json,
        } => {
            let config = load_config(&config, state_dir.clone())?;
            let name = requester.unwrap_or_else(|| config.requester.name.clone());
            let roles = if role.is_empty() && name == config.requester.name {
                config.requester.roles.clone()
            } else {
                role
            };
            let registry = crate::cli::operate::registry_of_config(&config)?;
            let check = policy::check(&policy::CheckRequest {
                config: &config,
                requester: &name,
                roles: &roles,
                profile: profile.as_deref(),
                capability: &capability,
                args: args.as_deref(),
                artifact_bytes,
                registry: registry.as_ref(),
            })?;
            output::emit(json, &check, policy::Check::to_text)
        }
    }
}

/// `airlock new --list`: the contracts this host supports.
fn new_list(json: bool) -> Result<()> {
    let list = author::list();
    output::emit(json, &list, |list| author::list_text(list))
}

/// `airlock new CONTRACT NAME`: a ready adapter crate.
fn new(options: &author::NewOptions<'_>, json: bool) -> Result<()> {
    let report = author::new_crate(options)?;
    output::emit(json, &report, |report| report.to_text())
}

/// `airlock pack MANIFEST`: build, place and pin the component.
fn pack(manifest: &std::path::Path, json: bool) -> Result<()> {
    let report = author::pack(manifest)?;
    output::emit(json, &report, |report| report.to_text())
}

/// `airlock demo`: the embedded default, step by step on stdout.
async fn demo(console: bool, addr: &str) -> Result<()> {
    init_logging("error");
    if console {
        return crate::cli::demo::console(std::io::stdout(), addr).await;
    }
    crate::cli::demo::run(std::io::stdout()).await
}

/// `airlock fixture …`: one bundled fixture MCP server on stdio.
async fn fixture(which: Fixture) -> Result<()> {
    init_logging("info");
    match which {
        Fixture::NotesServer { args } => {
            let options = airlock_fixture_notes::parse_args(args.into_iter())
                .map_err(|e| anyhow::anyhow!(e))?;
            airlock_fixture_notes::serve_stdio(options).await
        }
        Fixture::DeliveryServer { args } => {
            let options = airlock_fixture_delivery::parse_args(args.into_iter())
                .map_err(|e| anyhow::anyhow!(e))?;
            airlock_fixture_delivery::serve_stdio(options).await
        }
        Fixture::WorkspaceServer { args } => {
            let options = airlock_fixture_hostile::workspace::parse_args(args.into_iter())
                .map_err(|e| anyhow::anyhow!(e))?;
            airlock_fixture_hostile::workspace::serve_stdio(options).await
        }
        Fixture::LoseAnswer { args } => {
            let options = airlock_fixture_hostile::lose_answer::parse_args(args.into_iter())
                .map_err(|e| anyhow::anyhow!(e))?;
            let status = tokio::task::spawn_blocking(move || {
                airlock_fixture_hostile::lose_answer::run(&options)
            })
            .await??;
            std::process::exit(status);
        }
        Fixture::HostileServer { args } => {
            let options = airlock_fixture_hostile::parse_args(args.into_iter())
                .map_err(|e| anyhow::anyhow!(e))?;
            // Blocking reads of stdin: on a thread of their own.
            tokio::task::spawn_blocking(move || airlock_fixture_hostile::serve_stdio(&options))
                .await??;
            Ok(())
        }
    }
}

/// How many runtime workers `command` runs on: `serve`'s `--workers`; else 1 for `serve`
/// on stdio, and for `serve --http` on the SQLite store (measured in BENCHMARKS.md §1 and
/// §10: a call that stays on one thread skips the cross-thread wake-ups two workers pay on
/// every hand-off; over HTTP on SQLite one worker was faster at one caller and as fast at
/// eight); else `None` — one per core (tokio's default, which also honours
/// `TOKIO_WORKER_THREADS`) for `serve --http` on a shared PostgreSQL store
/// (`shared_store`: each commit leaves its worker through `block_in_place`, and one worker
/// measured 11 % fewer calls/s at eight callers) and for every other command.
fn serve_workers(command: &Command, shared_store: bool) -> Option<usize> {
    match command {
        Command::Serve(ServeArgs { workers, http, .. }) => match (workers, http) {
            (Some(n), _) => Some(usize::from(*n)),
            (None, None) => Some(1),
            (None, Some(_)) => (!shared_store).then_some(1),
        },
        _ => None,
    }
}

/// `airlock grants`: prints the review; exit status 2 when an import is flagged (unless
/// `allow_flagged`), 1 on an error.
fn grants(
    manifest: &std::path::Path,
    json: bool,
    html: bool,
    allow_flagged: bool,
    diff: Option<i64>,
    config: Option<PathBuf>,
    state_dir: Option<PathBuf>,
) -> ExitCode {
    let review = (|| {
        // With a configuration, its operator contracts as its host would judge them.
        let contracts = match &config {
            Some(path) => {
                let config = load_config(path, state_dir.clone())?;
                let registry = crate::cli::operate::registry_of_config(&config)?;
                crate::registry::contracts::ContractSet::judge(
                    &config,
                    registry.as_ref().map(|r| r.store()),
                )?
            }
            None => crate::registry::contracts::ContractSet::built_in(),
        };
        crate::cli::review::review(manifest, &contracts)
    })()
    .and_then(|mut review| {
        if state_dir.is_some() || diff.is_some() {
            let registry = registry_for(state_dir.clone())?;
            crate::cli::review::add_registry(&mut review, manifest, &registry, diff)?;
        }
        if let Some(path) = &config {
            let config = load_config(path, state_dir)?;
            let registry = crate::cli::operate::registry_of_config(&config)?;
            crate::cli::review::add_config(&mut review, path, &config, registry.as_ref())?;
        }
        Ok(review)
    });
    let review = match review {
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
    if let Err(e) = output::emit_text(&out) {
        eprintln!("airlock: error: writing the review: {e}");
        return ExitCode::FAILURE;
    }
    if review.has_flagged() && !allow_flagged {
        eprintln!(
            "airlock: {} flagged import(s), {} reason(s) the host would refuse to load mapping `{}`{}; exiting with status 2 (--allow-flagged to exit 0)",
            review.flagged,
            review.refusals.len(),
            review.mapping.name,
            match (review.unconfined(), review.insecure_http()) {
                (true, _) => ", and its connection's server runs unconfined",
                (false, true) => {
                    ", and the host reaches its connection's server unencrypted (allow_insecure_http)"
                }
                (false, false) => "",
            }
        );
        return ExitCode::from(2);
    }
    ExitCode::SUCCESS
}

fn fields_of(recorder: &crate::record::Recorder) -> Vec<String> {
    recorder.redaction().fields()
}

/// `airlock test`: prints the report; exit status 0 passed, 1 failed or stale, 2 inputs
/// that cannot be used.
fn test(options: &replay::TestOptions<'_>, json: bool) -> ExitCode {
    init_logging("error");
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("airlock: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let outcome = runtime.block_on(replay::run(options));
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    let report = match outcome {
        Ok(report) => report,
        Err(replay::TestError::Usage(e)) => {
            eprintln!(
                "airlock: error: {}",
                crate::cli::operate::safe_lines(&format!("{e:#}"))
            );
            return ExitCode::from(2);
        }
    };
    // A report that does not serialize prints an empty line, as it always has.
    let text = output::render(json, &report, replay::TestReport::to_text)
        .unwrap_or_else(|_| "\n".to_string());
    if let Err(e) = output::emit_text(&text) {
        eprintln!("airlock: error: writing the report: {e}");
        return ExitCode::from(2);
    }
    if report.passed {
        ExitCode::SUCCESS
    } else {
        if report.stale.is_empty() || report.allow_stale {
            eprintln!(
                "airlock: {} of {} fixture(s) failed",
                report.fixtures.iter().filter(|f| !f.passed).count(),
                report.fixtures.len()
            );
        } else {
            eprintln!(
                "airlock: stale fixtures refused ({} reason(s)); record again, or --allow-stale replays them",
                report.stale.len()
            );
        }
        ExitCode::FAILURE
    }
}

/// `trace verify` found tampering (exit status 3).
#[derive(Debug)]
struct Tampered;

impl std::fmt::Display for Tampered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the trace does not verify")
    }
}

impl std::error::Error for Tampered {}

fn load_config(path: &std::path::Path, state_dir: Option<PathBuf>) -> Result<ServeConfig> {
    let mut config = ServeConfig::load(path)?;
    if state_dir.is_some() {
        config.state_dir = state_dir;
    }
    Ok(config)
}

/// `--store` (or AIRLOCK_STORE) when it names a PostgreSQL store: set once at start.
static STORE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();

/// The shared PostgreSQL store `--store` (or AIRLOCK_STORE) names, if any: every command
/// that opens a store by its state folder opens this one instead.
pub fn shared_store() -> Option<&'static str> {
    STORE.get().and_then(Option::as_deref)
}

/// The registry over the store operator commands use: the PostgreSQL store `--store`
/// names, else the SQLite database in `state_dir` (or the default state folder), which
/// must exist. Opened by [`operate::registry_at`], as every store named by a state folder.
///
/// # Errors
/// No state folder or no database in it; the store cannot be opened.
fn registry_for(state_dir: Option<PathBuf>) -> Result<crate::registry::Registry> {
    let dir = state_dir.or_else(crate::config::default_state_dir);
    if shared_store().is_none() {
        let dir = dir
            .as_deref()
            .context("no state folder: pass --state-dir or set AIRLOCK_STATE_DIR")?;
        // lstat: a link (even a dangling one) is not "no state"; opening refuses it by name.
        if std::fs::symlink_metadata(dir.join(crate::store::DATABASE_FILE)).is_err() {
            anyhow::bail!(
                "no Airlock state in {} (no {}); pass the --state-dir your host uses",
                dir.display(),
                crate::store::DATABASE_FILE
            );
        }
    }
    crate::cli::operate::registry_at(dir.as_deref())
}

/// `airlock serve` over stdio: the host, its background reload, one stdio session until
/// stdin closes or a signal stops it (then the calls in flight drain).
async fn serve_stdio(
    config_path: PathBuf,
    cache_dir: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    profile: Option<String>,
    record: Option<(PathBuf, Vec<String>)>,
    telemetry: TelemetryArgs,
) -> Result<()> {
    // From here on SIGTERM/SIGINT stop the host cleanly (crate::shutdown).
    crate::shutdown::catch_signals();
    let mut config = load_config(&config_path, state_dir)?;
    config.cache_dir = cache_dir;
    telemetry.apply(&mut config);
    // Fail before anything starts when the profile does not exist.
    let profile = config.profile(profile.as_deref())?.name.clone();
    // Open the fixture folder before anything starts: a bad --record fails fast.
    let recorder = record
        .map(|(dir, fields)| {
            let redaction = crate::record::Redaction::new(config.secret_values(), &fields);
            crate::record::Recorder::open(&dir, redaction)
        })
        .transpose()?;
    let metrics = crate::metrics::bind(&config).await?;
    let host = Host::start(&config).await?;
    crate::metrics::spawn(metrics, host.live());
    if let Some(recorder) = recorder {
        tracing::warn!(
            dir = %recorder.dir().display(),
            redacted_fields = ?fields_of(&recorder),
            "recording every adapter call as a fixture (secret values of the configuration redacted)"
        );
        host.record_to(std::sync::Arc::new(recorder))?;
    }
    crate::registry::reload::spawn_background(&host)?;
    let session = host.stdio_session(Some(&profile))?;
    let catalog = host.catalog();
    tracing::info!(
        mappings = catalog.mappings.len(),
        capabilities_serving = catalog.offered().count(),
        requester = %session.requester().name,
        profile = %session.profile().name,
        "serving MCP on stdio"
    );
    let front = crate::front::McpFront::new(host.clone(), session);
    // The front's own transport answers every request with an id; stdin's end is passed
    // on once the calls in flight drained (see crate::shutdown).
    // Non-blocking pipes on the runtime's IO driver (no blocking-pool hand-off per read or
    // write); anything that is not a pipe falls back to tokio's blocking handles.
    let (read, write) = crate::front::stdio::stdio_pipes();
    let input = crate::shutdown::drain_before_eof(read, host.live().clone());
    // `tools/call` goes from the transport to the front's handler without rmcp's loop once
    // rmcp has established the session (crate::front::stdio::FastCalls).
    let (transport, fast) =
        crate::front::stdio::StdioFront::new(input, write).with_fast_calls(front.clone());
    let spans = host.clone();
    let served = crate::shutdown::run(host.live(), async move {
        let running = match front.serve(transport).await {
            Ok(running) => running,
            // Input that ends before a session begins (`serve </dev/null`, a client that
            // connected and left): the host started, loaded and recorded its mappings,
            // and has nothing to serve. Not an error (README: recording a candidate).
            Err(rmcp::service::ServerInitializeError::ConnectionClosed(_)) => {
                tracing::info!(
                    "the client's input ended before a session began: nothing to serve; stopping"
                );
                return Ok(());
            }
            Err(e) => {
                return Err(
                    anyhow::Error::new(e).context("MCP initialize with the client on stdio")
                );
            }
        };
        fast.ready(running.peer().clone());
        running.waiting().await.context("MCP session")?;
        Ok(())
    })
    .await;
    // The last spans are exported before the process ends.
    spans.flush_spans().await;
    served
}

#[cfg(test)]
mod runtime_tests {
    use super::*;

    fn workers(args: &[&str], shared_store: bool) -> Option<usize> {
        let cli = Cli::try_parse_from(args).unwrap();
        serve_workers(&cli.command, shared_store)
    }

    #[test]
    fn serve_runs_one_worker_but_on_a_shared_store_over_http_one_per_core_unless_told() {
        let stdio = ["airlock", "serve", "--config", "a.toml"];
        let http = ["airlock", "serve", "--config", "a.toml", "--http"];
        for shared in [false, true] {
            assert_eq!(workers(&stdio, shared), Some(1));
            assert_eq!(workers(&http, shared), (!shared).then_some(1));
            // --workers wins on either front and store.
            for front in [&stdio[..], &http[..]] {
                let told = [front, &["--workers", "3"]].concat();
                assert_eq!(workers(&told, shared), Some(3));
            }
        }
        assert_eq!(workers(&["airlock", "review", "list"], false), None);
        assert!(
            Cli::try_parse_from(["airlock", "serve", "--config", "a", "--workers", "0"]).is_err()
        );
    }
}
