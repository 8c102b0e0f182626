//! The OAuth 2.1 resource server of the HTTP front: bearer JWTs in, a verified principal out.
//!
//! Rule: **a request reaches the MCP endpoint only with a bearer token that this module
//! verified**, and the requester it acts for is taken from that token alone (`sub`, plus
//! the configured roles and profile claims), never from anything else the client sends.
//! A token is accepted when all of these hold:
//!
//! - it came in `Authorization: Bearer <token>` (RFC 6750 §2.1; no query or form tokens),
//!   at most [`MAX_TOKEN_BYTES`], three base64url segments;
//! - its header's `alg` is one the JWKS key it names (`kid`; without `kid`: any key) declares
//!   or implies, and one of `RS256`, `ES256`, `EdDSA`: `none` and every HMAC algorithm are
//!   refused whatever the key says (an HMAC "key" would be the public JWKS itself);
//! - the signature verifies with that key;
//! - `iss` equals the configured `issuer`, `aud` contains the configured `audience` (this
//!   Airlock's resource URL, RFC 8707 / RFC 9068 §4), `exp` is in the future and `nbf` (when
//!   present) in the past, each within `leeway` (default [`DEFAULT_LEEWAY_S`], at most
//!   [`MAX_LEEWAY_S`]);
//! - `sub` is a principal name: 1 to 128 characters, none of them a control character or
//!   white space, and so is every role of the roles claim (at most [`MAX_ROLES`]); the
//!   profile claim is a profile name — else **403**: the value is never shown to policy;
//! - every `required_scopes` entry is among the token's scopes (`scope`, space-separated,
//!   RFC 9068 §2.2.3; or `scp`, an array) — else **403** `insufficient_scope`.
//!
//! Anything else is **401** with `WWW-Authenticate: Bearer resource_metadata="…"` (RFC 9728
//! §5.1), and `error="invalid_token"` when a token was presented (RFC 6750 §3.1). The
//! protected-resource metadata document (RFC 9728 §2) names the audience as `resource` and
//! the issuer as the one authorization server.
//!
//! Accepted form (`[http.auth]` in the serve configuration):
//!
//! ```toml
//! [http.auth]
//! issuer = "https://auth.example.com"          # required: the `iss` tokens must carry
//! audience = "https://airlock.example.com/mcp" # required: this Airlock's resource URL
//! jwks_file = "jwks.json"                      # required: the issuer's public keys (JWKS)
//! leeway = "60s"                               # clock skew allowed on exp/nbf (max 5m)
//! required_scopes = ["mcp"]                    # default: none
//! roles_claim = "roles"                        # default: none (no roles from tokens)
//! profile_claim = "airlock_profile"            # default: none (the default profile)
//! ```
//!
//! Keys are read once at start from `jwks_file` (a `jwks_url` would need an HTTPS client
//! and a refresh policy; it is not offered).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet, KeyAlgorithm};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use serde_json::{Value, json};

/// The clock skew allowed on `exp` and `nbf` when the configuration does not say.
pub const DEFAULT_LEEWAY_S: u64 = 60;

/// The largest clock skew a configuration may allow.
pub const MAX_LEEWAY_S: u64 = 300;

/// The longest bearer token read (bytes); a longer one is refused unparsed.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// Most roles taken from one token.
pub const MAX_ROLES: usize = 32;

/// The algorithms a token may be signed with (and then only when its key allows it).
pub const ACCEPTED_ALGORITHMS: [Algorithm; 3] =
    [Algorithm::RS256, Algorithm::ES256, Algorithm::EdDSA];

/// `[http.auth]` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAuth {
    issuer: String,
    audience: String,
    jwks_file: PathBuf,
    leeway: Option<String>,
    #[serde(default)]
    required_scopes: Vec<String>,
    roles_claim: Option<String>,
    profile_claim: Option<String>,
}

/// `[http.auth]`, checked: how bearer tokens are verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthSettings {
    /// The `iss` every token must carry; published as the authorization server.
    pub issuer: String,
    /// The `aud` every token must include: this Airlock's resource URL (RFC 8707).
    pub audience: String,
    /// The issuer's JSON Web Key Set, resolved against the configuration's folder.
    pub jwks_file: PathBuf,
    /// Clock skew allowed on `exp` and `nbf`.
    pub leeway: Duration,
    /// Scopes every token must carry.
    pub required_scopes: Vec<String>,
    /// The claim holding the requester's roles (an array of names, or one name).
    pub roles_claim: Option<String>,
    /// The claim naming the profile the session asks for (else the default profile).
    pub profile_claim: Option<String>,
}

