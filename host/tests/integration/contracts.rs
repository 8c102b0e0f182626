//! Capability contracts as the model meets them: what `tools/list` offers for the
//! built-in contracts is fixed byte for byte by a checked-in expectation, so moving
//! where the host reads a contract from (compiled-in code, a contract package) cannot
//! change a tool's name, description, schema or annotations unnoticed.

use std::path::Path;

use crate::common::Deployment;

/// The checked-in `tools/list` of the bundled `source-library` and `outbox-delivery`
/// mappings (both built-in contracts), as one JSON document.
const EXPECTED_TOOLS: &str = "tests/expected/tools-list-builtins.json";

#[tokio::test]
async fn the_built_in_contracts_offer_exactly_the_recorded_tools() {
    let d = Deployment::with_notes()
        .mapping("source-library")
        .with_outbox(&[]);
    d.approve_all();
    let client = d.serve().await;
    let mut tools = client.peer().list_all_tools().await.unwrap();
    tools.sort_by(|a, b| a.name.cmp(&b.name));
    let got = serde_json::to_string_pretty(&tools).unwrap() + "\n";
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(EXPECTED_TOOLS);
    if std::env::var_os("AIRLOCK_UPDATE_EXPECTED").is_some() {
        std::fs::write(&path, &got).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap();
    assert!(
        got == expected,
        "tools/list differs from {EXPECTED_TOOLS} (set AIRLOCK_UPDATE_EXPECTED=1 only for an intended change):\n{got}"
    );
    client.cancel().await.unwrap();
}
