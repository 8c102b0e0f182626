//! Trace retention (issue 37, item 2): a serving host under `[trace] retain` seals old
//! events into segment files and deletes them from the store, keeping what is still needed
//! (the mapping's proofs: it is served again after a restart); `trace verify` still proves
//! the chain after the archive and `trace verify --archive DIR` checks the segments, which
//! find a removed or edited segment; `trace archive` and `trace export` from the command
//! line.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::common::Deployment;

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

async fn searched<H: rmcp::ClientHandler>(
    client: &rmcp::service::RunningService<rmcp::RoleClient, H>,
    n: usize,
) {
    crate::common::searched(client, "wal", n).await;
}

fn verify_archive(d: &Deployment, dir: &Path) -> std::process::Output {
    d.airlock(&[
        "trace",
        "verify",
        "--json",
        "--archive",
        dir.to_str().unwrap(),
    ])
}

#[tokio::test]
async fn a_serving_host_archives_old_events_and_the_chain_and_segments_still_verify() {
    let d = Deployment::with_notes()
        .mapping("source-library")
        .tables("[trace]\nretain = \"1s\"\n");
    let archive = d.state_dir().join("trace-archive");
    let client = d.serve().await;
    searched(&client, 10).await;
    // Passes run every second; wait until one sealed the first calls.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while segments(&archive).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "no segment was written"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    searched(&client, 5).await;
    client.cancel().await.ok();

    let v = d.airlock_json(&["trace", "verify"]);
    assert_eq!(v["first_bad"], Value::Null, "{v}");
    let archived_to = v["archived_to"].as_i64().expect("events were archived");
    assert!(archived_to > 0);
    let db = d.database();
    let (below, kept): (i64, i64) = db
        .query_row(
            "SELECT (SELECT count(*) FROM trace_events WHERE seq <= ?1), \
             (SELECT json_array_length(payload, '$.kept') FROM trace_events \
              WHERE kind = 'trace-archived' ORDER BY seq DESC LIMIT 1)",
            [archived_to],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(
        below, kept,
        "up to the archive, the store holds only what it kept"
    );
    assert!(
        kept >= 1 && kept < archived_to / 2,
        "the mapping's proofs, not the calls: {kept}"
    );

    let out = verify_archive(&d, &archive);
    assert!(out.status.success(), "{out:?}");
    let both: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(both["archive"]["first_bad"], Value::Null, "{both}");
    assert!(both["archive"]["through_seq"].as_i64().unwrap() >= archived_to);

    // What still serves stays proven: a new host serves the mapping again.
    let client = d.serve().await;
    searched(&client, 1).await;
    client.cancel().await.ok();

    // A segment removed or edited is found, and exits 3.
    let files = segments(&archive);
    let first = files[0].clone();
    let bytes = std::fs::read(&first).unwrap();
    let edited =
        String::from_utf8(bytes.clone())
            .unwrap()
            .replacen("\"subject\":\"", "\"subject\":\"x", 1);
    std::fs::write(&first, edited).unwrap();
    let out = verify_archive(&d, &archive);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    std::fs::remove_file(&first).unwrap();
    let out = verify_archive(&d, &archive);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    let why = shown["archive"]["first_bad"][1].as_str().unwrap();
    assert!(why.contains("is missing from"), "{why}");
    std::fs::write(&first, bytes).unwrap();
    assert!(verify_archive(&d, &archive).status.success());
}

#[tokio::test]
async fn trace_archive_and_export_from_the_command_line() {
    let d = Deployment::with_notes().mapping("source-library");
    let client = d.serve().await;
    searched(&client, 5).await;
    client.cancel().await.ok();

    let out = d.airlock(&["trace", "archive"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "an age or a count is required: {out:?}"
    );
    let out = d.airlock(&["trace", "archive", "--older-than", "soon"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--older-than `soon`"));

    let head = d.airlock_json(&["trace", "verify"])["events"]
        .as_i64()
        .unwrap();
    let out = d.airlock(&["trace", "archive", "--keep-events", "3"]);
    assert!(out.status.success(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("sealed into trace-000000000001-"), "{said}");
    let archive = d.state_dir().join("trace-archive");
    assert_eq!(segments(&archive).len(), 1);
    let v = d.airlock_json(&["trace", "verify"]);
    assert_eq!(v["archived_to"], head - 3, "{v}");

    // Export the rest; with the segments beside it, the copy verifies from event 1.
    let copy = d.dir.path().join("copy");
    let out = d.airlock(&["trace", "export", "--out", copy.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{out:?}");
    let exported: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(exported["from_seq"], head - 2);
    for f in segments(&archive) {
        std::fs::copy(&f, copy.join(f.file_name().unwrap())).unwrap();
    }
    let out = verify_archive(&d, &copy);
    assert!(out.status.success(), "{out:?}");
    // Exporting again does not replace the file.
    let again = d.airlock(&["trace", "export", "--out", copy.to_str().unwrap()]);
    assert!(!again.status.success());

    // Nothing old enough: said so, nothing written.
    let out = d.airlock(&["trace", "archive", "--older-than", "1h"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing to archive"));
    assert_eq!(segments(&archive).len(), 1);
}