impl AuthSettings {
    /// Checks `[http.auth]`, resolving `jwks_file` against `base`.
    ///
    /// # Errors
    /// An empty issuer, an audience that is not an `http(s)` URL, a leeway that does not
    /// parse or exceeds [`MAX_LEEWAY_S`], a scope with white space, an empty claim name.
    pub fn from_raw(raw: RawAuth, base: &Path) -> Result<Self> {
        if raw.issuer.trim().is_empty() {
            bail!("[http.auth] issuer is empty");
        }
        let audience: http::Uri = raw.audience.parse().with_context(|| {
            format!(
                "[http.auth] audience `{}` is not a URL (it is this Airlock's resource URL, e.g. \"https://airlock.example.com/mcp\")",
                raw.audience
            )
        })?;
        if !matches!(audience.scheme_str(), Some("http" | "https"))
            || audience.authority().is_none()
        {
            bail!(
                "[http.auth] audience `{}` must be an http(s) URL with a host, e.g. \"https://airlock.example.com/mcp\"",
                raw.audience
            );
        }
        let leeway = match raw.leeway {
            None => Duration::from_secs(DEFAULT_LEEWAY_S),
            Some(text) => {
                let d = humantime::parse_duration(&text).with_context(|| {
                    format!("[http.auth] leeway `{text}`: expected a duration such as \"60s\"")
                })?;
                if d > Duration::from_secs(MAX_LEEWAY_S) {
                    bail!("[http.auth] leeway `{text}` exceeds the maximum of {MAX_LEEWAY_S} s");
                }
                d
            }
        };
        for s in &raw.required_scopes {
            if s.is_empty() || s.chars().any(|c| c.is_whitespace() || c.is_control()) {
                bail!(
                    "[http.auth] required scope `{}` must be non-empty, without spaces",
                    s.escape_debug()
                );
            }
        }
        for (what, claim) in [
            ("roles_claim", &raw.roles_claim),
            ("profile_claim", &raw.profile_claim),
        ] {
            if claim.as_deref().is_some_and(str::is_empty) {
                bail!("[http.auth] {what} is empty");
            }
        }
        Ok(Self {
            issuer: raw.issuer,
            audience: raw.audience,
            jwks_file: base.join(raw.jwks_file),
            leeway,
            required_scopes: raw.required_scopes,
            roles_claim: raw.roles_claim,
            profile_claim: raw.profile_claim,
        })
    }
}

/// The principal a verified token names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// `sub`, a checked principal name.
    pub subject: String,
    /// Roles from the roles claim (sorted, deduplicated, each a checked name).
    pub roles: Vec<String>,
    /// The profile the profile claim asks for, if configured and present.
    pub profile: Option<String>,
    /// `exp`: when the token stops being valid (seconds since the epoch).
    pub expires_s: u64,
}

/// Why a request's credentials were refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// No `Authorization` header: 401 without an error code (RFC 6750 §3.1).
    Missing,
    /// A token (or header) that does not verify: 401 `invalid_token`; the text is for the
    /// client and the log, and names no key material.
    Invalid(String),
    /// A valid token without these required scopes: 403 `insufficient_scope`.
    InsufficientScope(Vec<String>),
    /// A valid token whose subject, roles or profile claim cannot name a principal: 403;
    /// such a value is never shown to policy.
    Unusable(String),
}

impl Rejection {
    /// The HTTP status for this rejection.
    pub fn status(&self) -> http::StatusCode {
        match self {
            Self::Missing | Self::Invalid(_) => http::StatusCode::UNAUTHORIZED,
            Self::InsufficientScope(_) | Self::Unusable(_) => http::StatusCode::FORBIDDEN,
        }
    }

    /// A one-line description for the response body.
    pub fn describe(&self) -> String {
        match self {
            Self::Missing => "a bearer token is required (Authorization: Bearer <token>)".into(),
            Self::Invalid(why) => format!("invalid token: {why}"),
            Self::InsufficientScope(missing) => {
                format!("the token lacks required scope(s): {}", missing.join(" "))
            }
            Self::Unusable(why) => format!("the token names no usable principal: {why}"),
        }
    }
}

/// One usable key of the JWKS.
struct VerifyKey {
    kid: Option<String>,
    alg: Algorithm,
    key: DecodingKey,
}

/// Verifies bearer tokens against `[http.auth]`.
pub struct Verifier {
    settings: AuthSettings,
    keys: Vec<VerifyKey>,
    /// `resource_metadata` URL of the challenges.
    metadata_url: String,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier")
            .field("issuer", &self.settings.issuer)
            .field("audience", &self.settings.audience)
            .field("keys", &self.keys.len())
            .finish_non_exhaustive()
    }
}

impl Verifier {
    /// Reads the JWKS file of `settings`.
    ///
    /// # Errors
    /// The file is unreadable or not a JWKS; a key is symmetric (`oct`), or declares an
    /// algorithm outside [`ACCEPTED_ALGORITHMS`], or is of a curve without one; no key is
    /// left.
    pub fn load(settings: AuthSettings) -> Result<Self> {
        let text = std::fs::read_to_string(&settings.jwks_file).with_context(|| {
            format!(
                "[http.auth] reading jwks_file {}",
                settings.jwks_file.display()
            )
        })?;
        Self::from_jwks(settings.clone(), &text)
            .with_context(|| format!("[http.auth] jwks_file {}", settings.jwks_file.display()))
    }

