//! An OTLP/HTTP traces receiver for the spans tests: a loopback HTTP/1.1 server that takes
//! `POST /v1/traces` with a protobuf `ExportTraceServiceRequest` (the real message,
//! decoded with the OpenTelemetry protocol crate) and keeps every span it received.

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message as _;

/// `SPAN_KIND_INTERNAL`, `_SERVER`, `_CLIENT` (OTLP's `Span.SpanKind`).
pub const INTERNAL: i32 = 1;
pub const SERVER: i32 = 2;
pub const CLIENT: i32 = 3;

/// One received span: ids as lowercase hex (`parent` empty for a root), attributes as
/// text.
#[derive(Debug, Clone)]
pub struct Got {
    pub trace_id: String,
    pub span_id: String,
    pub parent: String,
    pub name: String,
    pub kind: i32,
    pub attributes: BTreeMap<String, String>,
    /// OTLP status code: 0 unset, 1 ok, 2 error.
    pub status: i32,
    pub start_ns: u64,
    pub end_ns: u64,
    /// The resource's `service.name`.
    pub service: String,
}

impl Got {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

/// The receiver; stops accepting when dropped (its thread ends with the process).
pub struct Receiver {
    pub addr: String,
    spans: Arc<Mutex<Vec<Got>>>,
    /// Requests that were not `POST /v1/traces` with `application/x-protobuf`.
    pub strays: Arc<Mutex<Vec<String>>>,
}

impl Receiver {
    pub fn start() -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let strays = Arc::new(Mutex::new(Vec::new()));
        let (kept, stray) = (spans.clone(), strays.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let (kept, stray) = (kept.clone(), stray.clone());
                std::thread::spawn(move || serve(stream, &kept, &stray));
            }
        });
        Self {
            addr,
            spans,
            strays,
        }
    }

    /// The collector base URL (`/v1/traces` is added by Airlock).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn spans(&self) -> Vec<Got> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits (up to 60 s) until `done` holds for the spans received, and returns them.
    pub fn until(&self, what: &str, done: impl Fn(&[Got]) -> bool) -> Vec<Got> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "the receiver never got {what}; it got:\n{spans:#?}\nstrays: {:?}",
                self.strays.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Serves one keep-alive connection: each request's body decoded, answered `200` with an
/// empty `ExportTraceServiceResponse`.
fn serve(stream: std::net::TcpStream, kept: &Mutex<Vec<Got>>, stray: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut out = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let request_line = line.trim().to_string();
        let mut length = 0usize;
        let mut content_type = String::new();
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                match k.trim().to_ascii_lowercase().as_str() {
                    "content-length" => length = v.trim().parse().unwrap_or(0),
                    "content-type" => content_type = v.trim().to_string(),
                    _ => {}
                }
            }
        }
        let mut body = vec![0u8; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        if request_line.starts_with("POST /v1/traces ") && content_type == "application/x-protobuf"
        {
            match ExportTraceServiceRequest::decode(body.as_slice()) {
                Ok(request) => kept.lock().unwrap().extend(flatten(request)),
                Err(e) => stray.lock().unwrap().push(format!("{request_line}: {e}")),
            }
        } else {
            stray
                .lock()
                .unwrap()
                .push(format!("{request_line} ({content_type})"));
        }
        let answer =
            "HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n";
        if out.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

fn flatten(request: ExportTraceServiceRequest) -> Vec<Got> {
    let mut out = Vec::new();
    for rs in request.resource_spans {
        let service = rs
            .resource
            .iter()
            .flat_map(|r| r.attributes.iter())
            .find(|kv| kv.key == "service.name")
            .map(|kv| text(kv.value.as_ref()))
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                out.push(Got {
                    trace_id: hex::encode(&s.trace_id),
                    span_id: hex::encode(&s.span_id),
                    parent: hex::encode(&s.parent_span_id),
                    name: s.name,
                    kind: s.kind,
                    attributes: s
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                        .collect(),
                    status: s.status.map(|st| st.code).unwrap_or(0),
                    start_ns: s.start_time_unix_nano,
                    end_ns: s.end_time_unix_nano,
                    service: service.clone(),
                });
            }
        }
    }
    out
}

fn text(value: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}
