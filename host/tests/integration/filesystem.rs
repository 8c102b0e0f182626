//! `airlock serve` with the published reference filesystem MCP server
//! (@modelcontextprotocol/server-filesystem) through the `fs-documents` adapter.

use crate::common::*;
use serde_json::json;

fn deployment() -> Deployment {
    let server = node_modules().join("@modelcontextprotocol/server-filesystem/dist/index.js");
    let documents = workspace().join("fixtures/documents");
    Deployment::with_notes()
        .connection(&format!(
            "[[connection]]\nname = \"documents\"\ncommand = \"node\"\nargs = [{:?}, {:?}]\n{}",
            server.display().to_string(),
            documents.display().to_string(),
            confined(&[(&documents, "read-only")])
        ))
        .mapping("fs-documents")
}

/// Every string the model could see in a result: text content and structured content.
fn visible(result: &rmcp::model::CallToolResult) -> String {
    format!(
        "{}\n{}",
        text_of(result),
        result.structured_content.clone().unwrap_or_default()
    )
}

fn assert_no_paths(seen: &str) {
    let documents = workspace().join("fixtures/documents");
    for leak in [
        documents.display().to_string(),
        "fixtures/documents".to_string(),
        workspace().display().to_string(),
    ] {
        assert!(
            !seen.contains(&leak),
            "a path ({leak}) reached the model:\n{seen}"
        );
    }
}

#[tokio::test]
async fn search_and_retrieve_documents_without_ever_showing_a_path() {
    let d = deployment();
    let client = d.serve().await;
    let tools = client.peer().list_all_tools().await.unwrap();
    let names: Vec<_> = tools.iter().map(|t| t.name.to_string()).collect();
    assert_eq!(names, ["retrieve_document", "search_documents"]);
    let listing = serde_json::to_string(&tools).unwrap();
    for upstream_only in ["read_text_file", "search_files", "write_file", "path"] {
        assert!(
            !listing.contains(upstream_only),
            "`{upstream_only}` leaked into tools/list"
        );
    }

    let hits = call(&client, "search_documents", json!({"query": "retention"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    assert_no_paths(&visible(&hits));
    let refs = references(&hits);
    assert!(!refs.is_empty(), "{}", visible(&hits));

    let doc = call(&client, "retrieve_document", json!({"reference": refs[0]}))
        .await
        .unwrap();
    assert_ne!(doc.is_error, Some(true), "{}", text_of(&doc));
    let seen = visible(&doc);
    assert_no_paths(&seen);
    let s = doc.structured_content.as_ref().unwrap();
    assert!(
        s["result"]["text"]
            .as_str()
            .unwrap()
            .to_lowercase()
            .contains("retention")
    );
    assert_eq!(
        s["provenance"].as_array().unwrap().last().unwrap()["target"],
        "read_text_file"
    );
    assert_eq!(s["provenance"][0]["connection"], "documents");
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_file_outside_the_served_folder_is_unreachable() {
    let d = deployment();
    let client = d.serve().await;
    // The model has no path parameter at all.
    let err = call(
        &client,
        "retrieve_document",
        json!({"path": "../outside-secret.txt"}),
    )
    .await;
    let err = refused_arguments(err);
    assert!(err.contains("/path: unknown property"), "{err}");
    // Searching for it, with or without traversal, finds nothing outside the folder.
    for query in [
        "outside-secret",
        "../outside-secret",
        "secret",
        "/etc/passwd",
        "..",
        "*",
    ] {
        let r = call(&client, "search_documents", json!({"query": query}))
            .await
            .unwrap();
        let seen = visible(&r);
        assert!(
            !seen.contains("TOP SECRET") && !seen.contains("outside-secret"),
            "{query}: {seen}"
        );
        assert_no_paths(&seen);
        if r.is_error != Some(true) {
            for reference in references(&r) {
                let doc = call(
                    &client,
                    "retrieve_document",
                    json!({"reference": reference}),
                )
                .await
                .unwrap();
                assert!(
                    !visible(&doc).contains("TOP SECRET"),
                    "{query} reached the secret"
                );
            }
        }
    }
    // A reference can only be one the host minted.
    let err = call(
        &client,
        "retrieve_document",
        json!({"reference": "../outside-secret.txt"}),
    )
    .await;
    let err = refused_arguments(err);
    assert!(err.contains("not valid in this session"), "{err}");
    client.cancel().await.unwrap();
}
