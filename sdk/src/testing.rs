//! A native test kit for adapters (feature `testing`): run the contract functions in a
//! plain `cargo test`, against canned upstream replies, with no host and no server.
//!
//! Rule: the kit answers as the host would, or fails the test. A call to a tool with a
//! registered reply gets that reply; a tool the mapping does not list gets the host's
//! [`UpstreamError::NotPermitted`] (with [`Upstream::from_mapping`]); arguments that are
//! not a JSON object get the host's [`UpstreamError::InvalidArguments`]; any other call
//! **panics**, naming the tool and its arguments, so an unexpected upstream call fails the
//! test instead of passing silently. MCP results given as JSON ([`Reply::mcp`]) become a
//! [`ToolOutput`] by the host's rules (`content` blocks, `structuredContent`, `isError`).
//!
//! What a reply is matched by, first match wins:
//!
//! | registered with | answers |
//! |---|---|
//! | [`Upstream::reply_to`]`(tool, args, reply)` | a call of `tool` whose arguments equal `args` (JSON equality) |
//! | [`Upstream::reply`]`(tool, reply)` | any other call of `tool` |
//! | [`Upstream::resource`]`(uri, text, mime)` | `read_resource(uri)` |
//!
//! The kit is installed on the calling thread ([`Upstream::install`]) until the returned
//! [`Installed`] is dropped; it records every call ([`Installed::calls`]) and log message
//! ([`Installed::logs`]). A fresh kit has no intent ([`crate::context::current_intent`] is
//! `None`, as for a read) and [`DEFAULT_REMAINING_MS`] left.
//!
//! ```ignore
//! use airlock_sdk::testing::{Reply, Upstream};
//!
//! let kit = Upstream::from_mapping("mapping.toml")
//!     .reply("search_notes", Reply::structured(json!({"hits": [{"id": "n1", "title": "WAL"}]})))
//!     .install();
//! let hits = MyNotes::search(SearchRequest { query: "wal".into(), limit: None }).unwrap();
//! assert_eq!(hits[0].reference, "n1");
//! assert_eq!(kit.calls()[0].arguments["query"], "wal");
//! ```

use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;

use serde_json::Value;

use crate::context::Intent;
use crate::log::Level;
use crate::upstream::{
    ContentBlock, ResourceContents, ResourceLink, ResourceText, ToolOutput, UpstreamError,
};

/// What [`crate::context::remaining_ms`] answers unless [`Upstream::remaining_ms`] says
/// otherwise: the host's default deadline (`limits.deadline_ms`).
pub const DEFAULT_REMAINING_MS: u64 = 5000;

/// One canned answer of an upstream tool.
#[derive(Debug, Clone)]
pub enum Reply {
    /// The tool's result, as the adapter receives it.
    Output(ToolOutput),
    /// A refusal or failure the host reports instead of a result.
    Error(UpstreamError),
}

impl Reply {
    /// A result with `value` as `structuredContent` and, as servers send it, the same JSON
    /// as its one text block.
    pub fn structured(value: Value) -> Self {
        let json = value.to_string();
        Reply::Output(ToolOutput {
            content: vec![ContentBlock::Text(json.clone())],
            structured_json: Some(json),
            is_error: false,
        })
    }

    /// A result with one text block.
    pub fn text(text: impl Into<String>) -> Self {
        Reply::Output(ToolOutput {
            content: vec![ContentBlock::Text(text.into())],
            structured_json: None,
            is_error: false,
        })
    }

    /// A tool-level failure: `isError: true` with `message` as its text block (what a
    /// server answers for an unknown id, a bad query...). Not an [`UpstreamError`].
    pub fn tool_error(message: impl Into<String>) -> Self {
        Reply::Output(ToolOutput {
            content: vec![ContentBlock::Text(message.into())],
            structured_json: None,
            is_error: true,
        })
    }

    /// A refusal or failure of the host: `not-permitted`, `unavailable`,
    /// `output-too-large`... (converted to the contract's error by `?` as in the host).
    pub fn error(error: UpstreamError) -> Self {
        Reply::Error(error)
    }