    /// Like [`Verifier::load`] with the JWKS text given.
    ///
    /// # Errors
    /// As [`Verifier::load`].
    pub fn from_jwks(settings: AuthSettings, jwks: &str) -> Result<Self> {
        let set: JwkSet = serde_json::from_str(jwks).context("not a JSON Web Key Set")?;
        let mut keys = Vec::new();
        for (i, jwk) in set.keys.iter().enumerate() {
            let name = jwk.common.key_id.clone().unwrap_or_else(|| format!("#{i}"));
            let alg = key_algorithm(jwk).with_context(|| format!("key {name}"))?;
            let key = DecodingKey::from_jwk(jwk).with_context(|| format!("key {name}"))?;
            keys.push(VerifyKey {
                kid: jwk.common.key_id.clone(),
                alg,
                key,
            });
        }
        if keys.is_empty() {
            bail!("the key set holds no key");
        }
        let metadata_url = metadata_url(&settings.audience);
        Ok(Self {
            settings,
            keys,
            metadata_url,
        })
    }

    /// The settings.
    pub fn settings(&self) -> &AuthSettings {
        &self.settings
    }

    /// The URL of the protected-resource metadata document (RFC 9728 §3.1: the
    /// well-known path inserted before the audience's path).
    pub fn metadata_url(&self) -> &str {
        &self.metadata_url
    }

    /// The protected-resource metadata document (RFC 9728 §2).
    pub fn metadata(&self) -> Value {
        let mut doc = json!({
            "resource": self.settings.audience,
            "authorization_servers": [self.settings.issuer],
            "bearer_methods_supported": ["header"],
            "resource_name": "Airlock",
        });
        if !self.settings.required_scopes.is_empty() {
            doc["scopes_supported"] = json!(self.settings.required_scopes);
        }
        doc
    }

    /// The `WWW-Authenticate` value answering `rejection` (RFC 6750 §3, RFC 9728 §5.1).
    pub fn challenge(&self, rejection: &Rejection) -> String {
        let mut value = format!(
            "Bearer resource_metadata=\"{}\"",
            quoted(&self.metadata_url)
        );
        match rejection {
            Rejection::Missing | Rejection::Unusable(_) => {}
            Rejection::Invalid(why) => {
                value.push_str(&format!(
                    ", error=\"invalid_token\", error_description=\"{}\"",
                    quoted(why)
                ));
            }
            Rejection::InsufficientScope(_) => {
                value.push_str(&format!(
                    ", error=\"insufficient_scope\", scope=\"{}\"",
                    quoted(&self.settings.required_scopes.join(" "))
                ));
            }
        }
        value
    }

    /// Verifies the `Authorization` header of a request (absent: `None`).
    ///
    /// # Errors
    /// A [`Rejection`] saying why (see the module's rule).
    pub fn verify(&self, authorization: Option<&http::HeaderValue>) -> Result<Verified, Rejection> {
        let Some(header) = authorization else {
            return Err(Rejection::Missing);
        };
        if header.len() > MAX_TOKEN_BYTES + 16 {
            return Err(invalid("the token is longer than the limit"));
        }
        let header = header
            .to_str()
            .map_err(|_| invalid("the Authorization header is not visible ASCII"))?;
        let (scheme, token) = header
            .split_once(' ')
            .ok_or_else(|| invalid("expected `Authorization: Bearer <token>`"))?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(invalid("expected the Bearer scheme"));
        }
        let token = token.trim_matches(' ');
        if token.is_empty() {
            return Err(invalid("the token is empty"));
        }
        if token.split('.').count() != 3
            || !token
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return Err(invalid("not a JWS compact serialization"));
        }
        let head = jsonwebtoken::decode_header(token)
            .map_err(|_| invalid("the token header does not parse or names no accepted alg"))?;
        if !ACCEPTED_ALGORITHMS.contains(&head.alg) {
            return Err(invalid("the token's alg is not accepted"));
        }
        let key = self
            .keys
            .iter()
            .filter(|k| head.kid.is_none() || k.kid == head.kid)
            .find(|k| k.alg == head.alg)
            .ok_or_else(|| invalid("no key of the issuer matches the token's kid and alg"))?;
        let mut validation = Validation::new(key.alg);
        validation.set_issuer(&[&self.settings.issuer]);
        validation.set_audience(&[&self.settings.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.leeway = self.settings.leeway.as_secs();
        validation.validate_nbf = true;
        let data =
            jsonwebtoken::decode::<serde_json::Map<String, Value>>(token, &key.key, &validation)
                .map_err(|e| {
                    use jsonwebtoken::errors::ErrorKind;
                    invalid(match e.kind() {
                        ErrorKind::ExpiredSignature => "the token has expired",
                        ErrorKind::ImmatureSignature => "the token is not valid yet",
                        ErrorKind::InvalidIssuer => "the token's issuer is not accepted",
                        ErrorKind::InvalidAudience => "the token is not for this resource",
                        ErrorKind::InvalidSignature => "the signature does not verify",
                        ErrorKind::MissingRequiredClaim(_) => "the token lacks a required claim",
                        _ => "the token does not verify",
                    })
                })?;
        let claims = data.claims;
        // jsonwebtoken also takes an array of issuers that merely contains ours; `iss` is
        // one StringOrURI (RFC 7519 §4.1.1) and must be the issuer itself.
        if claims.get("iss").and_then(Value::as_str) != Some(self.settings.issuer.as_str()) {
            return Err(invalid("the token's issuer is not accepted"));
        }
        let subject = match claims.get("sub") {
            Some(Value::String(s)) => s.clone(),
            _ => return Err(unusable("`sub` is not a string")),
        };
        check_principal(&subject).map_err(|why| unusable(&format!("`sub` {why}")))?;
        let scopes = scopes(&claims);
        let missing: Vec<String> = self
            .settings
            .required_scopes
            .iter()
            .filter(|s| !scopes.contains(s.as_str()))
            .cloned()
            .collect();
        if !missing.is_empty() {
            return Err(Rejection::InsufficientScope(missing));
        }
        let roles = match &self.settings.roles_claim {
            None => Vec::new(),
            Some(claim) => roles(claims.get(claim))
                .map_err(|why| unusable(&format!("claim `{claim}` {why}")))?,
        };
        let profile = match &self.settings.profile_claim {
            None => None,
            Some(claim) => match claims.get(claim) {
                None | Some(Value::Null) => None,
                Some(Value::String(p))
                    if !p.is_empty()
                        && p.len() <= 64
                        && p.bytes().all(|b| {
                            b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_'
                        }) =>
                {
                    Some(p.clone())
                }
                Some(_) => {
                    return Err(unusable(&format!(
                        "claim `{claim}` is not a profile name (1 to 64 of a-z, 0-9, `-`, `_`)"
                    )));
                }
            },
        };
        // `exp` is required and was checked as a number above.
        let expires_s = claims
            .get("exp")
            .and_then(Value::as_f64)
            .map_or(0, |e| e.max(0.0) as u64);
        Ok(Verified {
            subject,
            roles,
            profile,
            expires_s,
        })
    }
}

