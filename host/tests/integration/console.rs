//! The operator console (issue 31, first part: the approvals inbox) from outside: the real
//! `airlock console` beside a real `airlock serve`, over HTTP. A delivery waits for a
//! person; the console's one-time login, its cookie, its CSRF token and its origin checks
//! decide who may decide; the approved call then runs once (the delivery fixture's own
//! call log counts the sends), a denied one never does; hostile text is shown as text.

use std::io::BufRead as _;
use std::os::unix::process::CommandExt as _;

use serde_json::{Value, json};

use crate::approvals::{approval_in, deliver_args};
use crate::common::*;
use crate::http::{Reply, raw};
use airlock::pipeline::Category;

/// The console's session cookie.
const COOKIE_NAME: &str = "airlock_console";

/// A title no page may render as markup.
const HOSTILE: &str = "<script>alert(1)</script><img src=x onerror=alert(2)>";

/// A running `airlock console`, killed on drop.
struct Console {
    child: std::process::Child,
    addr: String,
    token: String,
}

impl Drop for Console {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Console {
    fn start(d: &Deployment) -> Self {
        Self::start_with(d, &[])
    }

    /// `airlock console` with `extra` arguments (e.g. `--config FILE`).
    fn start_with(d: &Deployment, extra: &[&str]) -> Self {
        let mut child = std::process::Command::new(airlock_bin())
            .args(["console", "--addr", "127.0.0.1:0"])
            .args(extra)
            .env("AIRLOCK_CACHE_DIR", test_cache_dir())
            .env("AIRLOCK_STATE_DIR", d.state_dir())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let url = loop {
            let line = lines
                .next()
                .expect("airlock console ended before printing its login link")
                .unwrap();
            if let Some(url) = line.strip_prefix("airlock: console at http://") {
                break url.to_string();
            }
        };
        std::thread::spawn(move || for _ in lines {});
        let (addr, rest) = url.split_once('/').unwrap();
        let token = rest
            .strip_prefix("console/login?token=")
            .unwrap_or_else(|| panic!("{url}"))
            .to_string();
        assert_eq!(token.len(), 64, "{url}");
        Self {
            child,
            addr: addr.to_string(),
            token,
        }
    }

    fn get(&self, path: &str, cookie: Option<&str>) -> Reply {
        let mut head = format!("GET {path} HTTP/1.1\r\nHost: {}", self.addr);
        if let Some(c) = cookie {
            head.push_str(&format!("\r\nCookie: {c}"));
        }
        raw(&self.addr, &head, b"")
    }

    /// POSTs `form` to `path` with `cookie` and `extra` header lines.
    fn post(&self, path: &str, cookie: &str, form: &[(&str, &str)], extra: &str) -> Reply {
        let body: String = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(form)
            .finish();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nCookie: {cookie}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}{extra}",
            self.addr,
            body.len()
        );
        raw(&self.addr, &head, body.as_bytes())
    }

    /// Logs in with the one-time token; returns the cookie (`name=value`).
    fn login(&self) -> String {
        let r = self.get(&format!("/console/login?token={}", self.token), None);
        assert_eq!(r.status, 303, "{r:?}");
        assert_eq!(r.header("location"), Some("/console/approvals"));
        let cookie = r
            .header("set-cookie")
            .expect("a session cookie")
            .to_string();
        for attribute in ["HttpOnly", "SameSite=Strict", "Path=/console"] {
            assert!(cookie.contains(attribute), "{cookie}");
        }
        cookie.split(';').next().unwrap().to_string()
    }
}

/// The CSRF token in an inbox page.
fn csrf_of(page: &str) -> String {
    let at = page
        .find("name=\"csrf\" value=\"")
        .unwrap_or_else(|| panic!("no CSRF field in {page}"))
        + "name=\"csrf\" value=\"".len();
    page[at..at + 64].to_string()
}