    /// An MCP `tools/call` result as JSON (`{"content": [...], "structuredContent": ...,
    /// "isError": ...}`), converted as the host converts what a server sends: `text`,
    /// `resource` (with text) and `resource_link` blocks keep their fields, any other
    /// block becomes [`ContentBlock::Other`] with its type.
    pub fn mcp(result: Value) -> Self {
        let text = |v: &Value, key: &str| v.get(key).and_then(Value::as_str).map(str::to_owned);
        let content = result["content"]
            .as_array()
            .map(|blocks| {
                blocks
                    .iter()
                    .map(|b| match b["type"].as_str().unwrap_or("unknown") {
                        "text" => ContentBlock::Text(text(b, "text").unwrap_or_default()),
                        "resource" if b["resource"]["text"].is_string() => {
                            let r = &b["resource"];
                            ContentBlock::ResourceText(ResourceText {
                                uri: text(r, "uri").unwrap_or_default(),
                                mime_type: text(r, "mimeType"),
                                text: text(r, "text").unwrap_or_default(),
                            })
                        }
                        "resource_link" => ContentBlock::ResourceLink(ResourceLink {
                            uri: text(b, "uri").unwrap_or_default(),
                            name: text(b, "name").unwrap_or_default(),
                            mime_type: text(b, "mimeType"),
                        }),
                        other => ContentBlock::Other(other.chars().take(64).collect()),
                    })
                    .collect()
            })
            .unwrap_or_default();
        Reply::Output(ToolOutput {
            content,
            structured_json: result.get("structuredContent").map(Value::to_string),
            is_error: result["isError"].as_bool().unwrap_or(false),
        })
    }
}

/// One upstream call the adapter made.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The tool name, or the URI for a resource read.
    pub tool: String,
    /// The arguments as JSON (`Value::Null` for a resource read).
    pub arguments: Value,
}

/// Canned upstream replies and the call's context, before [`Upstream::install`].
#[derive(Debug, Clone)]
pub struct Upstream {
    mapping: String,
    tools: Option<Vec<String>>,
    resource_prefixes: Option<Vec<String>>,
    replies: Vec<(String, Option<Value>, Reply)>,
    resources: Vec<(String, Vec<ResourceContents>)>,
    intent: Option<Intent>,
    remaining_ms: u64,
    settings: std::collections::BTreeMap<String, crate::settings::Value>,
}

impl Default for Upstream {
    fn default() -> Self {
        Self::new()
    }
}

impl Upstream {
    /// A kit with no replies, every tool permitted (any call without a reply panics), no
    /// intent and [`DEFAULT_REMAINING_MS`] left; mapping name `test`.
    pub fn new() -> Self {
        Self {
            mapping: "test".to_owned(),
            tools: None,
            resource_prefixes: None,
            replies: Vec::new(),
            resources: Vec::new(),
            intent: None,
            remaining_ms: DEFAULT_REMAINING_MS,
            settings: std::collections::BTreeMap::new(),
        }
    }

