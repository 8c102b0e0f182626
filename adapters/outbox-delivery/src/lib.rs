//! `outbox-delivery`: the `artifact-delivery` contract over the delivery fixture MCP server.
//!
//! Upstream tools (the mapping lists exactly these):
//! - `stage_file {title, media_type, content}` → structured
//!   `{"file_id","sha256","bytes","title","media_type"}`;
//! - `list_outboxes {}` → structured `{"outboxes":[{"id","label"}]}`;
//! - `send_file {file_id, outbox, idempotency_key}` → structured
//!   `{"delivery_id","sha256","outbox","delivered_at","replayed"}`;
//! - `lookup_delivery {idempotency_key}` → structured `{"found":false}` or
//!   `{"found":true,"delivery":{"delivery_id","sha256","outbox","delivered_at"}}`.
//!
//! A refusal is a tool result with `isError` whose structured content is
//! `{"error": CODE, "message": SENTENCE}`.
//!
//! Locators (the host turns them into opaque tokens for the model, and back): an
//! `artifact-ref` is the upstream `file_id`; a `destination-ref` is the outbox id.
//!
//! Host version: `airlock:host@0.2.0` (world `airlock:worlds/artifact-delivery-adapter@0.2.0`).
//! The key `deliver` passes to `send_file`, and `query` looks up with `lookup_delivery`, is
//! the intent's idempotency key from `airlock:host/context` (`current-intent`), sent
//! unchanged. The host also fills the requests' `idempotency-key` field with that key; the
//! two must agree, and a call where they differ (or that carries no intent) is refused as
//! `invalid-request`, logged, and sends nothing. The adapter never retries a `send_file`.
//!
//! Error mapping of the upstream's refusals:
//!
//! | upstream `error`                 | contract error     |
//! |----------------------------------|--------------------|
//! | `conflict`                       | `conflict`         |
//! | `not_found`                      | `not-found`        |
//! | `invalid_argument`, `too_large`  | `invalid-request`  |
//! | `internal`                       | `unavailable`      |
//! | anything else, or no code        | `upstream-failed`  |
//!
//! An answer of an unexpected shape (missing fields, a malformed digest, a delivery to
//! another outbox than asked) is `upstream-failed`.

use airlock_sdk::artifact_delivery::{
    ContractError, DeliverRequest, Delivery, Destination, DestinationsRequest, Guest,
    PrepareRequest, PreparedArtifact, QueryRequest,
};
use airlock_sdk::{context, log, upstream};
use serde::{Deserialize, Serialize};

/// Destinations returned when the request sets no limit.
const DEFAULT_DESTINATIONS: u32 = 20;
/// Most destinations returned whatever the request's limit.
const MAX_DESTINATIONS: u32 = 100;

/// The adapter; it keeps no state between calls.
struct OutboxDelivery;

#[derive(Serialize)]
struct StageArgs<'a> {
    title: &'a str,
    media_type: &'a str,
    content: &'a str,
}

#[derive(Deserialize)]
struct Staged {
    file_id: String,
    sha256: String,
    bytes: u64,
    title: String,
    media_type: String,
}

#[derive(Serialize)]
struct NoArgs {}

#[derive(Deserialize)]
struct Outboxes {
    outboxes: Vec<Outbox>,
}

#[derive(Deserialize)]
struct Outbox {
    id: String,
    label: String,
}

#[derive(Serialize)]
struct SendArgs<'a> {
    file_id: &'a str,
    outbox: &'a str,
    idempotency_key: &'a str,
}

#[derive(Deserialize)]
struct Sent {
    delivery_id: String,
    sha256: String,
    outbox: String,
    delivered_at: String,
    replayed: bool,
}

#[derive(Serialize)]
struct LookupArgs<'a> {
    idempotency_key: &'a str,
}

#[derive(Deserialize)]
struct Lookup {
    found: bool,
    #[serde(default)]
    delivery: Option<Record>,
}

#[derive(Deserialize)]
struct Record {
    delivery_id: String,
    sha256: String,
    outbox: String,
    delivered_at: String,
}

/// The structured content of an upstream refusal.
#[derive(Deserialize)]
struct Refusal {
    error: String,
}

