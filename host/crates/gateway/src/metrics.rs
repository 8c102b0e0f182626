//! Prometheus metrics: what the host knows, in the text exposition format (0.0.4), for
//! `/metrics` on the HTTP front and on `airlock serve --metrics ADDR`.
//!
//! Rule: **every label value is bounded by construction, and none names a person or holds
//! a value a model or a server chose.** Label values come only from:
//! - the operator's configuration: connection and mapping names;
//! - the offered catalogues: a capability name is a label only once normalization found
//!   it offered to the call's session (a call to any other name — unknown, or hidden from
//!   the session's profile — counts under [`UNOFFERED`]);
//! - the host's own closed sets: outcomes, refusal categories, stage names, containment
//!   kinds, connection and mapping states, approval modes.
//!
//! No requester, session, argument, reference or upstream text is a label. Counters move
//! as things happen in this process; gauges (connections, mappings, what waits, the
//! journal) are read when scraped, so a scrape of a host whose approvals another process
//! decided sees the store as it is.
//!
//! Names (all prefixed `airlock_`), with their labels:
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `calls_total` | counter | `capability`, `outcome`, `category` |
//! | `call_duration_seconds` | histogram | `capability` |
//! | `call_stage_duration_seconds` | histogram | `stage` |
//! | `adapter_contained_total` | counter | `mapping`, `kind` |
//! | `adapter_instantiation_seconds` | histogram | `from` (`spare`, `new`) |
//! | `approvals_requested_total` | counter | `mode` |
//! | `connection_transitions_total` | counter | `connection`, `to` |
//! | `connection_restarts_total` | counter | `connection` |
//! | `drift_found_total` | counter | `mapping` |
//! | `connection_state` | gauge (1 for the current state) | `connection`, `state` |
//! | `mapping_state` | gauge (1 for the current state) | `mapping`, `state` |
//! | `approvals_pending` | gauge | |
//! | `approvals_pending_oldest_age_seconds` | gauge | |
//! | `intents_open` | gauge | `state` (`prepared`, `unknown`) |
//! | `trace_journal_backlog_bytes` | gauge | |
//! | `mcp_sessions` | gauge (legacy HTTP sessions open) | |
//! | `build_info` | gauge (1) | `version` |

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use prometheus::{
    Encoder as _, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry as PromRegistry, TextEncoder,
};

use crate::store::MappingState;

/// The `capability` label of a call whose tool no catalogue offers.
pub const UNOFFERED: &str = "(unoffered)";

/// The path metrics are served at.
pub const PATH: &str = "/metrics";

/// The `Content-Type` of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Upper bounds of the duration histograms, in seconds: 50 µs to 30 s.
const SECONDS: [f64; 18] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Every connection state's name (the `state` label of `connection_state`).
const CONNECTION_STATES: [&str; 6] = [
    "connecting",
    "ready",
    "disconnected",
    "degraded",
    "stalled",
    "stopped",
];

/// One host's metrics (module rule). Cheap to update from any thread: counters and
/// histograms are atomics behind a label lookup.
pub struct Metrics {
    registry: PromRegistry,
    calls: IntCounterVec,
    call_seconds: HistogramVec,
    stage_seconds: HistogramVec,
    /// `stage_seconds`' children by stage name (the names are `'static`, the lookup is
    /// cheaper than the vector's label hash).
    stages: Mutex<HashMap<&'static str, Histogram>>,
    contained: IntCounterVec,
    instantiation: HistogramVec,
    approvals_requested: IntCounterVec,
    transitions: IntCounterVec,
    restarts: IntCounterVec,
    drift: IntCounterVec,
    connection_state: IntGaugeVec,
    mapping_state: IntGaugeVec,
    approvals_pending: IntGauge,
    approvals_oldest: prometheus::Gauge,
    intents_open: IntGaugeVec,
    journal_backlog: IntGauge,
    sessions: IntGauge,
    /// Held while a scrape sets the gauges and encodes: two scrapes at once do not mix
    /// one's reset with the other's values.
    rendering: Mutex<()>,
}

