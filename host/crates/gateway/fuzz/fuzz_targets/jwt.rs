//! The HTTP front's credentials and header checks: `Authorization` values and bearer JWTs
//! against a fixed key set (fixtures/jwt: test-only keys), and `Host` / `Origin` values.
//!
//! The first byte picks the mode; asserted, beyond "no panic":
//! - **raw header** (any bytes as `Authorization`): never accepted — nobody but the issuer's
//!   key signs, so a random input never validates;
//! - **signed claims** (a JSON object merged into good claims, signed with the issuer's key
//!   or another one, under the right kid, another kid or none) and **signed payload** (any
//!   bytes as the payload, signed): accepted only when signed by the issuer's key, and then
//!   only when `iss` is the configured issuer, `aud` is or contains the audience, `exp` is a
//!   number in the future and `nbf` absent or in the past (both within the leeway), `sub`
//!   is the principal returned and a principal name, the required scope is held, and the
//!   roles and profile returned are names taken from the token;
//! - **mutated token** (a good token with bytes replaced, inserted or removed): accepted
//!   only when its signed part (header and payload segments) is the one the issuer signed;
//! - **host** (`Host` value): an accepted authority names a non-empty, lower-case host
//!   with no user information, white space or path, and its port is the one written;
//! - **origin** (an origin and an `allowed_origins` entry): an origin that passes has the
//!   entry's scheme, host and port (any port for a `scheme://host:*` entry), each compared
//!   as parsed by the Host check.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use airlock_gateway::front::auth::{AuthSettings, Verified, Verifier, check_principal};
use airlock_gateway::fuzzing::{http_authority, http_origin_allowed, http_origin_entry};
use jsonwebtoken::{Algorithm, EncodingKey};
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value, json};

const JWKS: &str = include_str!("../../../../../fixtures/jwt/jwks.json");
const KEY: &[u8] = include_bytes!("../../../../../fixtures/jwt/issuer.pk8.der");
const OTHER_KEY: &[u8] = include_bytes!("../../../../../fixtures/jwt/other.pk8.der");
const ISSUER: &str = "https://issuer.test";
const AUDIENCE: &str = "http://127.0.0.1:8787/mcp";
const LEEWAY: u64 = 60;

struct Fixed {
    verifier: Verifier,
    key: EncodingKey,
    other: EncodingKey,
    /// A token the issuer signed: (signed part, signature).
    good: (String, String),
}

fn fixed() -> &'static Fixed {
    static FIXED: OnceLock<Fixed> = OnceLock::new();
    FIXED.get_or_init(|| {
        let settings = AuthSettings {
            issuer: ISSUER.into(),
            audience: AUDIENCE.into(),
            jwks_file: PathBuf::from("unused"),
            leeway: Duration::from_secs(LEEWAY),
            required_scopes: vec!["mcp".into()],
            roles_claim: Some("roles".into()),
            profile_claim: Some("airlock_profile".into()),
        };
        let verifier = Verifier::from_jwks(settings, JWKS).expect("the test JWKS loads");
        let key = EncodingKey::from_ec_der(KEY);
        let other = EncodingKey::from_ec_der(OTHER_KEY);
        let header = json!({"alg": "ES256", "typ": "JWT", "kid": "test-issuer-1"});
        let signed = format!(
            "{}.{}",
            b64(header.to_string().as_bytes()),
            b64(good_claims().to_string().as_bytes())
        );
        let sig = jsonwebtoken::crypto::sign(signed.as_bytes(), &key, Algorithm::ES256).unwrap();
        Fixed {
            verifier,
            key,
            other,
            good: (signed, sig),
        }
    })
}

fn now() -> u64 {
    jsonwebtoken::get_current_timestamp()
}

fn good_claims() -> Value {
    json!({
        "iss": ISSUER,
        "aud": AUDIENCE,
        "sub": "alice",
        // Far enough ahead to stay good through a long run.
        "exp": now() + 30 * 24 * 3600,
        "scope": "mcp other",
        "roles": ["operator"],
        "airlock_profile": "default",
    })
}