/// An artifact titled [`HOSTILE`] asked to be delivered to the team reports outbox on
/// `client`: the artifact, the destination and the approval request that waits.
async fn pending_delivery(
    client: &rmcp::service::RunningService<rmcp::service::RoleClient, ()>,
) -> (String, String, String) {
    let prepared = call(
        client,
        "prepare_artifact",
        json!({"title": HOSTILE, "media-type": "text/plain", "content": "quarterly\n"}),
    )
    .await
    .unwrap();
    assert_ne!(prepared.is_error, Some(true), "{}", text_of(&prepared));
    let artifact = prepared.structured_content.unwrap()["result"]["artifact"]
        .as_str()
        .unwrap()
        .to_string();
    let (_, team) = crate::approvals::prepared(client, "team-reports").await;
    let asked = call(client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    let id = approval_in(&assert_refused(&asked, Category::ApprovalRequired));
    (artifact, team, id)
}

fn state_of(d: &Deployment, id: &str) -> Value {
    d.airlock_json(&["approvals", "show", id])
}

#[tokio::test]
async fn the_inbox_approves_once_denies_and_refuses_what_is_not_this_sessions() {
    let d = approvals_deployment();
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;
    let (artifact, team, id) = pending_delivery(&client).await;

    let console = Console::start(&d);
    // Nothing without the login; a wrong token is refused and spends nothing.
    assert_eq!(console.get("/console/approvals", None).status, 401);
    assert_eq!(
        console
            .get("/console/approvals", Some("airlock_console=guess"))
            .status,
        401
    );
    assert_eq!(
        console
            .get(&format!("/console/login?token={}", "0".repeat(64)), None)
            .status,
        403
    );
    let cookie = console.login();
    // The token works once.
    assert_eq!(
        console
            .get(&format!("/console/login?token={}", console.token), None)
            .status,
        403
    );

    let inbox = console.get("/console/approvals", Some(&cookie));
    assert_eq!(inbox.status, 200, "{inbox:?}");
    assert!(
        !inbox.body.contains("http-equiv=\"refresh\""),
        "a page with something to decide never reloads under the person"
    );
    assert_eq!(
        inbox.header("content-security-policy"),
        Some(
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
        )
    );
    assert_eq!(inbox.header("x-content-type-options"), Some("nosniff"));
    assert_eq!(inbox.header("cache-control"), Some("no-store"));
    let page = &inbox.body;
    assert!(page.contains(&id), "{page}");
    assert!(page.contains("deliver_artifact"));
    assert!(
        page.contains("team-reports"),
        "the summary a person approves: {page}"
    );
    // The hostile title is text, never markup (the summary carries it defanged, and the
    // page escapes what is left: its quotes).
    assert!(!page.contains("<img"), "{page}");
    assert!(
        !page.contains("<script"),
        "the console sends no script: {page}"
    );
    assert!(page.contains("onerror=alert(2)"), "{page}");
    assert!(page.contains("title &quot;"), "{page}");
    let csrf = csrf_of(page);
    let decide = format!("/console/approvals/{id}");

    // The connections page: what the serving host last traced, what waits.
    assert_eq!(console.get("/console/connections", None).status, 401);
    let status = console.get("/console/connections", Some(&cookie));
    assert_eq!(status.status, 200, "{status:?}");
    for needle in [
        "<td>notes</td><td class=\"state\">ready</td>",
        "<td>outbox</td><td class=\"state\">ready</td>",
        "outbox-delivery",
        "1 approval(s) pending",
    ] {
        assert!(status.body.contains(needle), "{needle}: {}", status.body);
    }

    // Refused before anything is decided: no token, a wrong token, another origin, a
    // cross-site fetch, no session.
    let approve = [("csrf", csrf.as_str()), ("decision", "approve")];
    for (form, cookie, extra, status) in [
        (&[("decision", "approve")][..], cookie.as_str(), "", 403),
        (
            &[("csrf", &*"f".repeat(64)), ("decision", "approve")][..],
            cookie.as_str(),
            "",
            403,
        ),
        (
            &approve[..],
            cookie.as_str(),
            "\r\nOrigin: http://evil.example",
            403,
        ),
        (
            &approve[..],
            cookie.as_str(),
            "\r\nSec-Fetch-Site: cross-site",
            403,
        ),
        (&approve[..], "airlock_console=guess", "", 401),
    ] {
        let r = console.post(&decide, cookie, form, extra);
        assert_eq!(r.status, status, "{form:?} {extra:?}: {r:?}");
        assert_eq!(state_of(&d, &id)["state"], "pending");
    }
    assert_eq!(d.sends(), 0);
    // Hostile input at the boundary: an id that is markup, a form past the limit, an
    // unknown page, another method.
    let r = console.post(
        "/console/approvals/%3Cscript%3Ealert(1)%3C%2Fscript%3E",
        &cookie,
        &approve,
        "",
    );
    assert_eq!(r.status, 409, "{r:?}");
    assert!(!r.body.contains("<script"), "{}", r.body);
    let big = "x".repeat(20_000);
    let r = console.post(&decide, &cookie, &[("csrf", &csrf), ("reason", &big)], "");
    assert_eq!(r.status, 400, "{r:?}");
    assert!(r.body.contains("16384 bytes"), "{}", r.body);
    assert_eq!(console.get("/console/nothing", Some(&cookie)).status, 404);
    assert_eq!(console.get("/elsewhere", Some(&cookie)).status, 404);
    let put = raw(
        &console.addr,
        &format!(
            "PUT /console/approvals HTTP/1.1\r\nHost: {}\r\nContent-Length: 0",
            console.addr
        ),
        b"",
    );
    assert_eq!(put.status, 405, "{put:?}");
    assert_eq!(put.header("allow"), Some("GET, POST"));
    assert_eq!(state_of(&d, &id)["state"], "pending");

    // Approved in the console, from this origin: recorded with the console's person.
    let r = console.post(
        &decide,
        &cookie,
        &approve,
        &format!(
            "\r\nOrigin: http://{}\r\nSec-Fetch-Site: same-origin",
            console.addr
        ),
    );
    assert_eq!(r.status, 303, "{r:?}");
    let shown = state_of(&d, &id);
    assert_eq!(shown["state"], "approved", "{shown}");
    let by = shown["decided_by"].as_str().unwrap();
    assert!(by.ends_with(" (console)"), "{by}");
    // Deciding it again is refused, and says so.
    let again = console.post(&decide, &cookie, &approve, "");
    assert_eq!(again.status, 409, "{again:?}");

    // The repeated call runs once.
    let done = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    assert_ne!(done.is_error, Some(true), "{}", text_of(&done));
    assert_eq!(d.sends(), 1);
    let decided = d
        .trace()
        .into_iter()
        .find(|e| e["kind"] == "approval-decided" && e["payload"]["approval"] == id.as_str())
        .expect("the decision is traced");
    assert_eq!(decided["payload"]["by"], by);

    // A denial: nothing is sent, the next call asks anew.
    let (_, other) = crate::approvals::prepared(&client, "archive").await;
    let asked = call(&client, "deliver_artifact", deliver_args(&artifact, &other))
        .await
        .unwrap();
    let second = approval_in(&assert_refused(&asked, Category::ApprovalRequired));
    let inbox = console.get("/console/approvals", Some(&cookie));
    assert!(inbox.body.contains(&second));
    assert!(
        !inbox.body.contains(&id),
        "a decided approval leaves the inbox"
    );
    let r = console.post(
        &format!("/console/approvals/{second}"),
        &cookie,
        &[
            ("csrf", csrf_of(&inbox.body).as_str()),
            ("decision", "deny"),
            ("reason", "not for the archive"),
        ],
        "",
    );
    assert_eq!(r.status, 303, "{r:?}");
    assert_eq!(state_of(&d, &second)["state"], "denied");
    let after = call(&client, "deliver_artifact", deliver_args(&artifact, &other))
        .await
        .unwrap();
    assert_refused(&after, Category::ApprovalRequired);
    assert_eq!(d.sends(), 1, "a denied delivery is never sent");
    client.cancel().await.unwrap();
}

#[test]
fn the_console_binds_loopback_only() {
    let d = approvals_deployment();
    d.approve_all();
    let out = d.airlock(&["console", "--addr", "0.0.0.0:0"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("loopback"), "{err}");
}

/// Headless Chromium (Debian's `chromium`) driven over WebDriver by `chromedriver`
/// (Debian's `chromium-driver`; `.ci/run` installs both) on a free loopback port.
struct Browser {
    driver: std::process::Child,
    client: fantoccini::Client,
    _profile: tempfile::TempDir,
}

impl Browser {
    async fn start() -> Self {
        let port = free_port();
        // Its own process group, so that the browser it starts dies with it (Drop).
        let driver = std::process::Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .process_group(0)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("chromedriver (Debian package chromium-driver; .ci/run installs it)");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "chromedriver did not listen"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let profile = tempfile::tempdir().unwrap();
        // The flags this machine needs (its network is closed; it runs as root).
        let capabilities = json!({"goog:chromeOptions": {
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync",
                "--window-size=1200,900",
                format!("--user-data-dir={}", profile.path().display()),
            ],
        }});
        let client = fantoccini::ClientBuilder::new(
            hyper_util::client::legacy::connect::HttpConnector::new(),
        )
        .capabilities(capabilities.as_object().unwrap().clone())
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .expect("a Chromium session over WebDriver");
        Self {
            driver,
            client,
            _profile: profile,
        }
    }

    /// A screenshot of the page, written to `target/test-artifacts/NAME.png`; panics when
    /// it is blank (fewer than 8 colours).
    async fn screenshot(&self, name: &str) {
        let png_bytes = self.client.screenshot().await.unwrap();
        let dir = workspace().join("target/test-artifacts");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("{name}.png")), &png_bytes).unwrap();
        let mut reader = png::Decoder::new(std::io::Cursor::new(&png_bytes))
            .read_info()
            .unwrap();
        let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut pixels).unwrap();
        let step = info.color_type.samples();
        let colours: std::collections::BTreeSet<&[u8]> =
            pixels[..info.buffer_size()].chunks(step).collect();
        assert!(
            colours.len() >= 8,
            "screenshot {name} is blank ({} colours)",
            colours.len()
        );
    }

    async fn close(self) {
        let _ = self.client.clone().close().await;
    }
}

impl Drop for Browser {
    /// chromedriver and the browser it started, even when a test fails half-way.
    fn drop(&mut self) {
        // SAFETY: kill(2) on the process group the driver leads (process_group(0)).
        unsafe { libc::kill(-(self.driver.id() as i32), libc::SIGKILL) };
        let _ = self.driver.wait();
    }
}

/// A page on another origin (`localhost`, another port) that posts a decision to the
/// console as soon as it loads, with a valid CSRF token: what a malicious site would try.
fn hostile_site(action: &str, csrf: &str) -> String {
    let page = format!(
        "<!DOCTYPE html><form method=post action=\"{action}\"><input name=csrf value=\"{csrf}\"><input name=decision value=approve></form><script>document.forms[0].submit()</script>"
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { return };
            let mut buf = [0u8; 4096];
            let _ = std::io::Read::read(&mut s, &mut buf);
            let answer = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
                page.len()
            );
            let _ = std::io::Write::write_all(&mut s, answer.as_bytes());
        }
    });
    format!("http://localhost:{port}/")
}

