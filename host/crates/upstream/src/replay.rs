//! An upstream that answers only from recorded fixtures (`airlock test`).
//!
//! Rules:
//! - No process is started and nothing leaves this process: the rmcp client of a
//!   [`Connection`](super::Connection) talks, through an in-memory pipe and the same
//!   budget filter and JSON-RPC checks as a live connection, to [`serve`], which answers
//!   `initialize` with a fixed result naming itself (`airlock-replay`), `ping` with `{}`,
//!   and `tools/call` / `resources/read` **only** from the exchanges of the fixture loaded
//!   ([`Replay::load`]). Every other method is `-32601`.
//! - A request matches a recorded exchange when the method is the same and the params
//!   it names (`name` and `arguments`, or `uri`; a client's `_meta` is not part of it)
//!   are equal as JSON values (member order does not matter) after the fixture's
//!   `redacted_fields` are redacted from the live request as they were at recording. Each
//!   recorded exchange answers once, in recorded order among equal requests.
//! - A request with no matching exchange is **never passed on or guessed**: it is
//!   answered with a JSON-RPC error whose message starts `missing fixture:` and names the
//!   method, the tool or URI and the arguments, and it is kept in [`Replay::misses`], so
//!   the test fails whatever the adapter makes of the error.
//! - A recorded answer is replayed as the server sent it: a `result` as the result, a
//!   JSON-RPC error as an error with the recorded message, an answer that was over budget
//!   as the transport's over-budget error, no answer as an unavailable connection.

use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, AsyncWrite, AsyncWriteExt as _, BufReader};

use crate::record::{Answer, Exchange, Redaction};

/// JSON-RPC error code of a request no fixture answers (and of a replayed error answer).
pub const REPLAY_ERROR_CODE: i32 = -32603;

/// The exchanges the replayed upstream may answer from, and the requests it could not.
#[derive(Default)]
pub struct Replay {
    state: Mutex<ReplayState>,
}

#[derive(Default)]
struct ReplayState {
    /// The fixture file the exchanges come from (for messages).
    fixture: String,
    /// The exchanges, each with whether it answered already.
    exchanges: Vec<(Exchange, bool)>,
    /// Field redaction applied to live requests before matching.
    redaction: Redaction,
    /// Requests no exchange answered, in words.
    misses: Vec<String>,
}

impl Replay {
    /// Replaces the exchanges answered from with those of `fixture` (file name, its
    /// exchanges and the member names it redacted); clears the misses.
    pub fn load(&self, fixture: &str, exchanges: &[Exchange], redacted_fields: &[String]) {
        let mut s = self.lock();
        s.fixture = fixture.to_string();
        s.exchanges = exchanges.iter().cloned().map(|x| (x, false)).collect();
        s.redaction = Redaction::new(Vec::new(), redacted_fields);
        s.misses.clear();
    }

    /// The requests no recorded exchange answered since the last [`Replay::load`].
    pub fn misses(&self) -> Vec<String> {
        self.lock().misses.clone()
    }

    /// How many of the loaded exchanges answered, and how many were loaded.
    pub fn used(&self) -> (usize, usize) {
        let s = self.lock();
        (
            s.exchanges.iter().filter(|(_, u)| *u).count(),
            s.exchanges.len(),
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ReplayState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The answer to `method` with `params`: the next unused matching exchange's, or a
    /// miss.
    fn answer(&self, method: &str, params: &Value) -> Result<Answer, String> {
        let mut s = self.lock();
        // What a fixture records of a request (`_meta` and the like are the client's).
        let mut wanted = crate::record::request_params(
            method,
            params
                .get(if method == "tools/call" {
                    "name"
                } else {
                    "uri"
                })
                .and_then(Value::as_str)
                .unwrap_or_default(),
            params.get("arguments"),
        );
        s.redaction.apply(&mut wanted);
        if let Some((x, used)) = s
            .exchanges
            .iter_mut()
            .find(|(x, used)| !*used && x.method == method && x.params == wanted)
        {
            *used = true;
            return Ok(x.answer.clone());
        }
        let what = match method {
            "tools/call" => {
                let args = params
                    .get("arguments")
                    .map_or("{}".to_string(), |a| a.to_string());
                format!(
                    "tools/call `{}` with arguments {}",
                    clip(params.get("name").and_then(Value::as_str).unwrap_or("?")),
                    clip(&args)
                )
            }
            _ => format!(
                "resources/read `{}`",
                clip(params.get("uri").and_then(Value::as_str).unwrap_or("?"))
            ),
        };
        let miss = format!(
            "missing fixture: {what} has no recorded answer in {} (record it with `airlock serve --record DIR`)",
            s.fixture
        );
        s.misses.push(miss.clone());
        Err(miss)
    }
}

/// At most 300 characters, control characters escaped.
fn clip(text: &str) -> String {
    let mut out: String = text
        .chars()
        .take(300)
        .flat_map(|c| {
            if c.is_control() {
                c.escape_default().collect::<Vec<_>>()
            } else {
                vec![c]
            }
        })
        .collect();
    if text.chars().count() > 300 {
        out.push('…');
    }
    out
}

/// Answers the rmcp client's lines read from `input` on `output`, from `replay`, until
/// `input` ends.
pub async fn serve<R, W>(replay: Arc<Replay>, input: R, mut output: W)
where
    R: tokio::io::AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut lines = BufReader::new(input).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let Ok(message) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let (Some(id), Some(method)) = (
            message.get("id").cloned(),
            message.get("method").and_then(Value::as_str),
        ) else {
            // Notifications and answers need no answer.
            continue;
        };
        let params = message.get("params").cloned().unwrap_or(Value::Null);
        let answer = match method {
            "initialize" => json!({"result": {
                "protocolVersion": params.get("protocolVersion").cloned().unwrap_or(json!("2025-11-25")),
                "capabilities": {"tools": {}, "resources": {}},
                "serverInfo": {"name": "airlock-replay", "version": env!("CARGO_PKG_VERSION")},
            }}),
            "ping" => json!({"result": {}}),
            "tools/call" | "resources/read" => match replay.answer(method, &params) {
                Ok(Answer::Result(v)) => json!({ "result": v }),
                Ok(Answer::Error { message }) => {
                    json!({"error": {"code": REPLAY_ERROR_CODE, "message": message}})
                }
                Ok(Answer::OutputTooLarge) => json!({"error": {
                    "code": super::OUTPUT_BUDGET_ERROR_CODE,
                    "message": "the recorded answer was over the output budget",
                }}),
                Ok(Answer::Unavailable { message }) => json!({"error": {
                    "code": super::http::HTTP_TRANSPORT_ERROR_CODE,
                    "message": format!("recorded as unavailable: {message}"),
                }}),
                Err(miss) => json!({"error": {"code": REPLAY_ERROR_CODE, "message": miss}}),
            },
            _ => {
                json!({"error": {"code": -32601, "message": format!("method not found: the replayed upstream answers only tools/call and resources/read ({})", clip(method))}})
            }
        };
        let mut reply = json!({"jsonrpc": "2.0", "id": id});
        if let (Value::Object(r), Value::Object(a)) = (&mut reply, answer) {
            r.extend(a);
        }
        let mut text = reply.to_string();
        text.push('\n');
        if output.write_all(text.as_bytes()).await.is_err() || output.flush().await.is_err() {
            break;
        }
    }
}