fn invalid(why: &str) -> Rejection {
    Rejection::Invalid(why.to_string())
}

fn unusable(why: &str) -> Rejection {
    Rejection::Unusable(why.to_string())
}

/// The one algorithm a JWKS key verifies: its declared `alg`, else the one its key type
/// implies (EC P-256 → ES256, OKP Ed25519 → EdDSA, RSA → RS256).
fn key_algorithm(jwk: &Jwk) -> Result<Algorithm> {
    let implied = match &jwk.algorithm {
        AlgorithmParameters::EllipticCurve(ec) if ec.curve == EllipticCurve::P256 => {
            Algorithm::ES256
        }
        AlgorithmParameters::OctetKeyPair(okp) if okp.curve == EllipticCurve::Ed25519 => {
            Algorithm::EdDSA
        }
        AlgorithmParameters::RSA(_) => Algorithm::RS256,
        AlgorithmParameters::OctetKey(_) => {
            bail!("a symmetric key (kty \"oct\") cannot verify a public issuer's tokens")
        }
        _ => bail!("its key type or curve has no accepted algorithm (RS256, ES256, EdDSA)"),
    };
    if let Some(declared) = jwk.common.key_algorithm {
        let declared = match declared {
            KeyAlgorithm::RS256 => Algorithm::RS256,
            KeyAlgorithm::ES256 => Algorithm::ES256,
            KeyAlgorithm::EdDSA => Algorithm::EdDSA,
            other => bail!("it declares alg {other:?}; accepted: RS256, ES256, EdDSA"),
        };
        if declared != implied {
            bail!("it declares alg {declared:?}, which its key type cannot verify");
        }
    }
    Ok(implied)
}

/// The token's scopes: `scope` (space-separated) and `scp` (an array of strings).
fn scopes(claims: &serde_json::Map<String, Value>) -> BTreeSet<&str> {
    let mut out = BTreeSet::new();
    if let Some(Value::String(s)) = claims.get("scope") {
        out.extend(s.split(' ').filter(|s| !s.is_empty()));
    }
    if let Some(Value::Array(items)) = claims.get("scp") {
        out.extend(items.iter().filter_map(Value::as_str));
    }
    out
}

/// Roles from a roles claim: absent = none; one name or an array of names.
fn roles(value: Option<&Value>) -> Result<Vec<String>, String> {
    let list: Vec<&Value> = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(_)) => vec![value.expect("present")],
        Some(Value::Array(items)) => items.iter().collect(),
        Some(_) => return Err("is not a role name or an array of them".into()),
    };
    if list.len() > MAX_ROLES {
        return Err(format!("holds more than {MAX_ROLES} roles"));
    }
    let mut roles = BTreeSet::new();
    for v in list {
        let Value::String(r) = v else {
            return Err("holds something other than role names".into());
        };
        check_principal(r).map_err(|why| format!("holds a role that {why}"))?;
        roles.insert(r.clone());
    }
    Ok(roles.into_iter().collect())
}

/// A principal or role name from a token: 1 to 128 characters, no control characters and
/// no white space.
///
/// # Errors
/// Why it is not one, as a phrase ("is empty", ...).
pub fn check_principal(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("is empty".into());
    }
    if name.chars().count() > 128 {
        return Err("is longer than 128 characters".into());
    }
    if name.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err("contains a control or white-space character".into());
    }
    Ok(())
}

/// RFC 9728 §3.1: `https://host/.well-known/oauth-protected-resource` + the resource's path.
fn metadata_url(audience: &str) -> String {
    let uri: http::Uri = audience
        .parse()
        .expect("checked when the settings were read");
    let scheme = uri.scheme_str().unwrap_or("https");
    let authority = uri.authority().map(|a| a.as_str()).unwrap_or_default();
    let path = uri.path().trim_end_matches('/');
    format!("{scheme}://{authority}/.well-known/oauth-protected-resource{path}")
}