/// base64url without padding (RFC 4648 §5).
fn b64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().fold(0u32, |n, b| (n << 8) | u32::from(*b)) << (8 * (3 - chunk.len()));
        for i in 0..=chunk.len() {
            out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

fn verify(text: &str) -> Result<Verified, airlock_gateway::front::auth::Rejection> {
    match http::HeaderValue::from_str(text) {
        Ok(h) => fixed().verifier.verify(Some(&h)),
        Err(_) => Err(airlock_gateway::front::auth::Rejection::Missing),
    }
}

/// What must hold of the claims of an accepted token (read as the verifier's own claim
/// map reads them: the last of duplicate keys).
fn check_accepted(payload: &[u8], v: &Verified) {
    let claims: Map<String, Value> =
        serde_json::from_slice(payload).expect("an accepted payload is a JSON object");
    let now = now() as f64;
    assert_eq!(claims.get("iss"), Some(&json!(ISSUER)), "iss: {claims:?}");
    let aud_ok = match claims.get("aud") {
        Some(Value::String(a)) => a == AUDIENCE,
        Some(Value::Array(a)) => a.contains(&json!(AUDIENCE)),
        _ => false,
    };
    assert!(aud_ok, "aud: {claims:?}");
    let exp = claims
        .get("exp")
        .and_then(Value::as_f64)
        .expect("exp is a number");
    assert!(exp + LEEWAY as f64 >= now - 1.0, "expired: {claims:?}");
    if let Some(nbf) = claims.get("nbf") {
        let nbf = nbf.as_f64().expect("nbf is a number");
        assert!(
            nbf <= now + LEEWAY as f64 + 1.0,
            "not yet valid: {claims:?}"
        );
    }
    assert_eq!(
        claims.get("sub"),
        Some(&json!(v.subject)),
        "sub: {claims:?}"
    );
    check_principal(&v.subject).expect("the subject is a principal name");
    let mut scopes: Vec<&str> = claims
        .get("scope")
        .and_then(Value::as_str)
        .map(|s| s.split(' ').collect())
        .unwrap_or_default();
    if let Some(Value::Array(scp)) = claims.get("scp") {
        scopes.extend(scp.iter().filter_map(Value::as_str));
    }
    assert!(scopes.contains(&"mcp"), "scope: {claims:?}");
    for role in &v.roles {
        check_principal(role).expect("a role is a principal name");
        let held = match claims.get("roles") {
            Some(Value::String(r)) => r == role,
            Some(Value::Array(rs)) => rs.contains(&json!(role)),
            _ => false,
        };
        assert!(held, "role {role} is not in the token: {claims:?}");
    }
    if let Some(p) = &v.profile {
        assert_eq!(claims.get("airlock_profile"), Some(&json!(p)), "profile");
    }
}

/// Signs `payload` under a header chosen by `pick`; whether the issuer's key signed it.
fn signed_token(pick: u8, payload: &[u8]) -> (String, bool) {
    let f = fixed();
    let by_issuer = pick & 1 == 0;
    let header = match (pick >> 1) % 3 {
        0 => json!({"alg": "ES256", "typ": "JWT", "kid": "test-issuer-1"}),
        1 => json!({"alg": "ES256", "kid": "test-other-1"}),
        _ => json!({"alg": "ES256"}),
    };
    let signed = format!("{}.{}", b64(header.to_string().as_bytes()), b64(payload));
    let key = if by_issuer { &f.key } else { &f.other };
    let sig = jsonwebtoken::crypto::sign(signed.as_bytes(), key, Algorithm::ES256).unwrap();
    (format!("{signed}.{sig}"), by_issuer)
}

fn signed_mode(pick: u8, payload: &[u8]) {
    let (token, by_issuer) = signed_token(pick, payload);
    let scheme = if pick & 0x40 != 0 { "bearer" } else { "Bearer" };
    if let Ok(v) = verify(&format!("{scheme} {token}")) {
        assert!(by_issuer, "a token signed by another key was accepted");
        check_accepted(payload, &v);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 6 {
        0 => {
            if let Ok(h) = http::HeaderValue::from_bytes(rest) {
                assert!(
                    fixed().verifier.verify(Some(&h)).is_err(),
                    "an unsigned input was accepted"
                );
            }
        }
        1 => {
            let Some((&pick, json)) = rest.split_first() else {
                return;
            };
            let Ok(edits) = serde_json::from_slice::<Map<String, Value>>(json) else {
                return;
            };
            let mut claims = good_claims();
            for (k, v) in edits {
                claims[k] = v;
            }
            signed_mode(pick, claims.to_string().as_bytes());
        }
        2 => {
            let Some((&pick, payload)) = rest.split_first() else {
                return;
            };
            signed_mode(pick, payload);
        }
        3 => {
            // Edits of a good token: (position, operation, byte) triples.
            let f = fixed();
            let mut token = format!("{}.{}", f.good.0, f.good.1).into_bytes();
            for e in rest.chunks_exact(3) {
                let at = usize::from(e[0]) * token.len() / 256;
                match e[1] % 3 {
                    0 => token[at] = e[2],
                    1 => token.insert(at, e[2]),
                    _ => {
                        token.remove(at);
                    }
                }
                if token.is_empty() {
                    return;
                }
            }
            let Ok(text) = String::from_utf8(token) else {
                return;
            };
            if verify(&format!("Bearer {text}")).is_ok() {
                let signed = text.trim_matches(' ').rsplit_once('.').map(|(s, _)| s);
                assert_eq!(
                    signed,
                    Some(f.good.0.as_str()),
                    "a changed token was accepted"
                );
            }
        }
        4 => {
            let Ok(text) = std::str::from_utf8(rest) else {
                return;
            };
            if let Ok((host, port)) = http_authority(text) {
                assert!(!host.is_empty(), "{text:?}");
                assert_eq!(host, host.to_ascii_lowercase(), "{text:?}");
                assert!(
                    !host.contains(|c: char| c == '@'
                        || c == '/'
                        || c.is_whitespace()
                        || c.is_control()),
                    "{text:?} -> {host:?}"
                );
                if let Some(p) = port {
                    let digits = text
                        .rsplit_once(':')
                        .map(|(_, d)| d.trim_start_matches('0'));
                    assert_eq!(
                        digits.map(|d| if d.is_empty() { "0" } else { d }),
                        Some(p.to_string().as_str()),
                        "{text:?}"
                    );
                }
            }
        }
        _ => {
            let Ok(text) = std::str::from_utf8(rest) else {
                return;
            };
            let (origin, entry) = text
                .split_once('\0')
                .unwrap_or((text, "https://app.example.com"));
            let (origin, entry) = (origin.to_ascii_lowercase(), entry.to_ascii_lowercase());
            if http_origin_entry(&entry).is_err() {
                return;
            }
            if http_origin_allowed(&origin, std::slice::from_ref(&entry)) {
                // The same origin, said independently: scheme, host and port compared as
                // parsed by the Host check (a `:*` entry: any port).
                let (scheme, rest) = entry.split_once("://").expect("a checked entry");
                let wildcard = rest.strip_suffix(":*");
                let (host, port) =
                    http_authority(wildcard.unwrap_or(rest)).expect("a checked entry");
                let (o_scheme, o_rest) = origin
                    .split_once("://")
                    .expect("an origin passed has a scheme");
                assert_eq!(o_scheme, scheme, "origin {origin:?} passed entry {entry:?}");
                match http_authority(o_rest) {
                    Ok((o_host, o_port)) => {
                        assert_eq!(o_host, host, "origin {origin:?} passed entry {entry:?}");
                        if wildcard.is_none() {
                            // A scheme's default port written out is the same origin.
                            let default = match scheme {
                                "http" => Some(80),
                                "https" => Some(443),
                                _ => None,
                            };
                            assert_eq!(
                                o_port.or(default),
                                port.or(default),
                                "origin {origin:?} passed entry {entry:?}"
                            );
                        }
                    }
                    // Only a port out of range may pass a `:*` entry unparsed.
                    Err(_) => assert!(
                        wildcard.is_some_and(|w| o_rest
                            .strip_prefix(w)
                            .and_then(|p| p.strip_prefix(':'))
                            .is_some_and(|p| p.bytes().all(|b| b.is_ascii_digit()))),
                        "origin {origin:?} passed entry {entry:?}"
                    ),
                }
            }
        }
    }
});
