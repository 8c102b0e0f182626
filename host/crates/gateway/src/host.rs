//! The host: the composition root of a running Airlock.
//!
//! It owns the live registry ([`Live`]: connections, mappings, the catalog), the policy
//! engine, and the request-state codec, and it opens sessions. It holds no per-call logic:
//! a call's life is in [`crate::pipeline`], its transport in [`crate::front`].
//!
//! Rules:
//! - A session is bound to a requester from the serve configuration and a profile the
//!   requester may use (`Airlock::Action::"use-profile"`), never to anything a client says.
//! - The policy hot-reloads: [`Host::reload_policy`] replaces it when its files changed and
//!   validate; the next decision uses it. A policy that does not validate leaves the old one
//!   deciding and is traced (`policy-load-failed`).
//! - The `requestState` key (HMAC-SHA256, 32 random bytes) lives only in this process: a
//!   restart invalidates every outstanding `input_required` state, which then fails closed.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context as _, Result, bail};
use rmcp::model::RequestStateCodec;
use serde_json::json;

use crate::config::ServeConfig;
use crate::pipeline::session::{Requester, Session};
use crate::policy::{Policy, PolicyEngine, Verdict};
use crate::registry::Registry;
use crate::registry::events;
use crate::registry::live::{Catalog, Live, MappingSource};
use crate::store::NewEvent;

/// A running Airlock.
pub struct Host {
    live: Arc<Live>,
    policy: PolicyEngine,
    request_state: RequestStateCodec,
    /// Digest of the policy files' contents as last read (changed or not), to skip reloads
    /// of unchanged files.
    policy_seen: std::sync::Mutex<String>,
    /// When this host started (ms since the epoch): a `prepared` intent older than this
    /// was left by a host that stopped, and is reconciled.
    started_ms: u64,
    /// This host process among the hosts of one store (`hst_` + 16 hex, random per
    /// start): recorded with each intent it creates, and held as its liveness lock on a
    /// shared store, so another host reconciles its intents only once it has stopped.
    instance: String,
    /// Where adapter calls are recorded as fixtures (`serve --record`); unset: nothing is
    /// kept (one check per call).
    recorder: std::sync::OnceLock<Arc<crate::record::Recorder>>,
    /// One log line per refused call, bounded per category
    /// ([`crate::pipeline::refusals`]).
    refusals: crate::pipeline::refusals::RefusalLog,
    /// The span exporter, when `[telemetry] otlp` names a collector; `None`: no span is
    /// made anywhere (one check per request).
    spans: Option<Arc<crate::telemetry::Spans>>,
}

impl Host {
    /// Loads the policy, then starts the configured connections and mappings.
    ///
    /// # Errors
    /// The policy does not load or validate; a connection or mapping fails to start.
    pub async fn start(config: &ServeConfig) -> Result<Arc<Self>> {
        config.check_confinement()?;
        let policy = Policy::load(&config.policy_files)?;
        let live = Live::start(config).await?;
        Self::assemble(live, policy)
    }

    /// Like [`Host::start`], with mappings given in memory.
    ///
    /// # Errors
    /// As [`Host::start`].
    pub async fn start_with(
        config: &ServeConfig,
        sources: Vec<MappingSource>,
    ) -> Result<Arc<Self>> {
        config.check_confinement()?;
        let policy = Policy::load(&config.policy_files)?;
        let live = Live::start_with(config, sources).await?;
        Self::assemble(live, policy)
    }

    /// Like [`Host::start_with`], on an open registry.
    ///
    /// # Errors
    /// As [`Host::start`].
    pub async fn start_with_registry(
        config: &ServeConfig,
        sources: Vec<MappingSource>,
        registry: Registry,
    ) -> Result<Arc<Self>> {
        config.check_confinement()?;
        let policy = Policy::load(&config.policy_files)?;
        let live = Live::start_with_registry(config, sources, registry).await?;
        Self::assemble(live, policy)
    }