/// Escapes `"` and `\` for a quoted-string (RFC 9110 §5.6.4), dropping control characters.
fn quoted(text: &str) -> String {
    text.chars()
        .filter(|c| !c.is_control())
        .flat_map(|c| match c {
            '"' | '\\' => vec!['\\', c],
            c => vec![c],
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{EncodingKey, Header, encode};

    const JWKS: &str = include_str!("../../../../../fixtures/jwt/jwks.json");
    const OTHER_JWKS: &str = include_str!("../../../../../fixtures/jwt/other-jwks.json");
    const KEY: &[u8] = include_bytes!("../../../../../fixtures/jwt/issuer.pk8.der");
    const OTHER_KEY: &[u8] = include_bytes!("../../../../../fixtures/jwt/other.pk8.der");

    fn settings() -> AuthSettings {
        AuthSettings {
            issuer: "https://issuer.test".into(),
            audience: "http://127.0.0.1:8787/mcp".into(),
            jwks_file: PathBuf::from("unused"),
            leeway: Duration::from_secs(60),
            required_scopes: vec!["mcp".into()],
            roles_claim: Some("roles".into()),
            profile_claim: Some("airlock_profile".into()),
        }
    }

    /// A change to good claims, for table-driven cases.
    type Edit = Box<dyn Fn(&mut Value)>;

    fn verifier() -> Verifier {
        Verifier::from_jwks(settings(), JWKS).unwrap()
    }

    fn now() -> i64 {
        jsonwebtoken::get_current_timestamp() as i64
    }

    fn claims() -> Value {
        json!({
            "iss": "https://issuer.test",
            "aud": "http://127.0.0.1:8787/mcp",
            "sub": "alice",
            "exp": now() + 300,
            "scope": "mcp other",
            "roles": ["operator"],
        })
    }

    fn sign(claims: &Value, key: &[u8], kid: &str) -> String {
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some(kid.into());
        encode(&header, claims, &EncodingKey::from_ec_der(key)).unwrap()
    }

    fn bearer(token: &str) -> http::HeaderValue {
        http::HeaderValue::from_str(&format!("Bearer {token}")).unwrap()
    }

    /// base64url without padding (RFC 4648 §5).
    fn b64(bytes: &[u8]) -> String {
        const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut out = String::new();
        for chunk in bytes.chunks(3) {
            let n =
                chunk.iter().fold(0u32, |n, b| (n << 8) | u32::from(*b)) << (8 * (3 - chunk.len()));
            for i in 0..=chunk.len() {
                out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
            }
        }
        out
    }

    #[test]
    fn a_good_token_names_its_principal() {
        let v = verifier();
        let token = sign(&claims(), KEY, "test-issuer-1");
        let got = v.verify(Some(&bearer(&token))).unwrap();
        assert_eq!(got.subject, "alice");
        assert_eq!(got.roles, ["operator"]);
        assert_eq!(got.profile, None);
        // The scheme is case-insensitive (RFC 9110 §11.1).
        let lower = http::HeaderValue::from_str(&format!("bearer {token}")).unwrap();
        assert!(v.verify(Some(&lower)).is_ok());
    }

    #[test]
    fn every_claim_that_is_wrong_is_invalid_token() {
        let v = verifier();
        let cases: Vec<(&str, Edit, &str)> = vec![
            (
                "expired",
                Box::new(|c| c["exp"] = json!(now() - 120)),
                "expired",
            ),
            (
                "issuer",
                Box::new(|c| c["iss"] = json!("https://evil.test")),
                "issuer",
            ),
            (
                "audience",
                Box::new(|c| c["aud"] = json!("https://other.test/mcp")),
                "not for this resource",
            ),
            (
                "no audience",
                Box::new(|c| {
                    c.as_object_mut().unwrap().remove("aud");
                }),
                "required claim",
            ),
            (
                "no exp",
                Box::new(|c| {
                    c.as_object_mut().unwrap().remove("exp");
                }),
                "required claim",
            ),
            (
                "no sub",
                Box::new(|c| {
                    c.as_object_mut().unwrap().remove("sub");
                }),
                "required claim",
            ),
            (
                "sub not a string",
                Box::new(|c| c["sub"] = json!(7)),
                "required claim",
            ),
            (
                "future nbf",
                Box::new(|c| c["nbf"] = json!(now() + 600)),
                "not valid yet",
            ),
        ];
        for (name, edit, needle) in cases {
            let mut c = claims();
            edit(&mut c);
            let token = sign(&c, KEY, "test-issuer-1");
            match v.verify(Some(&bearer(&token))) {
                Err(Rejection::Invalid(why)) => {
                    assert!(why.contains(needle), "{name}: {why}")
                }
                other => panic!("{name}: {other:?}"),
            }
        }
        let unusable: Vec<(&str, Edit, &str)> = vec![
            (
                "sub with newline",
                Box::new(|c| c["sub"] = json!("alice\nadmin")),
                "`sub`",
            ),
            ("empty sub", Box::new(|c| c["sub"] = json!("")), "`sub`"),
            (
                "long sub",
                Box::new(|c| c["sub"] = json!("a".repeat(129))),
                "`sub`",
            ),
            (
                "roles not names",
                Box::new(|c| c["roles"] = json!([1, 2])),
                "roles",
            ),
            (
                "role with space",
                Box::new(|c| c["roles"] = json!(["a b"])),
                "roles",
            ),
            (
                "too many roles",
                Box::new(|c| {
                    c["roles"] = json!((0..40).map(|i| format!("r{i}")).collect::<Vec<_>>())
                }),
                "roles",
            ),
            (
                "profile not a name",
                Box::new(|c| c["airlock_profile"] = json!("../x")),
                "profile",
            ),
        ];
        for (name, edit, needle) in unusable {
            let mut c = claims();
            edit(&mut c);
            let token = sign(&c, KEY, "test-issuer-1");
            match v.verify(Some(&bearer(&token))) {
                Err(r @ Rejection::Unusable(_)) => {
                    assert!(r.describe().contains(needle), "{name}: {r:?}");
                    assert_eq!(r.status(), 403);
                }
                other => panic!("{name}: {other:?}"),
            }
        }
        // Within the leeway an expired token still passes; beyond it, not.
        let mut c = claims();
        c["exp"] = json!(now() - 30);
        assert!(
            v.verify(Some(&bearer(&sign(&c, KEY, "test-issuer-1"))))
                .is_ok()
        );
    }

    #[test]
    fn missing_scope_is_insufficient_scope() {
        let v = verifier();
        let mut c = claims();
        c["scope"] = json!("other");
        let token = sign(&c, KEY, "test-issuer-1");
        let r = v.verify(Some(&bearer(&token))).unwrap_err();
        assert_eq!(r, Rejection::InsufficientScope(vec!["mcp".into()]));
        assert_eq!(r.status(), 403);
        let challenge = v.challenge(&r);
        assert!(
            challenge.contains("error=\"insufficient_scope\""),
            "{challenge}"
        );
        assert!(challenge.contains("scope=\"mcp\""), "{challenge}");
        // `scp` as an array counts too.
        c["scp"] = json!(["mcp"]);
        assert!(
            v.verify(Some(&bearer(&sign(&c, KEY, "test-issuer-1"))))
                .is_ok()
        );
    }

    #[test]
    fn wrong_key_unsigned_and_symmetric_tokens_are_refused() {
        let v = verifier();
        // Signed by another key, claiming the issuer's kid.
        let forged = sign(&claims(), OTHER_KEY, "test-issuer-1");
        assert!(
            matches!(v.verify(Some(&bearer(&forged))), Err(Rejection::Invalid(w)) if w.contains("signature"))
        );
        // Another key's kid: no key matches.
        let other = sign(&claims(), OTHER_KEY, "test-other-1");
        assert!(
            matches!(v.verify(Some(&bearer(&other))), Err(Rejection::Invalid(w)) if w.contains("no key"))
        );
        let payload = b64(claims().to_string().as_bytes());
        // alg none, with and without a signature segment.
        let none = b64(br#"{"alg":"none","typ":"JWT"}"#);
        for t in [
            format!("{none}.{payload}."),
            format!("{none}.{payload}.c2ln"),
        ] {
            assert!(
                matches!(v.verify(Some(&bearer(&t))), Err(Rejection::Invalid(_))),
                "{t}"
            );
        }
        // HS256 "signed" with the public JWKS text as the secret (key confusion).
        let mut h = Header::new(Algorithm::HS256);
        h.kid = Some("test-issuer-1".into());
        let hs = encode(&h, &claims(), &EncodingKey::from_secret(JWKS.as_bytes())).unwrap();
        assert!(
            matches!(v.verify(Some(&bearer(&hs))), Err(Rejection::Invalid(w)) if w.contains("alg"))
        );
        // The other issuer's verifier refuses this issuer's token.
        let o = Verifier::from_jwks(settings(), OTHER_JWKS).unwrap();
        assert!(
            o.verify(Some(&bearer(&sign(&claims(), KEY, "test-issuer-1"))))
                .is_err()
        );
    }

    #[test]
    fn hostile_headers_are_refused_without_panicking() {
        let v = verifier();
        assert_eq!(v.verify(None), Err(Rejection::Missing));
        let huge = format!("Bearer {}", "a".repeat(1 << 20));
        let cases: Vec<http::HeaderValue> = vec![
            http::HeaderValue::from_static("Bearer"),
            http::HeaderValue::from_static("Bearer "),
            http::HeaderValue::from_static("Basic YWxpY2U6cHc="),
            http::HeaderValue::from_static("Bearer garbage"),
            http::HeaderValue::from_static("Bearer a.b"),
            http::HeaderValue::from_static("Bearer a.b.c.d"),
            http::HeaderValue::from_static("Bearer ..."),
            http::HeaderValue::from_static("Bearer a.b.c"),
            http::HeaderValue::from_static("Bearer e30.e30.e30"),
            http::HeaderValue::from_static("Bearer !!!.???.***"),
            http::HeaderValue::from_str(&huge).unwrap(),
            http::HeaderValue::from_bytes(b"Bearer \xff\xfe.\x80.x").unwrap(),
        ];
        for h in cases {
            let r = v.verify(Some(&h)).unwrap_err();
            assert!(matches!(r, Rejection::Invalid(_)), "{h:?}: {r:?}");
            assert_eq!(r.status(), 401);
            let c = v.challenge(&r);
            assert!(c.starts_with("Bearer resource_metadata=\"http://127.0.0.1:8787/.well-known/oauth-protected-resource/mcp\""), "{c}");
            assert!(c.contains("error=\"invalid_token\""), "{c}");
        }
    }

    #[test]
    fn key_sets_that_could_be_confused_are_refused() {
        for (jwks, needle) in [
            (r#"{"keys":[{"kty":"oct","k":"c2VjcmV0"}]}"#, "symmetric"),
            (r#"{"keys":[]}"#, "no key"),
            ("not json", "JSON Web Key Set"),
            (
                r#"{"keys":[{"kty":"EC","crv":"P-256","alg":"HS256","x":"Lc3v6FmfvfV07GFadR3ThuRI1Fo8b4HLzABRCjzU6oY","y":"pLd2ixwFPOywsBwr8LRU7GS8JGDv9ZjsHuQZxgKzCqk"}]}"#,
                "HS256",
            ),
            (
                r#"{"keys":[{"kty":"EC","crv":"P-256","alg":"ES384","x":"Lc3v6FmfvfV07GFadR3ThuRI1Fo8b4HLzABRCjzU6oY","y":"pLd2ixwFPOywsBwr8LRU7GS8JGDv9ZjsHuQZxgKzCqk"}]}"#,
                "ES384",
            ),
        ] {
            let e = format!("{:#}", Verifier::from_jwks(settings(), jwks).unwrap_err());
            assert!(e.contains(needle), "{jwks}: {e}");
        }
    }

    #[test]
    fn a_valid_token_over_the_size_limit_is_refused_unparsed() {
        let v = verifier();
        let mut c = claims();
        c["pad"] = json!("x".repeat(MAX_TOKEN_BYTES));
        let token = sign(&c, KEY, "test-issuer-1");
        assert!(
            matches!(v.verify(Some(&bearer(&token))), Err(Rejection::Invalid(w)) if w.contains("longer than the limit"))
        );
        // Well under the limit, the same padding is fine.
        c["pad"] = json!("x".repeat(MAX_TOKEN_BYTES / 2));
        assert!(
            v.verify(Some(&bearer(&sign(&c, KEY, "test-issuer-1"))))
                .is_ok()
        );
    }

    #[test]
    fn a_valid_token_under_another_scheme_is_refused() {
        let v = verifier();
        let token = sign(&claims(), KEY, "test-issuer-1");
        for scheme in ["Basic", "DPoP", "Token", "Bearerx", "MAC"] {
            let h = http::HeaderValue::from_str(&format!("{scheme} {token}")).unwrap();
            assert!(
                matches!(v.verify(Some(&h)), Err(Rejection::Invalid(w)) if w.contains("Bearer scheme")),
                "{scheme}"
            );
        }
    }

    /// The rule the `jwt` fuzz target asserts (`iss` is the issuer): jsonwebtoken alone
    /// accepts an `iss` array that merely contains it.
    #[test]
    fn an_issuer_array_is_not_the_issuer() {
        let v = verifier();
        for iss in [
            json!(["https://issuer.test"]),
            json!(["https://issuer.test", "https://evil.test"]),
        ] {
            let mut c = claims();
            c["iss"] = iss.clone();
            let token = sign(&c, KEY, "test-issuer-1");
            assert!(
                matches!(v.verify(Some(&bearer(&token))), Err(Rejection::Invalid(w)) if w.contains("issuer")),
                "{iss}"
            );
        }
    }

    #[test]
    fn the_configured_leeway_is_the_one_applied() {
        let strict = Verifier::from_jwks(
            AuthSettings {
                leeway: Duration::ZERO,
                ..settings()
            },
            JWKS,
        )
        .unwrap();
        let mut c = claims();
        c["exp"] = json!(now() - 30);
        let token = sign(&c, KEY, "test-issuer-1");
        assert!(
            matches!(strict.verify(Some(&bearer(&token))), Err(Rejection::Invalid(w)) if w.contains("expired"))
        );
        let lenient = Verifier::from_jwks(
            AuthSettings {
                leeway: Duration::from_secs(MAX_LEEWAY_S),
                ..settings()
            },
            JWKS,
        )
        .unwrap();
        c["exp"] = json!(now() - 200);
        assert!(
            lenient
                .verify(Some(&bearer(&sign(&c, KEY, "test-issuer-1"))))
                .is_ok()
        );
    }

    #[test]
    fn names_are_checked_at_their_limits() {
        let v = verifier();
        let with = |edit: &dyn Fn(&mut Value)| {
            let mut c = claims();
            edit(&mut c);
            v.verify(Some(&bearer(&sign(&c, KEY, "test-issuer-1"))))
        };
        // Profile claims: 1 to 64 of a-z, 0-9, `-`, `_`.
        let ok = with(&|c| c["airlock_profile"] = json!("a".repeat(64))).unwrap();
        assert_eq!(ok.profile, Some("a".repeat(64)));
        assert_eq!(
            with(&|c| c["airlock_profile"] = json!("r-1_x"))
                .unwrap()
                .profile
                .as_deref(),
            Some("r-1_x")
        );
        for bad in [
            json!("a".repeat(65)),
            json!("Research"),
            json!(""),
            json!("a b"),
            json!("é"),
            json!(["research"]),
        ] {
            let r = with(&|c| c["airlock_profile"] = bad.clone()).unwrap_err();
            assert!(matches!(r, Rejection::Unusable(_)), "{bad}: {r:?}");
        }
        // Roles: at most MAX_ROLES.
        let roles = |n: usize| json!((0..n).map(|i| format!("r{i}")).collect::<Vec<_>>());
        assert_eq!(
            with(&|c| c["roles"] = roles(MAX_ROLES))
                .unwrap()
                .roles
                .len(),
            MAX_ROLES
        );
        assert!(matches!(
            with(&|c| c["roles"] = roles(MAX_ROLES + 1)),
            Err(Rejection::Unusable(_))
        ));
        // Subjects: at most 128 characters (not bytes).
        assert!(with(&|c| c["sub"] = json!("a".repeat(128))).is_ok());
        assert!(with(&|c| c["sub"] = json!("é".repeat(128))).is_ok());
        assert!(with(&|c| c["sub"] = json!("a\u{0}b")).is_err());
        assert!(with(&|c| c["sub"] = json!("a\u{a0}b")).is_err());
    }

    #[test]
    fn an_alg_the_key_does_not_verify_finds_no_key() {
        let v = verifier();
        let payload = b64(claims().to_string().as_bytes());
        // RS256 and EdDSA are accepted algorithms, but the issuer's key is ES256.
        for alg in ["RS256", "EdDSA"] {
            let head = b64(format!(r#"{{"alg":"{alg}","kid":"test-issuer-1"}}"#).as_bytes());
            let t = format!("{head}.{payload}.c2ln");
            assert!(
                matches!(v.verify(Some(&bearer(&t))), Err(Rejection::Invalid(w)) if w.contains("no key")),
                "{alg}"
            );
        }
        // HS256 is refused as an algorithm, before any key is looked at.
        let head = b64(br#"{"alg":"HS256","kid":"test-issuer-1"}"#);
        let t = format!("{head}.{payload}.c2ln");
        assert!(
            matches!(v.verify(Some(&bearer(&t))), Err(Rejection::Invalid(w)) if w.contains("not accepted"))
        );
    }

    #[test]
    fn a_key_declaring_an_alg_its_type_cannot_verify_is_refused() {
        let ec = |alg: &str| {
            format!(
                r#"{{"keys":[{{"kty":"EC","crv":"P-256","alg":"{alg}","x":"Lc3v6FmfvfV07GFadR3ThuRI1Fo8b4HLzABRCjzU6oY","y":"pLd2ixwFPOywsBwr8LRU7GS8JGDv9ZjsHuQZxgKzCqk"}}]}}"#
            )
        };
        for alg in ["RS256", "EdDSA"] {
            let e = format!(
                "{:#}",
                Verifier::from_jwks(settings(), &ec(alg)).unwrap_err()
            );
            assert!(e.contains("cannot verify"), "{alg}: {e}");
        }
        assert!(Verifier::from_jwks(settings(), &ec("ES256")).is_ok());
    }

    #[test]
    fn the_leeway_limit_is_inclusive() {
        let raw = |leeway: &str| RawAuth {
            issuer: "https://issuer.test".into(),
            audience: "https://a.test/mcp".into(),
            jwks_file: "jwks.json".into(),
            leeway: Some(leeway.into()),
            required_scopes: vec![],
            roles_claim: None,
            profile_claim: None,
        };
        let base = Path::new("/etc/airlock");
        assert_eq!(
            AuthSettings::from_raw(raw("5m"), base).unwrap().leeway,
            Duration::from_secs(MAX_LEEWAY_S)
        );
        assert!(AuthSettings::from_raw(raw("301s"), base).is_err());
    }

    #[test]
    fn settings_are_checked() {
        let base = Path::new("/etc/airlock");
        let raw = |audience: &str, leeway: Option<&str>| RawAuth {
            issuer: "https://issuer.test".into(),
            audience: audience.into(),
            jwks_file: "jwks.json".into(),
            leeway: leeway.map(String::from),
            required_scopes: vec![],
            roles_claim: None,
            profile_claim: None,
        };
        let s = AuthSettings::from_raw(raw("https://a.test/mcp", None), base).unwrap();
        assert_eq!(s.jwks_file, base.join("jwks.json"));
        assert_eq!(s.leeway, Duration::from_secs(DEFAULT_LEEWAY_S));
        assert!(AuthSettings::from_raw(raw("not a url", None), base).is_err());
        assert!(AuthSettings::from_raw(raw("ftp://a.test/mcp", None), base).is_err());
        assert!(AuthSettings::from_raw(raw("https://a.test/mcp", Some("1h")), base).is_err());
        assert!(AuthSettings::from_raw(raw("https://a.test/mcp", Some("soon")), base).is_err());
        assert_eq!(
            metadata_url("https://a.test/mcp"),
            "https://a.test/.well-known/oauth-protected-resource/mcp"
        );
        assert_eq!(
            metadata_url("https://a.test"),
            "https://a.test/.well-known/oauth-protected-resource"
        );
    }
}