/// What a scrape reads from the host and its store at that moment.
#[derive(Debug, Default)]
pub struct Scraped {
    /// Each connection's name and state.
    pub connections: Vec<(String, &'static str)>,
    /// Each loaded mapping's name and state.
    pub mappings: Vec<(String, MappingState)>,
    /// What waits, when the store could be read.
    pub waiting: Option<crate::store::Waiting>,
    /// Now, ms since the epoch (the age of the oldest pending approval).
    pub now_ms: u64,
    /// [`crate::store::Trace::journal_backlog_bytes`], when the store could be read.
    pub journal_backlog_bytes: Option<u64>,
}

fn counter(r: &PromRegistry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("a valid metric");
    r.register(Box::new(c.clone())).expect("registered once");
    c
}

fn histogram(r: &PromRegistry, name: &str, help: &str, labels: &[&str]) -> HistogramVec {
    let h = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(SECONDS.to_vec()),
        labels,
    )
    .expect("a valid metric");
    r.register(Box::new(h.clone())).expect("registered once");
    h
}

fn gauges(r: &PromRegistry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("a valid metric");
    r.register(Box::new(g.clone())).expect("registered once");
    g
}

fn gauge(r: &PromRegistry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("a valid metric");
    r.register(Box::new(g.clone())).expect("registered once");
    g
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every metric of the module's table, at zero.
    pub fn new() -> Self {
        let r = PromRegistry::new_custom(Some("airlock".into()), None).expect("a valid prefix");
        let info = gauges(
            &r,
            "build_info",
            "The running Airlock's version (always 1).",
            &["version"],
        );
        info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        let approvals_oldest = prometheus::Gauge::new(
            "approvals_pending_oldest_age_seconds",
            "Age of the oldest pending (unexpired) approval request; 0 when there is none.",
        )
        .expect("a valid metric");
        r.register(Box::new(approvals_oldest.clone()))
            .expect("registered once");
        Self {
            calls: counter(
                &r,
                "calls_total",
                "tools/call requests that reached the pipeline, by capability, outcome and refusal category (empty unless refused).",
                &["capability", "outcome", "category"],
            ),
            call_seconds: histogram(
                &r,
                "call_duration_seconds",
                "Time from a tools/call reaching the pipeline to its outcome being durable.",
                &["capability"],
            ),
            stage_seconds: histogram(
                &r,
                "call_stage_duration_seconds",
                "Time each pipeline stage took (a `stage.part` name is part of its stage).",
                &["stage"],
            ),
            stages: Mutex::default(),
            contained: counter(
                &r,
                "adapter_contained_total",
                "Adapter runs stopped by the host, by mapping and kind (deadline, memory, fuel, trap, ...).",
                &["mapping", "kind"],
            ),
            instantiation: histogram(
                &r,
                "adapter_instantiation_seconds",
                "Time to get an adapter instance for a call: a spare made in advance, or a new one.",
                &["from"],
            ),
            approvals_requested: counter(
                &r,
                "approvals_requested_total",
                "Approval requests made, by how the person is asked.",
                &["mode"],
            ),
            transitions: counter(
                &r,
                "connection_transitions_total",
                "Upstream connection state changes, by connection and the state entered.",
                &["connection", "to"],
            ),
            restarts: counter(
                &r,
                "connection_restarts_total",
                "Upstream connections started again after their server went away.",
                &["connection"],
            ),
            drift: counter(
                &r,
                "drift_found_total",
                "Meaning-bearing drift found on a mapping's pinned tools.",
                &["mapping"],
            ),
            connection_state: gauges(
                &r,
                "connection_state",
                "1 for each upstream connection's current state, 0 for the others.",
                &["connection", "state"],
            ),
            mapping_state: gauges(
                &r,
                "mapping_state",
                "1 for each loaded mapping's current lifecycle state, 0 for the others.",
                &["mapping", "state"],
            ),
            approvals_pending: gauge(
                &r,
                "approvals_pending",
                "Approval requests pending and not expired (read from the store when scraped).",
            ),
            approvals_oldest,
            intents_open: gauges(
                &r,
                "intents_open",
                "Intents still open: prepared (running, or left by a stopped host) or unknown (held).",
                &["state"],
            ),
            journal_backlog: gauge(
                &r,
                "trace_journal_backlog_bytes",
                "Bytes of calls durable in the trace journals and not yet moved into the trace.",
            ),
            sessions: gauge(
                &r,
                "mcp_sessions",
                "Legacy (2025-11-25) MCP sessions open on the HTTP front.",
            ),
            rendering: Mutex::default(),
            registry: r,
        }
    }

    /// Counts one call that ended: `capability` is `None` unless the session was offered
    /// the name; `outcome` is the trace's outcome name (`completed`, `refused`, `unknown`,
    /// `invalid`, `approval-required`, `input-required`) and `category` the refusal's
    /// (empty otherwise); `took` the whole call (`None`: it never started, nothing to
    /// time), `stages` the pipeline's per-stage microseconds.
    pub fn call_ended(
        &self,
        capability: Option<&str>,
        outcome: &str,
        category: &str,
        took: Option<Duration>,
        stages: &[(&'static str, u64)],
    ) {
        let capability = capability.unwrap_or(UNOFFERED);
        self.calls
            .with_label_values(&[capability, outcome, category])
            .inc();
        if let Some(took) = took {
            self.call_seconds
                .with_label_values(&[capability])
                .observe(took.as_secs_f64());
        }
        let mut cache = self.stages.lock().unwrap_or_else(|e| e.into_inner());
        for (stage, micros) in stages {
            let h = cache
                .entry(stage)
                .or_insert_with(|| self.stage_seconds.with_label_values(&[stage]));
            h.observe(*micros as f64 / 1e6);
        }
    }

    /// Counts an adapter run the host stopped (`kind`: the containment's trace name).
    pub fn contained(&self, mapping: &str, kind: &str) {
        self.contained.with_label_values(&[mapping, kind]).inc();
    }

    /// Observes how long getting an instance took (`spare`: one made in advance).
    pub fn instantiated(&self, spare: bool, took: Duration) {
        self.instantiation
            .with_label_values(&[if spare { "spare" } else { "new" }])
            .observe(took.as_secs_f64());
    }

    /// Counts an approval request made in `mode` (`elicitation`, `input-required`,
    /// `out-of-band`).
    pub fn approval_requested(&self, mode: &str) {
        self.approvals_requested.with_label_values(&[mode]).inc();
    }

    /// Counts what a trace event of kind `kind` about `subject` says, for the kinds that
    /// carry a metric (connection transitions and restarts: the subject is the connection;
    /// drift: the mapping); others count nothing.
    pub fn traced(&self, kind: &str, subject: &str, payload: &serde_json::Value) {
        use crate::registry::events;
        match kind {
            events::CONNECTION_STATE => {
                let to = payload["to"].as_str().unwrap_or("");
                if let Some(to) = CONNECTION_STATES.iter().find(|s| **s == to) {
                    self.transitions.with_label_values(&[subject, to]).inc();
                }
            }
            events::CONNECTION_RESTARTED => self.restarts.with_label_values(&[subject]).inc(),
            events::DRIFT_FOUND => self.drift.with_label_values(&[subject]).inc(),
            _ => {}
        }
    }

    /// How many times this process restarted connection `name` (its
    /// `connection_restarts_total`); 0 for a connection it never restarted.
    pub fn restarts(&self, name: &str) -> u64 {
        self.restarts
            .get_metric_with_label_values(&[name])
            .map_or(0, |c| c.get())
    }

    /// Sets the legacy MCP sessions open now.
    pub fn set_sessions(&self, open: usize) {
        self.sessions.set(i64::try_from(open).unwrap_or(i64::MAX));
    }

    /// The text exposition of every metric, the gauges set from `scraped` first.
    pub fn render(&self, scraped: &Scraped) -> String {
        let _one = self.rendering.lock().unwrap_or_else(|e| e.into_inner());
        self.connection_state.reset();
        for (name, state) in &scraped.connections {
            for s in CONNECTION_STATES {
                self.connection_state
                    .with_label_values(&[name.as_str(), s])
                    .set(i64::from(s == *state));
            }
        }
        self.mapping_state.reset();
        for (name, state) in &scraped.mappings {
            for s in MappingState::ALL {
                self.mapping_state
                    .with_label_values(&[name.as_str(), s.as_str()])
                    .set(i64::from(s == *state));
            }
        }
        if let Some(w) = &scraped.waiting {
            let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            self.approvals_pending.set(n(w.approvals_pending));
            self.approvals_oldest.set(
                w.oldest_pending_ms
                    .map_or(0.0, |t| scraped.now_ms.saturating_sub(t) as f64 / 1000.0),
            );
            self.intents_open
                .with_label_values(&["prepared"])
                .set(n(w.intents_prepared));
            self.intents_open
                .with_label_values(&["unknown"])
                .set(n(w.intents_unknown));
        }
        if let Some(bytes) = scraped.journal_backlog_bytes {
            self.journal_backlog
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!("could not encode the metrics: {e}");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

/// Reads what a scrape reports from `live` and its store (the store off the async
/// workers), then renders every metric ([`Metrics::render`]). A store that cannot be read
/// leaves the gauges read from it as they were, with an error logged.
pub async fn scrape(live: &crate::registry::live::Live) -> String {
    let connections = live
        .connections()
        .await
        .iter()
        .map(|(name, c)| (name.clone(), c.status().as_str()))
        .collect();
    let mappings = live
        .catalog()
        .mappings
        .iter()
        .map(|(name, m)| (name.clone(), m.record().state))
        .collect();
    let store = live.registry().shared_store();
    let now_ms = crate::store::now_ms();
    let read = tokio::task::spawn_blocking(move || {
        Ok::<_, anyhow::Error>((store.journal_backlog_bytes()?, store.waiting(now_ms)?))
    })
    .await;
    let (journal_backlog_bytes, waiting) = match read {
        Ok(Ok((j, w))) => (Some(j), Some(w)),
        Ok(Err(e)) => {
            tracing::error!("metrics: could not read the store: {e:#}");
            (None, None)
        }
        Err(e) => {
            tracing::error!("metrics: the store read failed: {e}");
            (None, None)
        }
    };
    live.registry().metrics().render(&Scraped {
        connections,
        mappings,
        waiting,
        now_ms,
        journal_backlog_bytes,
    })
}

/// Binds the metrics listener `[telemetry] metrics` names, if any, before the host
/// starts (a taken port fails fast). Logs a warning for a non-loopback address: the
/// listener has no authentication.
///
/// # Errors
/// The address cannot be bound.
pub async fn bind(
    config: &crate::config::ServeConfig,
) -> anyhow::Result<Option<tokio::net::TcpListener>> {
    use anyhow::Context as _;
    let Some(addr) = config.telemetry.metrics else {
        return Ok(None);
    };
    if !addr.ip().is_loopback() {
        tracing::warn!(%addr, "serving metrics on a non-loopback address: anyone who reaches it reads them (there is no authentication)");
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics address {addr}"))?;
    Ok(Some(listener))
}

/// Serves [`bind`]'s listener on its own task (nothing when there is none), printing
/// `airlock: serving metrics at http://ADDR/metrics` to stderr.
pub fn spawn(
    listener: Option<tokio::net::TcpListener>,
    live: &std::sync::Arc<crate::registry::live::Live>,
) {
    let Some(listener) = listener else { return };
    if let Ok(local) = listener.local_addr() {
        tracing::info!(%local, "serving metrics");
        eprintln!("airlock: serving metrics at http://{local}{PATH}");
    }
    tokio::spawn(serve(listener, live.clone()));
}

/// Serves `GET /metrics` (and only that: anything else is 404, another method 405) on
/// `listener` until the process stops: `airlock serve --metrics ADDR`. Each connection on
/// its own task; a scrape reads as [`scrape`].
///
/// # Errors
/// Never returns but by the process stopping; accept errors are logged and retried.
pub async fn serve(
    listener: tokio::net::TcpListener,
    live: std::sync::Arc<crate::registry::live::Live>,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("metrics: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let live = live.clone();
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let live = live.clone();
                    async move {
                        Ok::<_, std::convert::Infallible>(
                            respond(&live, req.method(), req.uri().path()).await,
                        )
                    }
                });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_secs(30))
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                tracing::debug!(%peer, "metrics connection ended: {e}");
            }
        });
    }
}