    fn assemble(live: Arc<Live>, policy: Policy) -> Result<Arc<Self>> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).expect("the OS random generator failed");
        let request_state =
            RequestStateCodec::try_new(key.to_vec()).expect("a 32-byte key is long enough");
        live.registry().trace(
            events::POLICY_LOADED,
            policy.digest().as_ref(),
            json!({"digest": &**policy.digest(), "files": policy.files()}),
        );
        tracing::info!(policy = %crate::registry::short(policy.digest()), files = policy.files().len(), "policy loaded");
        let seen = policy_files_digest(&live.config().policy_files);
        let instance = crate::store::approvals::random_id("hst_", 8);
        if let Err(e) = live.registry().store().register_host(&instance) {
            // Other hosts would take this one for stopped and reconcile its open intents.
            tracing::error!(host = %instance, "this host could not register as alive in the shared store: {e:#}");
        }
        let spans = match &live.config().telemetry.otlp {
            Some(url) => {
                let spans = crate::telemetry::Spans::start(url, &instance)?;
                // Without its query: a collector's token may ride there.
                let shown = url.split(['?', '#']).next().unwrap_or_default();
                tracing::info!(url = %shown, "exporting OpenTelemetry spans (OTLP/HTTP)");
                Some(Arc::new(spans))
            }
            None => None,
        };
        Ok(Arc::new(Self {
            live,
            policy: PolicyEngine::new(policy),
            request_state,
            policy_seen: std::sync::Mutex::new(seen),
            started_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            recorder: std::sync::OnceLock::new(),
            refusals: crate::pipeline::refusals::RefusalLog::default(),
            instance,
            spans,
        }))
    }

    /// The span exporter, when `[telemetry] otlp` is set ([`crate::telemetry`]).
    pub fn spans(&self) -> Option<&Arc<crate::telemetry::Spans>> {
        self.spans.as_ref()
    }

    /// Exports the spans still queued and stops the exporter (a no-op without one); run
    /// it when the host stops. Blocks a blocking-pool thread, not the caller.
    pub async fn flush_spans(&self) {
        if let Some(spans) = self.spans.clone() {
            let _ = tokio::task::spawn_blocking(move || spans.shutdown()).await;
        }
    }

    /// Records every adapter call from now on as a fixture file written by `recorder`
    /// (`airlock serve --record DIR`, see [`crate::record`]). Set once; a second call is
    /// refused.
    ///
    /// # Errors
    /// A recorder is already set.
    pub fn record_to(&self, recorder: Arc<crate::record::Recorder>) -> Result<()> {
        self.recorder
            .set(recorder)
            .map_err(|_| anyhow::anyhow!("this host already records its calls"))
    }

    /// The recorder, when the host records its calls.
    pub fn recorder(&self) -> Option<&Arc<crate::record::Recorder>> {
        self.recorder.get()
    }

    /// When this host started, in ms since the Unix epoch.
    pub fn started_ms(&self) -> u64 {
        self.started_ms
    }

    /// This host process's instance id (`hst_…`, see the field's rule).
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The log of refused calls ([`crate::pipeline::refusals`]).
    pub fn refusals(&self) -> &crate::pipeline::refusals::RefusalLog {
        &self.refusals
    }

    /// The live registry.
    pub fn live(&self) -> &Arc<Live> {
        &self.live
    }

    /// The policy engine.
    pub fn policy(&self) -> &PolicyEngine {
        &self.policy
    }

    /// The codec sealing `requestState` values.
    pub fn request_state(&self) -> &RequestStateCodec {
        &self.request_state
    }

    /// The serve configuration.
    pub fn config(&self) -> &ServeConfig {
        self.live.config()
    }

    /// The registry (store and trace).
    pub fn registry(&self) -> &Registry {
        self.live.registry()
    }

    /// The current catalog (every loaded capability; see [`crate::pipeline::offer`] for
    /// what a session is offered).
    pub fn catalog(&self) -> Arc<Catalog> {
        self.live.catalog()
    }

    /// Applies mapping records changed in the store (see [`Live::sync_with_store`]).
    ///
    /// # Errors
    /// The store fails.
    pub async fn sync_with_store(&self) -> Result<bool> {
        self.live.sync_with_store().await
    }

    /// The stdio requester of this configuration.
    pub fn stdio_requester(&self) -> Requester {
        let r = &self.config().requester;
        Requester {
            name: r.name.clone(),
            roles: r.roles.clone(),
            transport: "stdio",
        }
    }

    /// Opens a session for `requester` under profile `profile` (else the configuration's
    /// default), if policy lets the requester use it. Traced (`session-opened`).
    ///
    /// # Errors
    /// The profile is not configured, or policy does not let the requester use it.
    pub fn open_session(
        &self,
        requester: Requester,
        profile: Option<&str>,
    ) -> Result<Arc<Session>> {
        self.open_session_as(requester, profile, false)
    }

    /// [`Host::open_session`] for a principal of the HTTP front, whose requests any host
    /// behind a load balancer may serve: on a shared store its session has the same id on
    /// every host ([`SessionId::of_principal`](crate::pipeline::session::SessionId::of_principal))
    /// and keeps its references in the store; otherwise as [`Host::open_session`].
    ///
    /// # Errors
    /// As [`Host::open_session`].
    pub fn open_principal_session(
        &self,
        requester: Requester,
        profile: Option<&str>,
    ) -> Result<Arc<Session>> {
        self.open_session_as(requester, profile, true)
    }

    fn open_session_as(
        &self,
        requester: Requester,
        profile: Option<&str>,
        principal_bound: bool,
    ) -> Result<Arc<Session>> {
        let profile = self.config().profile(profile)?.clone();
        let principal =
            crate::policy::Principal::new(&requester.name, &requester.roles, requester.transport)?;
        let decision = self.policy.may_use_profile(&principal, &profile.name);
        if decision.verdict != Verdict::Allow {
            bail!(
                "policy does not let requester `{}` use profile `{}` (policy {})",
                requester.name,
                profile.name,
                crate::registry::short(&decision.policy_digest)
            );
        }
        let shared = self
            .registry()
            .store_if_shared()
            .filter(|_| principal_bound);
        let session = Arc::new(match shared {
            Some(store) => {
                let id = crate::pipeline::session::SessionId::of_principal(
                    store.trace_key(),
                    &requester,
                    &profile.name,
                );
                Session::with_id(requester, profile, id, Some(store))?
            }
            None => Session::new(requester, profile)?,
        });
        self.registry().trace(
            events::SESSION_OPENED,
            session.id_text(),
            json!({
                "stage": "bound",
                "session": session.id_text(),
                "requester": session.requester().name,
                "roles": session.requester().roles,
                "transport": session.requester().transport,
                "profile": session.profile().name,
                "policy_digest": &*decision.policy_digest,
            }),
        );
        tracing::info!(session = %session.id_text(), requester = %session.requester().name, profile = %session.profile().name, "session opened");
        Ok(session)
    }

    /// Opens a stdio session (the configured requester) under `profile`.
    ///
    /// # Errors
    /// As [`Host::open_session`].
    pub fn stdio_session(&self, profile: Option<&str>) -> Result<Arc<Session>> {
        self.open_session(self.stdio_requester(), profile)
    }

    /// A front for a new stdio session under `profile` (see [`Host::stdio_session`]).
    ///
    /// # Errors
    /// As [`Host::open_session`].
    pub fn front(self: &Arc<Self>, profile: Option<&str>) -> Result<crate::front::McpFront> {
        Ok(crate::front::McpFront::new(
            self.clone(),
            self.stdio_session(profile)?,
        ))
    }

    /// Re-reads the policy files; when their contents changed and validate, the new
    /// policy decides from the next decision on and every front is told the catalogue may
    /// have changed. Returns true when the policy was replaced.
    ///
    /// # Errors
    /// The changed policy does not load or validate (the previous one keeps deciding; the
    /// refusal is traced).
    pub fn reload_policy(&self) -> Result<bool> {
        let files = &self.config().policy_files;
        let seen = policy_files_digest(files);
        {
            let mut last = self.policy_seen.lock().unwrap_or_else(|e| e.into_inner());
            if *last == seen {
                return Ok(false);
            }
            *last = seen;
        }
        match Policy::load(files) {
            Ok(policy) => {
                if policy.digest() == self.policy.current().digest() {
                    return Ok(false);
                }
                let event = NewEvent::new(
                    events::POLICY_LOADED,
                    policy.digest().to_string(),
                    json!({
                        "digest": &**policy.digest(),
                        "previous": &**self.policy.current().digest(),
                        "files": policy.files(),
                    }),
                );
                // The trace holds the new policy before it decides anything.
                if let Err(e) = self.registry().store().append_events(vec![event]) {
                    tracing::error!("policy not reloaded: the reload could not be traced: {e:#}");
                    *self.policy_seen.lock().unwrap_or_else(|e| e.into_inner()) = String::new();
                    return Err(e).context("tracing the policy reload");
                }
                tracing::info!(policy = %crate::registry::short(policy.digest()), "policy reloaded");
                self.policy.replace(policy);
                self.live.notify_changed();
                Ok(true)
            }
            Err(e) => {
                let message = format!("{e:#}");
                tracing::error!(
                    "policy not reloaded; the previous policy keeps deciding: {message}"
                );
                self.registry().trace(
                    events::POLICY_LOAD_FAILED,
                    "policy",
                    json!({
                        "error": message.chars().take(2000).collect::<String>(),
                        "current": &**self.policy.current().digest(),
                    }),
                );
                Err(e).context("the changed policy was refused")
            }
        }
    }

    /// The folders holding the policy files (watched for hot reload).
    pub fn policy_folders(&self) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = self
            .config()
            .policy_files
            .iter()
            .filter_map(|f| f.parent().map(PathBuf::from))
            .collect();
        dirs.sort();
        dirs.dedup();
        dirs
    }
}

/// A digest of the policy files' current bytes (unreadable files count as empty), to tell
/// whether a reload has anything to do.
fn policy_files_digest(files: &[PathBuf]) -> String {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    for f in files {
        h.update(f.display().to_string().as_bytes());
        h.update([0]);
        h.update(std::fs::read(f).unwrap_or_default());
        h.update([0]);
    }
    hex::encode(h.finalize())
}