/// The contract error for an upstream refusal with code `code` (if the answer carried
/// one) and `message` (untrusted text, already bounded).
fn classify(code: Option<&str>, message: String) -> ContractError {
    match code {
        Some("conflict") => ContractError::Conflict(message),
        Some("not_found") => ContractError::NotFound,
        Some("invalid_argument" | "too_large") => ContractError::InvalidRequest(message),
        Some("internal") => ContractError::Unavailable(message),
        _ => ContractError::UpstreamFailed(message),
    }
}

/// The contract error for a tool result with `isError`.
fn refusal(output: &upstream::ToolOutput) -> ContractError {
    let message = output.error_message().unwrap_or_default();
    let code = output.structured::<Refusal>().ok().map(|r| r.error);
    classify(code.as_deref(), message)
}

/// Calls `tool` with `args`; a refusal becomes its contract error.
fn call<A: Serialize>(tool: &str, args: &A) -> Result<upstream::ToolOutput, ContractError> {
    let output = upstream::call_tool_json(tool, args)?;
    if output.is_error {
        return Err(refusal(&output));
    }
    Ok(output)
}

/// Whether `digest` is a sha256 as the contract carries it: 64 lowercase hex digits.
fn is_sha256(digest: &str) -> bool {
    digest.len() == 64
        && digest
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// `Err(invalid-request)` naming `what` when `value` is empty.
fn required(value: &str, what: &str) -> Result<(), ContractError> {
    if value.is_empty() {
        return Err(ContractError::invalid_request(format!("{what} is empty")));
    }
    Ok(())
}

/// The key to send upstream: the key of `intent` (its id and idempotency key, from the
/// host context), when the host-supplied `request_key` agrees with it. Messages name the
/// intent id, never a key.
fn agreed_key(intent: Option<(&str, &str)>, request_key: &str) -> Result<String, ContractError> {
    match intent {
        None => Err(ContractError::invalid_request(
            "the call carries no intent in its context; a delivery needs one",
        )),
        Some((intent, key)) if key != request_key => Err(ContractError::invalid_request(format!(
            "the request's idempotency key differs from the key of intent {intent}; nothing was sent"
        ))),
        Some((_, key)) => {
            required(key, "the intent's idempotency key")?;
            Ok(key.to_owned())
        }
    }
}

/// The intent's idempotency key for a request that carries `request_key` (see
/// [`agreed_key`]); a refusal is logged.
fn intent_key(request_key: &str) -> Result<String, ContractError> {
    let intent = context::current_intent();
    agreed_key(
        intent
            .as_ref()
            .map(|i| (i.id.as_str(), i.idempotency_key.as_str())),
        request_key,
    )
    .inspect_err(|e| log::error(&format!("refused: {e:?}")))
}

/// The contract's delivery from what the upstream reported, checked against the
/// destination that was asked for.
fn delivery(
    delivery_id: String,
    sha256: String,
    outbox: String,
    delivered_at: String,
    replayed: bool,
    asked: Option<&str>,
) -> Result<Delivery, ContractError> {
    if delivery_id.is_empty() || !is_sha256(&sha256) || outbox.is_empty() {
        return Err(ContractError::upstream_failed(
            "the delivery lacks an id, a sha256 digest or an outbox",
        ));
    }
    if asked.is_some_and(|asked| asked != outbox) {
        return Err(ContractError::upstream_failed(
            "the upstream reports a delivery to another outbox than requested",
        ));
    }
    Ok(Delivery {
        delivery_id,
        artifact_sha256: sha256,
        destination: outbox,
        delivered_at,
        replayed,
    })
}

impl Guest for OutboxDelivery {
    fn prepare(request: PrepareRequest) -> Result<PreparedArtifact, ContractError> {
        let output = call(
            "stage_file",
            &StageArgs {
                title: &request.title,
                media_type: &request.media_type,
                content: &request.content,
            },
        )?;
        let staged: Staged = output.structured()?;
        if staged.file_id.is_empty() || !is_sha256(&staged.sha256) {
            return Err(ContractError::upstream_failed(
                "the staged file lacks an id or a sha256 digest",
            ));
        }
        if staged.bytes != request.content.len() as u64 {
            return Err(ContractError::upstream_failed(format!(
                "the upstream staged {} bytes of a {}-byte content",
                staged.bytes,
                request.content.len()
            )));
        }
        log::debug(&format!(
            "staged {} ({} bytes)",
            staged.file_id, staged.bytes
        ));
        Ok(PreparedArtifact {
            artifact: staged.file_id,
            sha256: staged.sha256,
            bytes: staged.bytes,
            title: staged.title,
            media_type: staged.media_type,
        })
    }

    fn list_destinations(request: DestinationsRequest) -> Result<Vec<Destination>, ContractError> {
        let limit = request
            .limit
            .unwrap_or(DEFAULT_DESTINATIONS)
            .min(MAX_DESTINATIONS) as usize;
        let output = call("list_outboxes", &NoArgs {})?;
        let listed: Outboxes = output.structured()?;
        Ok(listed
            .outboxes
            .into_iter()
            .filter(|outbox| !outbox.id.is_empty())
            .take(limit)
            .map(|outbox| Destination {
                destination: outbox.id,
                label: outbox.label,
            })
            .collect())
    }

    fn deliver(request: DeliverRequest) -> Result<Delivery, ContractError> {
        required(&request.artifact, "the artifact reference")?;
        required(&request.destination, "the destination reference")?;
        required(&request.idempotency_key, "the idempotency key")?;
        let key = intent_key(&request.idempotency_key)?;
        // One request, never retried: an unknown outcome is reconciled by the host
        // through `query`.
        let output = call(
            "send_file",
            &SendArgs {
                file_id: &request.artifact,
                outbox: &request.destination,
                idempotency_key: &key,
            },
        )?;
        let sent: Sent = output.structured()?;
        log::info(&format!(
            "delivery {} to {}{}",
            sent.delivery_id,
            sent.outbox,
            if sent.replayed { " (replayed)" } else { "" }
        ));
        delivery(
            sent.delivery_id,
            sent.sha256,
            sent.outbox,
            sent.delivered_at,
            sent.replayed,
            Some(&request.destination),
        )
    }

    fn query(request: QueryRequest) -> Result<Option<Delivery>, ContractError> {
        required(&request.idempotency_key, "the idempotency key")?;
        let key = intent_key(&request.idempotency_key)?;
        let output = call(
            "lookup_delivery",
            &LookupArgs {
                idempotency_key: &key,
            },
        )?;
        let lookup: Lookup = output.structured()?;
        match (lookup.found, lookup.delivery) {
            (false, _) => Ok(None),
            // What a query finds was delivered earlier under this key; the query itself
            // delivered nothing new, so it reads as a replay.
            (true, Some(record)) => delivery(
                record.delivery_id,
                record.sha256,
                record.outbox,
                record.delivered_at,
                true,
                None,
            )
            .map(Some),
            (true, None) => Err(ContractError::upstream_failed(
                "the lookup reports a delivery but does not describe it",
            )),
        }
    }
}

airlock_sdk::export_artifact_delivery!(OutboxDelivery);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_map_to_contract_errors() {
        let m = || "why".to_owned();
        assert!(
            matches!(classify(Some("conflict"), m()), ContractError::Conflict(w) if w == "why")
        );
        assert!(matches!(
            classify(Some("not_found"), m()),
            ContractError::NotFound
        ));
        assert!(matches!(
            classify(Some("invalid_argument"), m()),
            ContractError::InvalidRequest(_)
        ));
        assert!(matches!(
            classify(Some("too_large"), m()),
            ContractError::InvalidRequest(_)
        ));
        assert!(matches!(
            classify(Some("internal"), m()),
            ContractError::Unavailable(_)
        ));
        assert!(matches!(
            classify(Some("other"), m()),
            ContractError::UpstreamFailed(_)
        ));
        assert!(matches!(
            classify(None, m()),
            ContractError::UpstreamFailed(_)
        ));
    }

    #[test]
    fn deliveries_are_checked() {
        let digest = "a".repeat(64);
        let ok = delivery(
            "dlv-0001".into(),
            digest.clone(),
            "archive".into(),
            "2026-01-01T00:00:00Z".into(),
            false,
            Some("archive"),
        )
        .unwrap();
        assert_eq!(ok.destination, "archive");
        assert_eq!(ok.artifact_sha256, digest);
        assert!(!ok.replayed);
        for (id, sha, outbox, asked) in [
            ("", digest.as_str(), "archive", Some("archive")),
            ("dlv-0001", "ABC", "archive", Some("archive")),
            ("dlv-0001", &"A".repeat(64), "archive", Some("archive")),
            ("dlv-0001", digest.as_str(), "", None),
            ("dlv-0001", digest.as_str(), "team-reports", Some("archive")),
        ] {
            let error = delivery(
                id.into(),
                sha.into(),
                outbox.into(),
                String::new(),
                false,
                asked,
            )
            .unwrap_err();
            assert!(
                matches!(error, ContractError::UpstreamFailed(_)),
                "{id} {sha} {outbox}"
            );
        }
    }

    /// A tool result as the delivery fixture sends it: structured content plus text.
    fn output(structured: &str, is_error: bool, text: &str) -> upstream::ToolOutput {
        upstream::ToolOutput {
            content: vec![upstream::ContentBlock::Text(text.to_owned())],
            structured_json: Some(structured.to_owned()),
            is_error,
        }
    }

    #[test]
    fn fixture_answers_parse() {
        let digest = "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03";
        let staged: Staged = output(
            &format!(
                r#"{{"file_id":"file-0001","sha256":"{digest}","bytes":6,"title":"t","media_type":"text/plain"}}"#
            ),
            false,
            "",
        )
        .structured()
        .unwrap();
        assert_eq!((staged.file_id.as_str(), staged.bytes), ("file-0001", 6));
        let listed: Outboxes = output(
            r#"{"outboxes":[{"id":"archive","label":"Archive outbox"}]}"#,
            false,
            "",
        )
        .structured()
        .unwrap();
        assert_eq!(listed.outboxes[0].id, "archive");
        // The fixture also reports the file id; extra fields are ignored.
        let sent: Sent = output(
            &format!(
                r#"{{"delivery_id":"dlv-0001","file_id":"file-0001","sha256":"{digest}","outbox":"archive","delivered_at":"2026-01-01T00:00:00Z","replayed":true}}"#
            ),
            false,
            "",
        )
        .structured()
        .unwrap();
        assert!(sent.replayed);
        let missing: Lookup = output(r#"{"found":false}"#, false, "")
            .structured()
            .unwrap();
        assert!(!missing.found && missing.delivery.is_none());
        let found: Lookup = output(
            &format!(
                r#"{{"found":true,"delivery":{{"delivery_id":"dlv-0001","file_id":"file-0001","sha256":"{digest}","outbox":"archive","delivered_at":"2026-01-01T00:00:00Z"}}}}"#
            ),
            false,
            "",
        )
        .structured()
        .unwrap();
        assert_eq!(found.delivery.unwrap().outbox, "archive");
    }

    #[test]
    fn fixture_refusals_classify() {
        let conflict = output(
            r#"{"error":"conflict","message":"idempotency key already used for another delivery"}"#,
            true,
            "idempotency key already used for another delivery",
        );
        assert!(matches!(
            refusal(&conflict),
            ContractError::Conflict(m) if m == "idempotency key already used for another delivery"
        ));
        let unknown = output(
            r#"{"error":"not_found","message":"no outbox with id \"x\""}"#,
            true,
            "no outbox with id \"x\"",
        );
        assert!(matches!(refusal(&unknown), ContractError::NotFound));
        // A refusal without structured content is an upstream failure carrying the text.
        let bare = upstream::ToolOutput {
            content: vec![upstream::ContentBlock::Text("boom".into())],
            structured_json: None,
            is_error: true,
        };
        assert!(matches!(refusal(&bare), ContractError::UpstreamFailed(m) if m == "boom"));
    }

    #[test]
    fn the_key_sent_is_the_intents_and_must_agree_with_the_request() {
        let key = "idk_00112233445566778899aabbccddeeff";
        assert_eq!(agreed_key(Some(("int_1", key)), key).unwrap(), key);
        assert!(matches!(
            agreed_key(Some(("int_1", key)), "idk_other"),
            Err(ContractError::InvalidRequest(w)) if w.contains("differs") && w.contains("int_1") && !w.contains(key)
        ));
        assert!(matches!(
            agreed_key(None, key),
            Err(ContractError::InvalidRequest(w)) if w.contains("no intent")
        ));
        assert!(matches!(
            agreed_key(Some(("int_1", "")), ""),
            Err(ContractError::InvalidRequest(_))
        ));
    }

    #[test]
    fn empty_references_are_invalid_requests() {
        assert!(required("x", "it").is_ok());
        assert!(matches!(
            required("", "the idempotency key"),
            Err(ContractError::InvalidRequest(w)) if w == "the idempotency key is empty"
        ));
    }
}