/// The answer to `method path` on a metrics listener or the HTTP front's `/metrics`.
pub async fn respond(
    live: &crate::registry::live::Live,
    method: &http::Method,
    path: &str,
) -> http::Response<http_body_util::Full<bytes::Bytes>> {
    let plain = |status: http::StatusCode, text: &'static str| {
        http::Response::builder()
            .status(status)
            .header(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(
                text.as_bytes(),
            )))
            .expect("a valid response")
    };
    if path != PATH {
        return plain(http::StatusCode::NOT_FOUND, "Not Found");
    }
    if method != http::Method::GET && method != http::Method::HEAD {
        let mut r = plain(http::StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed");
        r.headers_mut().insert(
            http::header::ALLOW,
            http::HeaderValue::from_static("GET, HEAD"),
        );
        return r;
    }
    let text = scrape(live).await;
    http::Response::builder()
        .header(http::header::CONTENT_TYPE, CONTENT_TYPE)
        .header(http::header::CACHE_CONTROL, "no-store")
        .body(http_body_util::Full::new(bytes::Bytes::from(text)))
        .expect("a valid response")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::connections::ConnectionStatus;

    #[test]
    fn every_connection_state_has_a_label_value() {
        for s in [
            ConnectionStatus::Connecting,
            ConnectionStatus::Ready,
            ConnectionStatus::Disconnected(String::new()),
            ConnectionStatus::Degraded(String::new()),
            ConnectionStatus::Stalled(String::new()),
            ConnectionStatus::Stopped,
        ] {
            assert!(CONNECTION_STATES.contains(&s.as_str()), "{s}");
        }
    }

    #[test]
    fn calls_and_stages_are_counted_and_unoffered_names_share_one_label() {
        let m = Metrics::new();
        m.call_ended(
            Some("search_sources"),
            "completed",
            "",
            Some(Duration::from_micros(300)),
            &[("normalize", 12), ("execute", 200)],
        );
        m.call_ended(None, "invalid", "", Some(Duration::from_micros(10)), &[]);
        m.call_ended(None, "refused", "unavailable", None, &[]);
        let text = m.render(&Scraped::default());
        assert!(text.contains(r#"airlock_calls_total{capability="search_sources",category="",outcome="completed"} 1"#), "{text}");
        for line in [
            r#"airlock_calls_total{capability="(unoffered)",category="",outcome="invalid"} 1"#,
            r#"airlock_calls_total{capability="(unoffered)",category="unavailable",outcome="refused"} 1"#,
            // A call that never started is counted, not timed.
            r#"airlock_call_duration_seconds_count{capability="(unoffered)"} 1"#,
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert!(
            text.contains(r#"airlock_call_stage_duration_seconds_count{stage="execute"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"airlock_build_info{version=""#), "{text}");
    }

    #[test]
    fn gauges_follow_the_scrape_and_forget_what_is_gone() {
        let m = Metrics::new();
        let scraped = Scraped {
            connections: vec![("notes".into(), "ready")],
            mappings: vec![("source-library".into(), MappingState::Active)],
            waiting: Some(crate::store::Waiting {
                approvals_pending: 3,
                oldest_pending_ms: Some(1_000),
                intents_prepared: 1,
                intents_unknown: 2,
            }),
            now_ms: 31_000,
            journal_backlog_bytes: Some(4),
        };
        let text = m.render(&scraped);
        for line in [
            r#"airlock_connection_state{connection="notes",state="ready"} 1"#,
            r#"airlock_connection_state{connection="notes",state="stalled"} 0"#,
            r#"airlock_mapping_state{mapping="source-library",state="active"} 1"#,
            "airlock_approvals_pending 3",
            "airlock_approvals_pending_oldest_age_seconds 30",
            r#"airlock_intents_open{state="unknown"} 2"#,
            "airlock_trace_journal_backlog_bytes 4",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        // A connection or mapping that is gone is no longer reported.
        let text = m.render(&Scraped::default());
        assert!(!text.contains(r#"connection="notes""#), "{text}");
        assert!(!text.contains(r#"mapping="source-library""#), "{text}");
    }

    #[test]
    fn only_the_kinds_that_carry_a_metric_count_and_a_stray_state_is_not_a_label() {
        use crate::registry::events;
        let m = Metrics::new();
        m.traced(
            events::CONNECTION_STATE,
            "notes",
            &serde_json::json!({"to": "stalled"}),
        );
        m.traced(
            events::CONNECTION_STATE,
            "notes",
            &serde_json::json!({"to": "<script>"}),
        );
        m.traced(
            events::CONNECTION_RESTARTED,
            "notes",
            &serde_json::json!({}),
        );
        m.traced(events::CALL_OUTCOME, "notes", &serde_json::json!({}));
        let text = m.render(&Scraped::default());
        assert!(
            text.contains(
                r#"airlock_connection_transitions_total{connection="notes",to="stalled"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"airlock_connection_restarts_total{connection="notes"} 1"#),
            "{text}"
        );
        assert!(!text.contains("script"), "{text}");
    }
}
