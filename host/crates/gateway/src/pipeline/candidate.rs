//! Stage 1, candidate: a `tools/call` as the front received it.
//!
//! Rule: a candidate carries the session (and through it the requester and profile, which
//! the transport established), the capability name and raw arguments the model sent, and
//! what the client can do (protocol generation, elicitation). Nothing in it is trusted yet:
//! the name may not exist for this session and the arguments may not convert.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use rmcp::model::JsonObject;
use serde_json::Value;

use crate::pipeline::session::Session;

/// What the client on the other side can do, for this request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientAbilities {
    /// The protocol version of this request (`2025-11-25`, `2026-07-28`, ...).
    pub protocol: String,
    /// True for the stateless generation (2026-07-28 and later): no server→client
    /// requests; a person is asked through an `input_required` result instead.
    pub stateless: bool,
    /// The client declared form elicitation.
    pub elicitation: bool,
}

impl ClientAbilities {
    /// A 2025-11-25 client that cannot elicit (the out-of-band approval flow).
    pub fn plain() -> Self {
        Self {
            protocol: "2025-11-25".into(),
            stateless: false,
            elicitation: false,
        }
    }
}

/// The retry of an `input_required` call (MRTR): the echoed state and the client's
/// responses, keyed as the input requests were.
#[derive(Debug, Clone, PartialEq)]
pub struct Retry {
    /// `requestState`, echoed verbatim (untrusted).
    pub request_state: Option<String>,
    /// `inputResponses`.
    pub input_responses: BTreeMap<String, Value>,
}

/// A person's answer to an elicitation.
#[derive(Debug, Clone, PartialEq)]
pub enum ElicitAnswer {
    /// Accepted, with the form content.
    Accept(Value),
    /// Declined.
    Decline,
    /// Dismissed.
    Cancel,
    /// No answer: the client failed, timed out or cannot elicit. Detail for the log.
    Failed(String),
}

/// How the pipeline asks the person at the client (a 2025-11-25 `elicitation/create`).
pub trait Asker: Send + Sync {
    /// Sends a form elicitation with `message` and a one-field confirmation schema, and
    /// waits at most `timeout` for the answer.
    fn elicit<'a>(
        &'a self,
        message: &'a str,
        timeout: Duration,
    ) -> Pin<Box<dyn Future<Output = ElicitAnswer> + Send + 'a>>;
}

/// An [`Asker`] for a front that cannot reach the person.
pub struct NoAsker;

impl Asker for NoAsker {
    fn elicit<'a>(
        &'a self,
        _message: &'a str,
        _timeout: Duration,
    ) -> Pin<Box<dyn Future<Output = ElicitAnswer> + Send + 'a>> {
        Box::pin(async { ElicitAnswer::Failed("this front cannot ask the client".into()) })
    }
}

/// One `tools/call` as received.
pub struct Candidate {
    pub(super) session: Arc<Session>,
    pub(super) name: String,
    pub(super) arguments: JsonObject,
    pub(super) abilities: ClientAbilities,
    pub(super) retry: Option<Retry>,
    pub(super) cancel: Option<tokio_util::sync::CancellationToken>,
    /// The intent this call compensates (`airlock intents compensate`), recorded in its
    /// own intent and shown in the summary a person approves.
    pub(super) compensates: Option<String>,
    /// The context of the request's server span, when the host exports spans
    /// ([`crate::telemetry`]).
    pub(super) trace: Option<opentelemetry::Context>,
}

impl Candidate {
    /// The same candidate, cancelled when `token` is (the model-facing request's
    /// `notifications/cancelled`): the adapter is interrupted and its upstream request
    /// cancelled; a cancelled effect that may have acted is `unknown`.
    pub fn with_cancel(mut self, token: tokio_util::sync::CancellationToken) -> Self {
        self.cancel = Some(token);
        self
    }

    /// The same candidate, as the compensation of intent `intent`
    /// ([`crate::pipeline::compensate`]): its intent records `compensates`, and the
    /// summary a person approves says what it undoes.
    pub fn compensating(mut self, intent: impl Into<String>) -> Self {
        self.compensates = Some(intent.into());
        self
    }

    /// The same candidate, in the span of `context` (the MCP request's server span,
    /// [`crate::telemetry::Spans::server`]): its stages and upstream requests become
    /// spans under it, and its outcome event records the trace id.
    pub fn with_trace(mut self, context: opentelemetry::Context) -> Self {
        self.trace = Some(context);
        self
    }

    /// The intent this candidate compensates, if it is a compensation.
    pub fn compensates(&self) -> Option<&str> {
        self.compensates.as_deref()
    }

    /// A candidate call of capability `name` with `arguments` in `session`, from a client
    /// that can do `abilities`; `retry` when this is the retry of an `input_required`.
    pub fn new(
        session: Arc<Session>,
        name: impl Into<String>,
        arguments: Option<JsonObject>,
        abilities: ClientAbilities,
        retry: Option<Retry>,
    ) -> Self {
        Self {
            session,
            name: name.into(),
            arguments: arguments.unwrap_or_default(),
            abilities,
            retry,
            cancel: None,
            compensates: None,
            trace: None,
        }
    }

    /// The same call again (for a restart after a superseded revision).
    pub(super) fn again(&self) -> Self {
        Self {
            session: self.session.clone(),
            name: self.name.clone(),
            arguments: self.arguments.clone(),
            abilities: self.abilities.clone(),
            retry: self.retry.clone(),
            cancel: self.cancel.clone(),
            compensates: self.compensates.clone(),
            trace: self.trace.clone(),
        }
    }
}