    /// A kit that permits what the mapping manifest at `path` lists, as the host does:
    /// `[upstream] tools` and `resources` (a tool or resource outside them gets
    /// [`UpstreamError::NotPermitted`] and nothing is answered), and answers its
    /// `[settings]` ([`crate::settings`]). Relative paths resolve against the current
    /// folder (`cargo test` runs in the crate's folder).
    ///
    /// # Panics
    /// The file cannot be read or is not a mapping manifest (the message says which).
    pub fn from_mapping(path: impl AsRef<Path>) -> Self {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| {
            panic!(
                "airlock_sdk::testing: reading the mapping {}: {e}",
                path.display()
            )
        });
        Self::from_mapping_text(&text)
            .unwrap_or_else(|e| panic!("airlock_sdk::testing: mapping {}: {e}", path.display()))
    }

    /// Like [`Upstream::from_mapping`], from the manifest's text.
    ///
    /// # Errors
    /// Not TOML, no `[mapping] name`, or a setting that is not a string, an integer or a
    /// boolean.
    pub fn from_mapping_text(text: &str) -> Result<Self, String> {
        let table: toml::Table = toml::from_str(text).map_err(|e| format!("not TOML: {e}"))?;
        let mapping = table
            .get("mapping")
            .and_then(|m| m.get("name"))
            .and_then(toml::Value::as_str)
            .ok_or("no [mapping] name")?
            .to_owned();
        let list = |key: &str| -> Vec<String> {
            table
                .get("upstream")
                .and_then(|u| u.get(key))
                .and_then(toml::Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(toml::Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut settings = std::collections::BTreeMap::new();
        if let Some(table) = table.get("settings").and_then(toml::Value::as_table) {
            for (name, value) in table {
                let value = match value {
                    toml::Value::String(t) => crate::settings::Value::Text(t.clone()),
                    toml::Value::Integer(i) => crate::settings::Value::Integer(*i),
                    toml::Value::Boolean(b) => crate::settings::Value::Boolean(*b),
                    other => {
                        return Err(format!(
                            "[settings] {name} is a {}: a setting is a string, an integer or a boolean",
                            other.type_str()
                        ));
                    }
                };
                settings.insert(name.clone(), value);
            }
        }
        Ok(Self {
            mapping,
            tools: Some(list("tools")),
            resource_prefixes: Some(list("resources")),
            settings,
            ..Self::new()
        })
    }

    /// Answers every call of `tool` (whatever its arguments) with `reply`, unless a
    /// [`Upstream::reply_to`] matches first.
    pub fn reply(mut self, tool: &str, reply: Reply) -> Self {
        self.replies.push((tool.to_owned(), None, reply));
        self
    }

    /// Answers a call of `tool` whose arguments equal `arguments` with `reply`.
    pub fn reply_to(mut self, tool: &str, arguments: Value, reply: Reply) -> Self {
        self.replies.push((tool.to_owned(), Some(arguments), reply));
        self
    }

    /// Answers `read_resource(uri)` with one text content.
    pub fn resource(mut self, uri: &str, text: &str, mime_type: Option<&str>) -> Self {
        self.resources.push((
            uri.to_owned(),
            vec![ResourceContents {
                uri: uri.to_owned(),
                mime_type: mime_type.map(str::to_owned),
                text: Some(text.to_owned()),
                blob_bytes: None,
            }],
        ));
        self
    }

    /// The intent [`crate::context::current_intent`] answers (a call with an effect).
    pub fn intent(mut self, id: &str, idempotency_key: &str, attempt: u32) -> Self {
        self.intent = Some(Intent {
            id: id.to_owned(),
            idempotency_key: idempotency_key.to_owned(),
            attempt,
        });
        self
    }

    /// Sets what [`crate::settings::get`] answers for `name` (over the mapping's).
    pub fn setting(mut self, name: &str, value: crate::settings::Value) -> Self {
        self.settings.insert(name.to_owned(), value);
        self
    }

    /// What [`crate::context::remaining_ms`] answers.
    pub fn remaining_ms(mut self, ms: u64) -> Self {
        self.remaining_ms = ms;
        self
    }

    /// Installs the kit on this thread until the returned guard is dropped.
    ///
    /// # Panics
    /// A kit is already installed on this thread.
    #[must_use = "the kit is uninstalled when the guard is dropped"]
    pub fn install(self) -> Installed {
        let record = Rc::new(RefCell::new(Record::default()));
        KIT.with(|kit| {
            let mut kit = kit.borrow_mut();
            assert!(
                kit.is_none(),
                "airlock_sdk::testing: a kit is already installed on this thread"
            );
            *kit = Some((self, record.clone()));
        });
        Installed { record }
    }
}

#[derive(Debug, Default)]
struct Record {
    calls: Vec<Call>,
    logs: Vec<(Level, String)>,
}

thread_local! {
    static KIT: RefCell<Option<(Upstream, Rc<RefCell<Record>>)>> = const { RefCell::new(None) };
}

/// An installed kit; dropping it uninstalls it.
#[derive(Debug)]
pub struct Installed {
    record: Rc<RefCell<Record>>,
}

impl Installed {
    /// Every upstream call so far (tools and resource reads), in order, including refused
    /// ones.
    pub fn calls(&self) -> Vec<Call> {
        self.record.borrow().calls.clone()
    }

    /// Every log message so far, in order.
    pub fn logs(&self) -> Vec<(Level, String)> {
        self.record.borrow().logs.clone()
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        KIT.with(|kit| kit.borrow_mut().take());
    }
}

/// Runs `f` with the installed kit, or panics naming `what`.
fn with_kit<T>(what: &str, f: impl FnOnce(&Upstream, &mut Record) -> T) -> T {
    KIT.with(|kit| {
        let kit = kit.borrow();
        let Some((upstream, record)) = kit.as_ref() else {
            panic!(
                "airlock_sdk: {what} was called outside the Airlock host with no test kit installed; \
                 install one first: `let kit = airlock_sdk::testing::Upstream::new().reply(..).install();`"
            )
        };
        f(upstream, &mut record.borrow_mut())
    })
}

pub(crate) fn call_tool(name: &str, arguments_json: &str) -> Result<ToolOutput, UpstreamError> {
    let what = format!("upstream::call_tool(`{name}`)");
    let reply = with_kit(&what, |kit, record| {
        let arguments = serde_json::from_str::<Value>(arguments_json).unwrap_or(Value::Null);
        record.calls.push(Call {
            tool: name.to_owned(),
            arguments: arguments.clone(),
        });
        // The host's order: the mapping's list, then the arguments, then the server.
        if kit
            .tools
            .as_ref()
            .is_some_and(|t| !t.iter().any(|t| t == name))
        {
            return Some(Reply::Error(UpstreamError::NotPermitted(format!(
                "upstream tool `{name}` is not listed in mapping `{}`; nothing was sent",
                kit.mapping
            ))));
        }
        if !arguments.is_object() {
            return Some(Reply::Error(UpstreamError::InvalidArguments(
                "arguments must be a JSON object".into(),
            )));
        }
        kit.replies
            .iter()
            .find(|(tool, args, _)| tool == name && args.as_ref() == Some(&arguments))
            .or_else(|| {
                kit.replies
                    .iter()
                    .find(|(tool, args, _)| tool == name && args.is_none())
            })
            .map(|(_, _, reply)| reply.clone())
    });
    match reply {
        Some(Reply::Output(output)) => Ok(output),
        Some(Reply::Error(error)) => Err(error),
        None => panic!(
            "airlock_sdk::testing: unexpected upstream call: tool `{name}` with arguments {arguments_json}; \
             register a reply (`.reply(\"{name}\", Reply::..)` or `.reply_to(\"{name}\", json!(..), Reply::..)`)"
        ),
    }
}

pub(crate) fn read_resource(uri: &str) -> Result<Vec<ResourceContents>, UpstreamError> {
    let what = format!("upstream::read_resource({uri:?})");
    let answer = with_kit(&what, |kit, record| {
        record.calls.push(Call {
            tool: uri.to_owned(),
            arguments: Value::Null,
        });
        if kit
            .resource_prefixes
            .as_ref()
            .is_some_and(|p| !p.iter().any(|p| uri.starts_with(p.as_str())))
        {
            return Some(Err(UpstreamError::NotPermitted(format!(
                "resource {uri:?} is outside the prefixes of mapping `{}`; nothing was sent",
                kit.mapping
            ))));
        }
        kit.resources
            .iter()
            .find(|(u, _)| u == uri)
            .map(|(_, contents)| Ok(contents.clone()))
    });
    answer.unwrap_or_else(|| {
        panic!(
            "airlock_sdk::testing: unexpected upstream read of resource {uri:?}; register it (`.resource({uri:?}, text, mime)`)"
        )
    })
}

pub(crate) fn log(level: Level, message: &str) {
    let installed = KIT.with(|kit| {
        kit.borrow().as_ref().map(|(_, record)| {
            record.borrow_mut().logs.push((level, message.to_owned()));
        })
    });
    if installed.is_none() {
        eprintln!("[adapter {level:?}] {message}");
    }
}

pub(crate) fn current_intent() -> Option<Intent> {
    with_kit("context::current_intent()", |kit, _| kit.intent.clone())
}

pub(crate) fn remaining_ms() -> u64 {
    with_kit("context::remaining_ms()", |kit, _| kit.remaining_ms)
}

pub(crate) fn setting(name: &str) -> Option<crate::settings::Value> {
    with_kit(&format!("settings::get({name:?})"), |kit, _| {
        kit.settings.get(name).cloned()
    })
}

pub(crate) fn setting_names() -> Vec<String> {
    with_kit("settings::names()", |kit, _| {
        kit.settings.keys().cloned().collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serde_json::json;
    use crate::source_retrieval::ContractError;
    use crate::upstream;

    const MAPPING: &str = r#"
[mapping]
name = "my-notes"
[upstream]
tools = ["search_notes"]
resources = ["notes://"]
"#;

    #[test]
    fn settings_come_from_the_mapping_and_the_kit() {
        use crate::settings::{self, Value};
        let text = format!(
            "{MAPPING}\n[settings]\nrepository = \"/srv/repo\"\nlimit = 20\nfollow = false\n"
        );
        let _kit = Upstream::from_mapping_text(&text)
            .unwrap()
            .setting("extra", Value::Text("x".into()))
            .install();
        assert_eq!(settings::text("repository").unwrap(), "/srv/repo");
        assert_eq!(settings::integer("limit").unwrap(), 20);
        assert!(!settings::boolean("follow").unwrap());
        assert_eq!(
            settings::names(),
            ["extra", "follow", "limit", "repository"]
        );
        let e = settings::integer("repository").unwrap_err();
        assert!(e.contains("is a string, not an integer"), "{e}");
        let e = settings::text("missing").unwrap_err();
        assert!(e.contains("add `missing = \"...\"`"), "{e}");
        assert!(settings::get("missing").is_none());
        let bad = format!("{MAPPING}\n[settings]\nratio = 0.5\n");
        let e = Upstream::from_mapping_text(&bad).unwrap_err();
        assert!(e.contains("ratio is a float"), "{e}");
    }

    #[test]
    fn replies_match_by_arguments_first_then_by_tool() {
        let kit = Upstream::new()
            .reply("search_notes", Reply::text("any"))
            .reply_to(
                "search_notes",
                json!({"query": "wal"}),
                Reply::structured(json!({"hits": []})),
            )
            .install();
        let exact = upstream::call_tool_json("search_notes", &json!({"query": "wal"})).unwrap();
        assert_eq!(exact.structured_json.as_deref(), Some(r#"{"hits":[]}"#));
        let other = upstream::call_tool_json("search_notes", &json!({"query": "x"})).unwrap();
        assert_eq!(other.first_text(), Some("any"));
        assert_eq!(kit.calls().len(), 2);
        assert_eq!(kit.calls()[1].arguments, json!({"query": "x"}));
    }

    #[test]
    fn the_mapping_limits_tools_and_resources_as_the_host_does() {
        let _kit = Upstream::from_mapping_text(MAPPING)
            .unwrap()
            .reply("read_note", Reply::text("never"))
            .resource("notes://a", "text", Some("text/markdown"))
            .install();
        let err = upstream::call_tool_json("read_note", &json!({})).unwrap_err();
        assert_eq!(
            err.describe(),
            "not-permitted: upstream tool `read_note` is not listed in mapping `my-notes`; nothing was sent"
        );
        // The same conversion as in the host: not-permitted is `unavailable`.
        assert!(matches!(
            ContractError::from(err),
            ContractError::Unavailable(_)
        ));
        assert!(upstream::read_resource("file:///etc/passwd").is_err());
        assert_eq!(
            upstream::read_resource("notes://a").unwrap()[0]
                .text
                .as_deref(),
            Some("text")
        );
    }

    #[test]
    fn mcp_results_convert_as_the_host_converts_them() {
        let Reply::Output(out) = Reply::mcp(json!({
            "content": [{"type": "text", "text": "t"}, {"type": "image", "data": "x"}],
            "structuredContent": {"a": 1},
            "isError": true
        })) else {
            panic!("an output")
        };
        assert!(out.is_error);
        assert_eq!(out.structured_json.as_deref(), Some(r#"{"a":1}"#));
        assert!(matches!(&out.content[1], ContentBlock::Other(kind) if kind == "image"));
    }

    #[test]
    #[should_panic(
        expected = "unexpected upstream call: tool `read_note` with arguments {\"id\":\"n1\"}"
    )]
    fn an_unexpected_call_fails_the_test_naming_tool_and_arguments() {
        let _kit = Upstream::new().install();
        let _ = upstream::call_tool_json("read_note", &json!({"id": "n1"}));
    }

    #[test]
    #[should_panic(expected = "no test kit installed")]
    fn a_call_without_a_kit_panics_rather_than_aborting() {
        let _ = upstream::call_tool("read_note", "{}");
    }

    #[test]
    fn context_and_logs_come_from_the_kit() {
        let kit = Upstream::new()
            .intent("int_1", "idk_1", 2)
            .remaining_ms(7)
            .install();
        let intent = crate::context::current_intent().unwrap();
        assert_eq!(
            (intent.idempotency_key.as_str(), intent.attempt),
            ("idk_1", 2)
        );
        assert_eq!(crate::context::remaining_ms(), 7);
        crate::log::info("hello");
        assert_eq!(kit.logs(), [(Level::Info, "hello".to_owned())]);
        drop(kit);
        // Uninstalled with the guard.
        assert!(std::panic::catch_unwind(crate::context::remaining_ms).is_err());
    }
}