#[tokio::test]
async fn a_person_approves_in_a_real_browser_and_another_site_cannot() {
    use fantoccini::Locator;
    let d = approvals_deployment();
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;
    let (artifact, team, id) = pending_delivery(&client).await;
    let console = Console::start(&d);
    let browser = Browser::start().await;
    let b = &browser.client;

    b.goto(&format!(
        "http://{}/console/login?token={}",
        console.addr, console.token
    ))
    .await
    .unwrap();
    assert!(
        b.current_url()
            .await
            .unwrap()
            .path()
            .ends_with("/console/approvals")
    );
    let heading = b
        .find(Locator::Css("h1"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(heading, "Pending approvals");
    let section = format!("section[id='{id}']");
    let summary = b
        .find(Locator::Css(&format!("{section} pre")))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        summary.contains("onerror=alert(2)"),
        "shown as text: {summary}"
    );
    assert!(summary.contains("team-reports"), "{summary}");
    assert!(b.get_alert_text().await.is_err(), "no dialog opened");
    browser.screenshot("console-inbox").await;

    // Another site posts the decision with a valid token: refused, nothing decided.
    let page = b.source().await.unwrap();
    let evil = hostile_site(
        &format!("http://{}/console/approvals/{id}", console.addr),
        &csrf_of(&page),
    );
    b.goto(&evil).await.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let url = b.current_url().await.unwrap();
        if url.path().starts_with("/console/approvals/") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the form never posted: {url}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let refused = b
        .find(Locator::Css("h1"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        ["Refused", "Log in first"].contains(&refused.as_str()),
        "{refused}"
    );
    assert_eq!(state_of(&d, &id)["state"], "pending");
    assert_eq!(d.sends(), 0);

    // The person approves with the button.
    b.goto(&format!("http://{}/console/approvals", console.addr))
        .await
        .unwrap();
    b.find(Locator::Css(&format!("{section} form button")))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let notice = match b.wait().for_element(Locator::Css("p.notice")).await {
        Ok(e) => e.text().await.unwrap(),
        Err(e) => panic!(
            "no notice after approving ({e}): at {} the page is\n{}",
            b.current_url().await.unwrap(),
            b.source().await.unwrap()
        ),
    };
    assert!(
        notice.contains(&id) && notice.contains("approved"),
        "{notice}"
    );
    browser.screenshot("console-decided").await;
    b.find(Locator::LinkText("Connections"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let heading = b
        .wait()
        .for_element(Locator::Css("h1"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(heading, "Connections");
    browser.screenshot("console-connections").await;
    let shown = state_of(&d, &id);
    assert_eq!(shown["state"], "approved");
    let done = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    assert_ne!(done.is_error, Some(true), "{}", text_of(&done));
    assert_eq!(d.sends(), 1, "the approved delivery runs once");
    let decided = d
        .trace()
        .into_iter()
        .find(|e| e["kind"] == "approval-decided" && e["payload"]["approval"] == id.as_str())
        .expect("the decision is traced");
    assert_eq!(decided["payload"]["by"], shown["decided_by"]);
    browser.close().await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_held_intent_is_resolved_once_with_evidence() {
    let d = crate::effects::edited(
        &["--fail-after-send"],
        crate::effects::narrowed("idempotent = false\nqueryable = false"),
    );
    let (client, r) = crate::effects::deliver(&d).await;
    assert_refused(&r, Category::Unknown);
    client.cancel().await.unwrap();
    let held = d.airlock_json(&["intents", "list", "--state", "unknown"]);
    let id = held[0]["id"].as_str().unwrap().to_string();

    let console = Console::start(&d);
    assert_eq!(console.get("/console/intents", None).status, 401);
    let cookie = console.login();
    let page = console.get("/console/intents", Some(&cookie));
    assert_eq!(page.status, 200, "{page:?}");
    assert!(page.body.contains(&id), "{}", page.body);
    assert!(page.body.contains("deliver_artifact"));
    assert!(
        page.body.contains("1 request(s) sent, 0 answered"),
        "{}",
        page.body
    );
    let csrf = csrf_of(&page.body);
    let resolve = format!("/console/intents/{id}");
    // No evidence, no token: nothing resolved.
    let r = console.post(
        &resolve,
        &cookie,
        &[("csrf", &csrf), ("as", "completed"), ("evidence", "  ")],
        "",
    );
    assert_eq!(r.status, 409, "{r:?}");
    assert!(r.body.contains("evidence is required"), "{}", r.body);
    let r = console.post(
        &resolve,
        &cookie,
        &[("as", "completed"), ("evidence", "seen")],
        "",
    );
    assert_eq!(r.status, 403);
    assert_eq!(
        d.airlock_json(&["intents", "list", "--state", "unknown"])
            .as_array()
            .unwrap()
            .len(),
        1
    );
    // Resolved once, with the evidence (shown escaped wherever it is shown again).
    let evidence = "the outbox holds it <b>twice</b>?";
    let r = console.post(
        &resolve,
        &cookie,
        &[("csrf", &csrf), ("as", "completed"), ("evidence", evidence)],
        "",
    );
    assert_eq!(r.status, 303, "{r:?}");
    let shown = d.airlock_json(&["intents", "show", &id]);
    assert_eq!(shown["intent"]["state"], "completed", "{shown}");
    assert_eq!(shown["intent"]["resolution"]["method"], "person");
    let by = shown["intent"]["resolution"]["by"].as_str().unwrap();
    assert!(by.ends_with(" (console)"), "{by}");
    assert_eq!(
        shown["intent"]["resolution"]["evidence"]["statement"],
        evidence
    );
    let again = console.post(
        &resolve,
        &cookie,
        &[
            ("csrf", &csrf),
            ("as", "failed"),
            ("evidence", "changed my mind"),
        ],
        "",
    );
    assert_eq!(again.status, 409, "resolved once: {again:?}");
    assert!(again.body.contains("is completed"), "{}", again.body);
    let after = console.get("/console/intents", Some(&cookie));
    assert!(
        after
            .body
            .contains("<meta http-equiv=\"refresh\" content=\"5\">"),
        "an empty page polls for what arrives: {}",
        after.body
    );
    assert!(
        !after.body.contains(&format!("id=\"{id}\"")),
        "no longer held"
    );
    let event = d
        .trace()
        .into_iter()
        .find(|e| e["kind"] == "intent-resolved")
        .expect("traced");
    assert_eq!(event["payload"]["by"], by);
}

/// `airlock demo --console`: a delivery waits; decided in the console, the demo's repeated
/// call delivers it once.
#[test]
fn the_console_demo_delivers_once_after_the_approval() {
    use std::sync::{Arc, Mutex};
    let state = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(airlock_bin())
        .args(["demo", "--console", "--addr", "127.0.0.1:0"])
        .env("AIRLOCK_CACHE_DIR", test_cache_dir())
        .env("HOME", state.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let collect = |pipe: Box<dyn std::io::Read + Send>| {
        let text = Arc::new(Mutex::new(String::new()));
        let kept = text.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(pipe).lines() {
                let Ok(line) = line else { return };
                kept.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        text
    };
    let out = collect(Box::new(child.stdout.take().unwrap()));
    let err = collect(Box::new(child.stderr.take().unwrap()));
    let until = |what: &str, text: &Arc<Mutex<String>>, needle: &str| -> String {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
        loop {
            let t = text.lock().unwrap().clone();
            if t.contains(needle) {
                return t;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no {what}:\n{t}\n{}",
                err.lock().unwrap()
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    let printed = until("login link", &err, "/console/login?token=");
    let url = printed
        .lines()
        .find_map(|l| l.strip_prefix("airlock: console at http://"))
        .unwrap()
        .to_string();
    let (addr, rest) = url.split_once('/').unwrap();
    let console = Console {
        child: std::process::Command::new("true").spawn().unwrap(),
        addr: addr.to_string(),
        token: rest.trim_start_matches("console/login?token=").to_string(),
    };
    let asked = until("pending approval", &out, "asked for approval apr_");
    let id = approval_in(&asked);
    let cookie = console.login();
    let inbox = console.get("/console/approvals", Some(&cookie));
    assert!(inbox.body.contains(&id), "{}", inbox.body);
    let r = console.post(
        &format!("/console/approvals/{id}"),
        &cookie,
        &[("csrf", &csrf_of(&inbox.body)), ("decision", "approve")],
        "",
    );
    assert_eq!(r.status, 303, "{r:?}");
    let done = until("the repeated call", &out, "send_file requests: 1");
    assert!(done.contains("is approved by"), "{done}");
    let _ = child.kill();
    let _ = child.wait();
}

/// More pending approvals than one page: the inbox shows the newest
/// [`airlock::console::PAGE`] and a link to the older ones, which lists the rest; no
/// approval is on both pages or on neither.
#[tokio::test]
async fn the_inbox_pages_through_more_than_one_page() {
    let d = approvals_deployment();
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;
    let (_, team) = crate::approvals::prepared(&client, "team-reports").await;
    let total = airlock::console::PAGE + 3;
    let mut asked = std::collections::BTreeSet::new();
    for n in 0..total {
        let prepared = call(
            &client,
            "prepare_artifact",
            json!({"title": format!("report {n}"), "media-type": "text/plain", "content": format!("{n}\n")}),
        )
        .await
        .unwrap();
        let artifact = prepared.structured_content.unwrap()["result"]["artifact"]
            .as_str()
            .unwrap()
            .to_string();
        let r = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
            .await
            .unwrap();
        asked.insert(approval_in(&assert_refused(&r, Category::ApprovalRequired)));
    }
    assert_eq!(asked.len(), total);
    let console = Console::start(&d);
    let cookie = console.login();
    let ids = |body: &str| -> Vec<String> {
        body.match_indices("<section class=\"approval\" id=\"")
            .map(|(at, m)| body[at + m.len()..at + m.len() + 28].to_string())
            .collect()
    };
    let first = console.get("/console/approvals", Some(&cookie));
    let first_ids = ids(&first.body);
    assert_eq!(first_ids.len(), airlock::console::PAGE);
    let at = first
        .body
        .find("/console/approvals?after=")
        .expect("a link to older requests");
    let link = &first.body[at..first.body[at..].find('"').unwrap() + at];
    let second = console.get(link, Some(&cookie));
    assert_eq!(second.status, 200, "{second:?}");
    let second_ids = ids(&second.body);
    assert_eq!(second_ids.len(), 3, "{}", second.body);
    assert!(
        !second.body.contains("?after="),
        "the last page links nowhere"
    );
    let seen: std::collections::BTreeSet<String> =
        first_ids.into_iter().chain(second_ids).collect();
    assert_eq!(seen, asked, "every pending approval on exactly one page");
    // A cursor that does not parse is the first page.
    let bad = console.get("/console/approvals?after=not-a-cursor", Some(&cookie));
    assert_eq!(ids(&bad.body).len(), airlock::console::PAGE);
    client.cancel().await.unwrap();
}

/// The console rules of `airlock.example.cedar`: approvers decide, nobody approves the call
/// they asked for.
const CONSOLE_POLICY: &str = r#"
@id("approvers-decide")
permit (
    principal in Airlock::Role::"approver",
    action in [
        Airlock::Action::"view",
        Airlock::Action::"approve",
        Airlock::Action::"resolve-intent"
    ],
    resource
);

@id("no-self-approval")
forbid (principal, action == Airlock::Action::"approve", resource)
when { resource.requester == principal && context.decision == "approve" };

@id("no-self-resolution")
forbid (principal, action == Airlock::Action::"resolve-intent", resource)
when { resource.requester == principal };

@id("reviewers-review")
permit (
    principal in Airlock::Role::"reviewer",
    action in [Airlock::Action::"view", Airlock::Action::"review", Airlock::Action::"retire"],
    resource
);
"#;

/// A bearer token for `sub` in `roles`, in the publisher profile.
fn person(sub: &str, roles: &[&str]) -> String {
    crate::http::token(sub, json!({"roles": roles, "airlock_profile": "publisher"}))
}

/// POSTs `form` to the console at `path` of `s` with `auth` header lines.
fn post_console(
    s: &crate::multi_host::Served,
    path: &str,
    form: &[(&str, &str)],
    auth: &str,
) -> Reply {
    let body: String = form_urlencoded::Serializer::new(String::new())
        .extend_pairs(form)
        .finish();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}{auth}",
        s.addr,
        body.len()
    );
    raw(&s.addr, &head, body.as_bytes())
}

fn get_console(s: &crate::multi_host::Served, path: &str, auth: &str) -> Reply {
    raw(
        &s.addr,
        &format!("GET {path} HTTP/1.1\r\nHost: {}{auth}", s.addr),
        b"",
    )
}

#[test]
fn under_serve_http_people_log_in_with_their_tokens_and_policy_decides_who_approves() {
    use crate::multi_host::{prepare_delivery_as, text_of_answer, tool_call};
    let d = Deployment::with_notes()
        .mapping("source-library")
        .with_outbox(&[])
        .policy(&format!("{POLICY}\n{CONSOLE_POLICY}"))
        .tables(PROFILES)
        .tables(&crate::http::auth_tables().replacen("[http]\n", "[http]\nconsole = true\n", 1));
    d.approve_all();
    let s = crate::multi_host::serve_http(&d, &d.state_dir());
    // The requester, alice, also holds the approver role.
    let alice = person("alice", &["operator", "approver"]);
    let args = prepare_delivery_as(&s, Some(&alice));
    let asked = tool_call(&s, Some(&alice), "deliver_artifact", args.clone());
    let text = text_of_answer(&asked);
    assert!(text.starts_with("approval required:"), "{asked}");
    let at = text.find("apr_").unwrap();
    let id = text[at..at + 28].to_owned();
    let decide = format!("/console/approvals/{id}");
    let approve = [("decision", "approve")];
    let bearer = |t: &str| format!("\r\nAuthorization: Bearer {t}");
    let pending = || assert_eq!(state_of(&d, &id)["state"], "pending");
    let log = s.log.lock().unwrap().clone();
    assert!(log.contains("(log in with a bearer token)"), "{log}");
    assert!(!log.contains("login?token="), "{log}");

    // Nobody gets in without a token: the inbox is the login form, the one-time link of a
    // loopback console does not exist here.
    let r = get_console(&s, "/console/approvals", "");
    assert_eq!(r.status, 401, "{r:?}");
    assert!(r.body.contains("name=\"token\""), "{}", r.body);
    assert!(!r.body.contains(&id));
    let r = get_console(&s, "/console/login?token=0000", "");
    assert!(r.header("set-cookie").is_none(), "{r:?}");
    // A token that does not verify logs nobody in, and its text is never echoed.
    for bad in [
        "not-a-token".to_string(),
        crate::http::token("carol", json!({"roles": ["approver"], "exp": 1})),
        crate::http::token("carol", json!({"roles": ["approver"], "scope": "other"})),
        crate::http::token(
            "carol",
            json!({"roles": ["approver"], "aud": "http://elsewhere/mcp"}),
        ),
    ] {
        let r = post_console(&s, "/console/login", &[("token", &bad)], "");
        assert!(matches!(r.status, 401 | 403), "{r:?}");
        assert!(r.header("set-cookie").is_none(), "{r:?}");
        assert!(!r.body.contains(&bad), "the token is echoed: {}", r.body);
        let r = post_console(&s, &decide, &approve, &bearer(&bad));
        assert!(matches!(r.status, 401 | 403), "{r:?}");
    }
    pending();

    // Separation of duties: alice asked for the delivery, so she may not approve it,
    // whatever her roles. Her inbox says so and offers no Approve button.
    let r = get_console(&s, "/console/approvals", &bearer(&alice));
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body.contains(&id), "{}", r.body);
    assert!(
        r.body
            .contains("You may not approve this: forbidden by policy no-self-approval"),
        "{}",
        r.body
    );
    assert!(!r.body.contains("value=\"approve\""), "{}", r.body);
    let r = post_console(&s, &decide, &approve, &bearer(&alice));
    assert_eq!(r.status, 403, "{r:?}");
    assert!(r.body.contains("no-self-approval"), "{}", r.body);
    pending();
    // Someone without the approver role may not either.
    let dave = person("dave", &["operator"]);
    let r = post_console(&s, &decide, &approve, &bearer(&dave));
    assert_eq!(r.status, 403, "{r:?}");
    assert!(r.body.contains("no policy permits it"), "{}", r.body);
    pending();
    assert_eq!(d.sends(), 0);

    // carol, an approver, logs in with her token in the form: a session cookie.
    let carol = person("carol", &["approver"]);
    let r = post_console(&s, "/console/login", &[("token", &carol)], "");
    assert_eq!(r.status, 303, "{r:?}");
    let cookie = r
        .header("set-cookie")
        .expect("a session cookie")
        .to_string();
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/console"] {
        assert!(cookie.contains(attribute), "{cookie}");
    }
    let cookie = format!("\r\nCookie: {}", cookie.split(';').next().unwrap());
    let inbox = get_console(&s, "/console/approvals", &cookie);
    assert_eq!(inbox.status, 200, "{inbox:?}");
    assert!(inbox.body.contains("carol (console)"), "{}", inbox.body);
    assert!(inbox.body.contains("value=\"approve\""), "{}", inbox.body);
    // Her session's form posts still need the CSRF token.
    let r = post_console(&s, &decide, &approve, &cookie);
    assert_eq!(r.status, 403, "{r:?}");
    pending();
    let csrf = csrf_of(&inbox.body);
    let r = post_console(
        &s,
        &decide,
        &[("csrf", &csrf), ("decision", "approve")],
        &cookie,
    );
    assert_eq!(r.status, 303, "{r:?}");
    let shown = state_of(&d, &id);
    assert_eq!(shown["state"], "approved", "{shown}");
    assert_eq!(shown["decided_by"], "carol (console)");
    let decided = d
        .trace()
        .into_iter()
        .find(|e| e["kind"] == "approval-decided" && e["payload"]["approval"] == id.as_str())
        .expect("the decision is traced");
    assert_eq!(decided["payload"]["by"], "carol (console)");

    // alice's repeated call delivers once.
    let done = tool_call(&s, Some(&alice), "deliver_artifact", args);
    assert_ne!(done["result"]["isError"], true, "{done}");
    assert_eq!(d.sends(), 1);
}

#[test]
fn under_serve_http_without_auth_the_console_prints_a_one_time_link() {
    let d = approvals_deployment()
        .top("default_profile = \"publisher\"\n")
        .tables("[http]\nconsole = true\n");
    d.approve_all();
    let s = crate::multi_host::serve_http(&d, &d.state_dir());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let link = loop {
        let log = s.log.lock().unwrap().clone();
        if let Some(at) = log.find("/console/login?token=") {
            break log[at..].lines().next().unwrap().to_string();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no login link in {log}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let r = get_console(&s, &link, "");
    assert_eq!(r.status, 303, "{r:?}");
    let cookie = r
        .header("set-cookie")
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let inbox = get_console(&s, "/console/approvals", &format!("\r\nCookie: {cookie}"));
    assert_eq!(inbox.status, 200, "{inbox:?}");
    assert!(inbox.body.contains(" (console)"), "{}", inbox.body);
    // In a serving host, connections show the negotiated protocol and this host's
    // restarts of each.
    let connections = get_console(&s, "/console/connections", &format!("\r\nCookie: {cookie}"));
    assert_eq!(connections.status, 200, "{connections:?}");
    let row = |name: &str| {
        let at = connections.body.find(&format!("<td>{name}</td>")).unwrap();
        let rest = &connections.body[at..];
        rest[..rest.find("</tr>").unwrap()].to_string()
    };
    for name in ["notes", "outbox"] {
        let r = row(name);
        assert!(
            r.contains("<td>2025-11-25</td>") || r.contains("<td>2026-07-28</td>"),
            "{r}"
        );
        assert!(r.ends_with("<td>0</td>"), "{r}");
    }
    // The link works once; a bearer token means nothing to a loopback console.
    assert_eq!(get_console(&s, &link, "").status, 403);
    let r = get_console(
        &s,
        "/console/approvals",
        &format!(
            "\r\nAuthorization: Bearer {}",
            person("carol", &["approver"])
        ),
    );
    assert_eq!(r.status, 401, "{r:?}");
    // Without `console = true` there is no console.
    let plain = approvals_deployment().top("default_profile = \"publisher\"\n");
    plain.approve_all();
    let s = crate::multi_host::serve_http(&plain, &plain.state_dir());
    assert_eq!(get_console(&s, "/console/approvals", "").status, 404);
}

/// The call id (`call_…`) of the first link to a call's page in `page`.
fn call_links(page: &str) -> Vec<String> {
    page.match_indices("/console/trace/calls/")
        .map(|(at, m)| {
            let rest = &page[at + m.len()..];
            rest[..rest.find('"').unwrap()].replace("&amp;", "&")
        })
        .collect()
}

#[tokio::test]
async fn the_trace_shows_each_calls_life_filters_and_verifies() {
    let d = approvals_deployment();
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;
    // The catalogue offered is part of the audit package.
    client.list_all_tools().await.unwrap();
    let (_, _, approval) = pending_delivery(&client).await;
    let found = call(&client, "search_sources", json!({"query": "q3"}))
        .await
        .unwrap();
    assert_ne!(found.is_error, Some(true), "{}", text_of(&found));
    // A name no catalogue offers, made of markup: shown as text.
    let hostile = call(&client, HOSTILE, json!({})).await;
    assert!(hostile.is_err() || hostile.unwrap().is_error == Some(true));

    let console = Console::start(&d);
    let cookie = console.login();
    let listed = console.get("/console/trace", Some(&cookie));
    assert_eq!(listed.status, 200, "{listed:?}");
    let body = &listed.body;
    for text in [
        "search_sources",
        "deliver_artifact",
        "approval-required",
        "completed",
        "alice",
    ] {
        assert!(body.contains(text), "{text} missing from {body}");
    }
    assert!(!body.contains("<script>alert"), "{body}");
    assert!(
        body.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{body}"
    );
    // Newest first: the search came after the delivery was asked for.
    assert!(body.find("search_sources").unwrap() < body.find("deliver_artifact").unwrap());

    // Filters compare whole values.
    let only = console.get("/console/trace?capability=search_sources", Some(&cookie));
    assert!(
        only.body.contains("search_sources") && !only.body.contains(">deliver_artifact<"),
        "{}",
        only.body
    );
    let waiting = console.get("/console/trace?outcome=approval-required", Some(&cookie));
    assert_eq!(call_links(&waiting.body).len(), 1, "{}", waiting.body);
    let nobody = console.get("/console/trace?requester=mallory", Some(&cookie));
    assert!(call_links(&nobody.body).is_empty());
    assert!(nobody.body.contains("No call here matches."));

    // One call's life: candidate, decision, the approval it asked for, its outcome.
    let link = &call_links(&waiting.body)[0];
    let life = console.get(&format!("/console/trace/calls/{link}"), Some(&cookie));
    assert_eq!(life.status, 200, "{life:?}");
    for kind in [
        "call-candidate",
        "call-decided",
        "approval-requested",
        "call-outcome",
    ] {
        assert!(
            life.body.contains(kind),
            "{kind} missing from {}",
            life.body
        );
    }
    assert!(life.body.contains(&approval), "{}", life.body);
    assert!(life.body.contains("pending"), "{}", life.body);
    assert!(
        !life.body.contains("upstream-request"),
        "the refused call sent nothing"
    );

    // The chain verifies; an edited event is named.
    let verified = console.get("/console/trace/verify", Some(&cookie));
    assert_eq!(verified.status, 200, "{verified:?}");
    assert!(
        verified.body.contains("The chain verifies"),
        "{}",
        verified.body
    );
    // The audit package: configuration and digests, never the key.
    let package = console.get("/console/trace/audit.json", Some(&cookie));
    assert_eq!(package.status, 200, "{package:?}");
    assert_eq!(package.header("content-type"), Some("application/json"));
    assert!(
        package
            .header("content-disposition")
            .unwrap()
            .starts_with("attachment;")
    );
    let p: Value = serde_json::from_str(&package.body).unwrap();
    assert_eq!(p["airlock_audit_package"], 1);
    assert_eq!(p["calls"]["approval-required"], 1, "{}", p["calls"]);
    assert!(
        p["calls"]["completed"].as_u64().unwrap() >= 2,
        "{}",
        p["calls"]
    );
    let kinds: Vec<&str> = p["configuration_events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    for kind in [
        "policy-loaded",
        "catalog-offered",
        "mapping-revision",
        "snapshot-taken",
    ] {
        assert!(kinds.contains(&kind), "{kind} missing from {kinds:?}");
    }
    let names: Vec<&str> = p["mappings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"source-library") && names.contains(&"outbox-delivery"),
        "{names:?}"
    );
    assert!(p["mappings"][0]["pins"].is_object() || p["mappings"][0]["pins"].is_array());
    let key = std::fs::read(d.state_dir().join("trace.key")).unwrap();
    for secret in [
        hex::encode(&key),
        String::from_utf8_lossy(&key).trim().to_string(),
    ] {
        assert!(
            !package.body.contains(&secret),
            "the trace key is in the package"
        );
    }
    assert!(!package.body.contains("manifest_text"));
    // Upstream tools appear as digests only: every description in it is a sha256.
    fn descriptions(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(o) => {
                for (k, v) in o {
                    if k == "description" {
                        out.push(v.to_string());
                    }
                    descriptions(v, out);
                }
            }
            Value::Array(a) => a.iter().for_each(|v| descriptions(v, out)),
            _ => {}
        }
    }
    let mut seen = Vec::new();
    descriptions(&p, &mut seen);
    assert!(!seen.is_empty());
    for d in seen {
        let d = d.trim_matches('"');
        assert!(
            d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit()),
            "{d}"
        );
    }

    // An event edited in the database is named.
    let db = d.database();
    db.execute_batch(
        "DROP TRIGGER trace_events_no_update; \
         UPDATE trace_events SET payload = replace(payload, 'alice', 'carol') WHERE kind = 'call-candidate';",
    )
    .unwrap();
    drop(db);
    let broken = console.get("/console/trace/verify", Some(&cookie));
    assert_eq!(broken.status, 200, "{broken:?}");
    assert!(broken.body.contains("Broken at event #"), "{}", broken.body);
    // Without the session, nothing.
    assert_eq!(console.get("/console/trace", None).status, 401);
    assert_eq!(console.get("/console/trace/verify", None).status, 401);
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_reviewer_sees_the_four_questions_and_drift_side_by_side_and_decides() {
    use fantoccini::Locator;
    let d = Deployment::with_notes().mapping("source-library");
    d.approve_all();
    // The server's read_note description changes to one carrying markup; discovery
    // records the new snapshot (the pinned one stays).
    let d = d.notes_args(&["--drift", "markup"]);
    let config = d.write_config();
    let config = config.to_str().unwrap();
    d.airlock_json(&["discover", "notes", "--config", config]);
    let console = Console::start_with(&d, &["--config", config]);
    // The person logs in with the browser; the test reads pages over HTTP with the same
    // session cookie too.
    let browser = Browser::start().await;
    let b = &browser.client;
    b.goto(&format!(
        "http://{}/console/login?token={}",
        console.addr, console.token
    ))
    .await
    .unwrap();
    let session = b.get_named_cookie(COOKIE_NAME).await.unwrap();
    let cookie = format!("{COOKIE_NAME}={}", session.value());

    let list = console.get("/console/mappings", Some(&cookie));
    assert_eq!(list.status, 200, "{list:?}");
    assert!(
        list.body.contains("/console/mappings/source-library"),
        "{}",
        list.body
    );

    let page = console.get("/console/mappings/source-library", Some(&cookie));
    assert_eq!(page.status, 200, "{page:?}");
    let body = &page.body;
    for text in [
        "1. What the server advertised",
        "2. What Airlock offers the model",
        "3. What fixtures established",
        "4. Who may use it",
        "Read one note from the read-only library", // the pinned description
        "search_sources",
        "read_note",
        "title or description changed",
        "Compare side by side",
        "No `airlock test` run is recorded",
    ] {
        assert!(body.contains(text), "{text} missing from {body}");
    }
    assert!(!body.contains("<script>alert"), "{body}");

    let drift = console.get("/console/mappings/source-library/drift", Some(&cookie));
    assert_eq!(drift.status, 200, "{drift:?}");
    assert!(!drift.body.contains("<script>alert"), "{}", drift.body);
    assert!(
        drift.body.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{}",
        drift.body
    );
    assert!(drift.body.contains("meaning-bearing"), "{}", drift.body);
    // A snapshot of another connection, or one that does not exist, is refused.
    let r = console.get(
        "/console/mappings/source-library/drift?to=ffff",
        Some(&cookie),
    );
    assert_eq!(r.status, 404, "{r:?}");

    // The grants review, its inline stylesheet allowed by hash and nothing else.
    let grants = console.get("/console/mappings/source-library/grants", Some(&cookie));
    assert_eq!(grants.status, 200, "{grants:?}");
    assert!(grants.body.contains("Adapter review"), "{}", grants.body);
    let csp = grants.header("content-security-policy").unwrap();
    assert!(
        csp.contains("style-src 'sha256-") && csp.contains("default-src 'none'"),
        "{csp}"
    );
    assert!(!csp.contains("unsafe-inline"), "{csp}");
    // The same page as `airlock grants --html` (one renderer).
    let manifest = workspace().join("target/airlock/adapters/source-library/mapping.toml");
    let cli = d.airlock(&[
        "grants",
        manifest.to_str().unwrap(),
        "--html",
        "--allow-flagged",
    ]);
    let cli = String::from_utf8_lossy(&cli.stdout).to_string();
    let title = |html: &str| html[..html.find("</h1>").unwrap()].to_string();
    assert_eq!(title(&grants.body), title(&cli));

    // In a real browser: the changed description is text, nothing runs.
    b.goto(&format!(
        "http://{}/console/mappings/source-library/drift",
        console.addr
    ))
    .await
    .unwrap();
    let after = b
        .find(Locator::Css("#tool-read_note td.after p"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        after.contains("<script>alert(1)</script><img src=x onerror=alert(2)>"),
        "{after}"
    );
    let before = b
        .find(Locator::Css("#tool-read_note td.before p"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        before.starts_with("Read one note from the read-only library"),
        "{before}"
    );
    assert!(
        b.find(Locator::Css("#tool-read_note td.after img"))
            .await
            .is_err(),
        "no element was made from the text"
    );
    assert!(b.get_alert_text().await.is_err(), "no dialog opened");
    browser.screenshot("console-drift").await;
    b.goto(&format!(
        "http://{}/console/mappings/source-library",
        console.addr
    ))
    .await
    .unwrap();
    browser.screenshot("console-mapping").await;
    browser.close().await;

    // The reviewer approves the new catalogue: a new revision, recorded with their name.
    let csrf = csrf_of(&page.body);
    let path = "/console/mappings/source-library";
    let r = console.post(path, &cookie, &[("action", "approve")], "");
    assert_eq!(r.status, 403, "no CSRF token: {r:?}");
    let before = d.airlock_json(&["review", "show", "source-library"]);
    let shown_revision = before["current"]["revision"].as_i64().unwrap().to_string();
    let latest = before["latest_snapshot"].as_str().unwrap().to_string();
    // The approval names the snapshot and revision the page showed: another is refused
    // (a server that changed its tools after the page loaded is not approved by it).
    for (revision, snapshot) in [
        (shown_revision.as_str(), "0".repeat(64)),
        ("0", latest.clone()),
        (shown_revision.as_str(), String::new()),
    ] {
        let r = console.post(
            path,
            &cookie,
            &[
                ("csrf", &csrf),
                ("action", "approve"),
                ("revision", revision),
                ("snapshot", &snapshot),
            ],
            "",
        );
        assert_eq!(r.status, 409, "{r:?}");
    }
    assert_eq!(
        d.airlock_json(&["review", "show", "source-library"])["current"]["revision"],
        before["current"]["revision"]
    );
    assert!(
        page.body
            .contains(&format!("name=\"snapshot\" value=\"{latest}\"")),
        "{}",
        page.body
    );
    let r = console.post(
        path,
        &cookie,
        &[
            ("csrf", &csrf),
            ("action", "approve"),
            ("revision", &shown_revision),
            ("snapshot", &latest),
        ],
        "",
    );
    assert_eq!(r.status, 303, "{r:?}");
    let after = d.airlock_json(&["review", "show", "source-library"]);
    assert_eq!(
        after["current"]["revision"].as_i64().unwrap(),
        before["current"]["revision"].as_i64().unwrap() + 1
    );
    assert_eq!(after["current"]["state"], "active");
    assert!(
        after["current"]["reviewer"]
            .as_str()
            .unwrap()
            .ends_with(" (console)"),
        "{after}"
    );
    let page = console.get(path, Some(&cookie));
    assert!(
        !page.body.contains("Compare side by side"),
        "the pins are the latest snapshot now"
    );
    // And retires it (it serves no new calls; `retiring` until calls in flight end).
    let revision = after["current"]["revision"].as_i64().unwrap().to_string();
    let r = console.post(
        path,
        &cookie,
        &[
            ("csrf", &csrf),
            ("action", "retire"),
            ("revision", &revision),
        ],
        "",
    );
    assert_eq!(r.status, 303, "{r:?}");
    assert_eq!(
        d.airlock_json(&["review", "show", "source-library"])["current"]["state"],
        "retiring"
    );
}

/// `[http.auth]` with `console = true`.
fn console_auth_tables() -> String {
    crate::http::auth_tables().replacen("[http]\n", "[http]\nconsole = true\n", 1)
}

/// A console of people over a fresh approvals deployment.
fn people_console() -> (Deployment, crate::multi_host::Served) {
    let d = Deployment::with_notes()
        .mapping("source-library")
        .with_outbox(&[])
        .policy(&format!("{POLICY}\n{CONSOLE_POLICY}"))
        .tables(PROFILES)
        .tables(&console_auth_tables());
    d.approve_all();
    let s = crate::multi_host::serve_http(&d, &d.state_dir());
    (d, s)
}

#[tokio::test]
async fn under_serve_http_policy_decides_who_resolves_a_held_intent() {
    let d = crate::effects::edited(
        &["--fail-after-send"],
        crate::effects::narrowed("idempotent = false\nqueryable = false"),
    )
    .tables(&console_auth_tables());
    let (client, r) = crate::effects::deliver(&d).await;
    assert_refused(&r, Category::Unknown);
    client.cancel().await.unwrap();
    let held = d.airlock_json(&["intents", "list", "--state", "unknown"]);
    let id = held[0]["id"].as_str().unwrap().to_string();
    // carol may resolve, but never as `failed` (a failed external effect may be retried).
    d.rewrite_policy(&format!(
        "{POLICY}\n{CONSOLE_POLICY}\n@id(\"carol-never-fails-an-intent\")\nforbid (principal == Airlock::Requester::\"carol\", action == Airlock::Action::\"resolve-intent\", resource) when {{ context.outcome == \"failed\" }};\n"
    ));
    let s = crate::multi_host::serve_http(&d, &d.state_dir());
    let bearer = |t: &str| format!("\r\nAuthorization: Bearer {t}");
    let resolve = format!("/console/intents/{id}");
    let still_held = || {
        let shown = d.airlock_json(&["intents", "show", &id]);
        assert_eq!(shown["intent"]["state"], "unknown", "{shown}");
    };
    // dave may not even view the console; alice asked for the delivery, so she may not
    // settle it, whatever her roles.
    let dave = person("dave", &["operator"]);
    let completed = [("as", "completed"), ("evidence", "seen it")];
    let r = post_console(&s, &resolve, &completed, &bearer(&dave));
    assert_eq!(r.status, 403, "{r:?}");
    assert!(r.body.contains("no policy permits it"), "{}", r.body);
    still_held();
    let alice = person("alice", &["operator", "approver"]);
    let r = post_console(&s, &resolve, &completed, &bearer(&alice));
    assert_eq!(r.status, 403, "{r:?}");
    assert!(r.body.contains("no-self-resolution"), "{}", r.body);
    still_held();
    let carol = person("carol", &["approver"]);
    let r = post_console(
        &s,
        &resolve,
        &[("as", "failed"), ("evidence", "not there")],
        &bearer(&carol),
    );
    assert_eq!(r.status, 403, "{r:?}");
    assert!(r.body.contains("carol-never-fails-an-intent"), "{}", r.body);
    still_held();
    let r = post_console(&s, &resolve, &completed, &bearer(&carol));
    assert_eq!(r.status, 303, "{r:?}");
    let shown = d.airlock_json(&["intents", "show", &id]);
    assert_eq!(shown["intent"]["state"], "completed", "{shown}");
    assert_eq!(shown["intent"]["resolution"]["by"], "carol (console)");
}

#[test]
fn under_serve_http_a_login_session_ends_when_its_token_expires() {
    let (_d, s) = people_console();
    let exp = jsonwebtoken::get_current_timestamp() + 3;
    let token = crate::http::token(
        "carol",
        json!({"roles": ["approver"], "airlock_profile": "publisher", "exp": exp}),
    );
    let r = post_console(&s, "/console/login", &[("token", &token)], "");
    assert_eq!(r.status, 303, "{r:?}");
    let cookie = format!(
        "\r\nCookie: {}",
        r.header("set-cookie").unwrap().split(';').next().unwrap()
    );
    assert_eq!(get_console(&s, "/console/approvals", &cookie).status, 200);
    while jsonwebtoken::get_current_timestamp() <= exp {
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    let r = get_console(&s, "/console/approvals", &cookie);
    assert_eq!(r.status, 401, "the session outlived its token: {r:?}");
    assert!(r.body.contains("name=\"token\""), "{}", r.body);
    assert_eq!(
        r.header("www-authenticate"),
        Some("Bearer realm=\"airlock-console\"")
    );
}

#[test]
fn under_serve_http_another_site_cannot_log_a_browser_in() {
    let (_d, s) = people_console();
    let carol = person("carol", &["approver"]);
    // `http://localhost:1` passes the HTTP front's default origins (any loopback port):
    // only the console's own check refuses it.
    for extra in [
        "\r\nSec-Fetch-Site: cross-site",
        "\r\nSec-Fetch-Site: same-site",
        "\r\nOrigin: http://localhost:1",
    ] {
        let r = post_console(&s, "/console/login", &[("token", &carol)], extra);
        assert_eq!(r.status, 403, "{extra}: {r:?}");
        assert!(r.header("set-cookie").is_none(), "{extra}: {r:?}");
    }
    let own = format!(
        "\r\nOrigin: http://{}\r\nSec-Fetch-Site: same-origin",
        s.addr
    );
    let r = post_console(&s, "/console/login", &[("token", &carol)], &own);
    assert_eq!(r.status, 303, "{r:?}");
}

#[test]
fn under_serve_http_the_console_keeps_the_fronts_host_check() {
    let (_d, s) = people_console();
    let carol = person("carol", &["approver"]);
    let r = raw(
        &s.addr,
        &format!(
            "GET /console/approvals HTTP/1.1\r\nHost: rebound.example\r\nAuthorization: Bearer {carol}"
        ),
        b"",
    );
    assert_eq!(r.status, 403, "{r:?}");
    assert!(!r.body.contains("Pending approvals"), "{}", r.body);
}

#[test]
fn under_serve_http_only_people_policy_lets_view_log_in_and_each_holds_few_sessions() {
    let (_d, s) = people_console();
    // A valid token whose person policy does not let view the console (an agent's token,
    // say): no login, no page.
    let agent = person("agent-7", &[]);
    let r = post_console(&s, "/console/login", &[("token", &agent)], "");
    assert_eq!(r.status, 403, "{r:?}");
    assert!(r.header("set-cookie").is_none(), "{r:?}");
    assert!(r.body.contains("may not view the console"), "{}", r.body);
    let r = get_console(
        &s,
        "/console/approvals",
        &format!("\r\nAuthorization: Bearer {agent}"),
    );
    assert_eq!(r.status, 403, "{r:?}");
    assert!(!r.body.contains("Pending approvals"), "{}", r.body);
    // One person holds at most MAX_SESSIONS_PER_PERSON sessions: one more ends the oldest.
    let carol = person("carol", &["approver"]);
    let mut cookies = Vec::new();
    for _ in 0..=airlock::console::MAX_SESSIONS_PER_PERSON {
        let r = post_console(&s, "/console/login", &[("token", &carol)], "");
        assert_eq!(r.status, 303, "{r:?}");
        let c = r.header("set-cookie").unwrap();
        assert!(!c.contains("Secure"), "an http:// audience: {c}");
        cookies.push(format!("\r\nCookie: {}", c.split(';').next().unwrap()));
    }
    assert_eq!(
        get_console(&s, "/console/approvals", &cookies[0]).status,
        401
    );
    for c in &cookies[1..] {
        assert_eq!(get_console(&s, "/console/approvals", c).status, 200);
    }
}

#[test]
fn under_serve_http_the_mapping_page_asks_the_hosts_policy_and_only_reviewers_decide() {
    let (d, s) = people_console();
    let bearer = |t: &str| format!("\r\nAuthorization: Bearer {t}");
    let rita = person("rita", &["reviewer"]);
    let carol = person("carol", &["approver"]);
    let path = "/console/mappings/outbox-delivery";
    // What policy answers alice (an operator) and bob (no role), capability by profile.
    let page = get_console(
        &s,
        &format!("{path}?requester=alice&roles=operator"),
        &bearer(&rita),
    );
    assert_eq!(page.status, 200, "{page:?}");
    let row = |body: &str, cap: &str, profile: &str| -> String {
        let at = body
            .find(&format!("<tr><td>{cap}</td><td>{profile}</td><td>"))
            .unwrap_or_else(|| panic!("no row {cap}/{profile} in {body}"));
        let rest = &body[at..];
        rest[..rest.find("</tr>").unwrap()].to_string()
    };
    assert!(
        row(&page.body, "deliver_artifact", "publisher").contains("require-approval"),
        "{}",
        page.body
    );
    assert!(
        row(&page.body, "deliver_artifact", "publisher")
            .contains("publisher-delivers-with-approval")
    );
    assert!(row(&page.body, "prepare_artifact", "publisher").contains(">allow<"));
    assert!(row(&page.body, "deliver_artifact", "reader").contains("not in this profile"));
    let bob = get_console(&s, &format!("{path}?requester=bob"), &bearer(&rita));
    assert!(
        row(&bob.body, "deliver_artifact", "publisher")
            .contains("deny (capability unavailable for this task)"),
        "{}",
        bob.body
    );
    // The serving host knows what the model is offered: reviewed description, schema.
    assert!(page.body.contains("input schema"), "{}", page.body);
    assert!(!page.body.contains("Policy is known to a serving host"));
    // Whatever is typed is shown as text.
    let typed = get_console(
        &s,
        &format!("{path}?requester=%3Cb%3Emallory%3C%2Fb%3E"),
        &bearer(&rita),
    );
    assert_eq!(typed.status, 200, "{typed:?}");
    assert!(
        typed.body.contains("&lt;b&gt;mallory&lt;/b&gt;") && !typed.body.contains("<b>mallory")
    );

    // carol approves calls, not mappings: no buttons, and a post is refused.
    let seen = get_console(&s, path, &bearer(&carol));
    assert!(
        seen.body
            .contains("You may not approve this mapping: no policy permits it"),
        "{}",
        seen.body
    );
    assert!(
        seen.body
            .contains("You may not retire this mapping: no policy permits it"),
        "{}",
        seen.body
    );
    let revision = d.airlock_json(&["review", "show", "outbox-delivery"])["current"]["revision"]
        .as_i64()
        .unwrap()
        .to_string();
    let retire = [("action", "retire"), ("revision", revision.as_str())];
    let r = post_console(&s, path, &retire, &bearer(&carol));
    assert_eq!(r.status, 403, "{r:?}");
    let state =
        || d.airlock_json(&["review", "show", "outbox-delivery"])["current"]["state"].clone();
    assert_eq!(state(), "active");
    // rita, a reviewer, retires it, recorded with her name.
    let r = post_console(&s, path, &retire, &bearer(&rita));
    assert_eq!(r.status, 303, "{r:?}");
    assert_eq!(state(), "retiring");
    let shown = d.airlock_json(&["review", "show", "outbox-delivery"]);
    assert!(
        shown["current"]["reason"]
            .as_str()
            .unwrap()
            .contains("rita (console)"),
        "{shown}"
    );
}

/// The inbox counts the trace's missing events once per page (not once per row): a gap
/// after the older request's proof must still mark that row, and only rows whose trace
/// after their request is not whole.
#[tokio::test]
async fn the_inbox_marks_a_request_whose_trace_lost_an_event_after_it() {
    let d = approvals_deployment();
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;
    let (_, _, older) = pending_delivery(&client).await;
    let gap = d
        .trace()
        .into_iter()
        .rev()
        .find(|e| e["kind"] == "call-outcome")
        .unwrap()["seq"]
        .as_i64()
        .unwrap();
    let (_, _, newer) = pending_delivery(&client).await;
    client.cancel().await.unwrap();
    let console = Console::start(&d);
    let cookie = console.login();
    let inbox = console.get("/console/approvals", Some(&cookie));
    assert!(!inbox.body.contains("Tampered"), "{}", inbox.body);
    // Whoever can write the database deletes one event between the two requests.
    let db = d.database();
    db.execute_batch("DROP TRIGGER trace_events_no_delete;")
        .unwrap();
    assert_eq!(
        db.execute("DELETE FROM trace_events WHERE seq = ?1", [gap])
            .unwrap(),
        1
    );
    drop(db);
    let inbox = console.get("/console/approvals", Some(&cookie));
    let section = |id: &str| {
        let at = inbox.body.find(&format!("id=\"{id}\"")).unwrap();
        let rest = &inbox.body[at..];
        rest[..rest.find("</section>").unwrap()].to_string()
    };
    assert!(section(&older).contains("Tampered"), "{}", section(&older));
    assert!(
        section(&older).contains("are missing"),
        "{}",
        section(&older)
    );
    assert!(!section(&older).contains("value=\"approve\""));
    assert!(!section(&newer).contains("Tampered"), "{}", section(&newer));
    assert!(section(&newer).contains("value=\"approve\""));
}

#[tokio::test]
async fn an_approved_receipt_not_used_yet_is_revoked_from_the_inbox() {
    let d = approvals_deployment();
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;
    let (artifact, team, id) = pending_delivery(&client).await;
    let console = Console::start(&d);
    let cookie = console.login();
    let inbox = console.get("/console/approvals", Some(&cookie));
    let csrf = csrf_of(&inbox.body);
    let decide = format!("/console/approvals/{id}");
    let r = console.post(
        &decide,
        &cookie,
        &[("csrf", &csrf), ("decision", "approve")],
        "",
    );
    assert_eq!(r.status, 303, "{r:?}");
    // The receipt waits unused: the inbox offers to revoke it.
    let inbox = console.get("/console/approvals", Some(&cookie));
    assert!(
        inbox.body.contains("Approved, not used yet"),
        "{}",
        inbox.body
    );
    assert!(
        inbox.body.contains(&format!("id=\"approved-{id}\"")),
        "{}",
        inbox.body
    );
    assert!(inbox.body.contains("value=\"revoke\""), "{}", inbox.body);
    assert!(
        !inbox.body.contains("http-equiv=\"refresh\""),
        "a page with rows never reloads"
    );
    let r = console.post(
        &decide,
        &cookie,
        &[("csrf", &csrf), ("decision", "revoke")],
        "",
    );
    assert_eq!(r.status, 303, "{r:?}");
    assert_eq!(state_of(&d, &id)["state"], "revoked");
    // Revoked: the call asks anew and nothing is sent.
    let again = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    assert_refused(&again, Category::ApprovalRequired);
    assert_eq!(d.sends(), 0);
    let inbox = console.get("/console/approvals", Some(&cookie));
    assert!(
        !inbox.body.contains(&format!("id=\"approved-{id}\"")),
        "{}",
        inbox.body
    );
    client.cancel().await.unwrap();
}
