//! Which store to open, and the one function that opens it ([`open`]): every command, the
//! serving host and the tests reach a store through it, so where the state lives and
//! which key signs the trace are decided in one place.
//!
//! The rule: **a target names one backend and nothing else.** [`Target::Sqlite`] is
//! [`DATABASE_FILE`](crate::DATABASE_FILE) in a state folder; [`Target::Postgres`] is a
//! PostgreSQL database several hosts share, the state folder then only holding the key
//! file (the last resort for the trace key). A PostgreSQL target may hold a password, so
//! neither [`Target`]'s `Debug` nor any error of this module repeats it.
//!
//! Accepted forms (the `store` setting and `--store`): `"sqlite"`, or a PostgreSQL target
//! ([`postgres::is_postgres_target`]): a `postgres://` or `postgresql://` URL, or libpq
//! key/value text such as `host=/run/postgresql dbname=airlock`.

use std::path::Path;
use std::sync::Arc;

use crate::{PostgresStore, SqliteStore, Store, TraceKey, postgres};

/// Where the state lives: the `store` setting of a configuration, or `--store`.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum Target {
    /// [`DATABASE_FILE`](crate::DATABASE_FILE) in the state folder (`store = "sqlite"`,
    /// or no `store`).
    #[default]
    Sqlite,
    /// A PostgreSQL database shared by several hosts: the target text as written (a URL
    /// or libpq key/value text, already checked to parse; it may hold a password, so it
    /// is never printed — `Debug` shows only the form).
    Postgres(String),
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Sqlite => f.write_str("Sqlite"),
            Self::Postgres(_) => f.write_str("Postgres(…)"),
        }
    }
}

impl Target {
    /// Parses a `store` value: `"sqlite"`, or a PostgreSQL target
    /// ([`postgres::is_postgres_target`]) that parses ([`postgres::parse_target`]).
    ///
    /// # Errors
    /// Any other text, or a PostgreSQL target that does not parse; the message never
    /// repeats the value (it may hold a password).
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        if text.trim() == "sqlite" {
            return Ok(Self::Sqlite);
        }
        if postgres::is_postgres_target(text) {
            postgres::parse_target(text)?;
            return Ok(Self::Postgres(text.trim().to_owned()));
        }
        anyhow::bail!(
            "`store` must be \"sqlite\" (the default: airlock.db in the state folder) or a \
             PostgreSQL target: a postgres:// or postgresql:// URL, or key/value text such as \
             \"host=/run/postgresql dbname=airlock\"; the value given is neither"
        )
    }

    /// Whether several hosts may serve from this store at once (PostgreSQL).
    pub fn is_shared(&self) -> bool {
        matches!(self, Self::Postgres(_))
    }
}

/// Opens the store `target` names, with state folder `state_dir` and trace key `key`:
/// - [`Target::Sqlite`]: `state_dir`'s database, created (with the folder) when missing
///   ([`SqliteStore::open_with_key`] has what it refuses);
/// - [`Target::Postgres`]: the shared database ([`PostgresStore::open`]); `state_dir`, when
///   given, holds the key file used when neither `key` nor
///   [`KEY_ENV`](crate::key::KEY_ENV) gives the key.
///
/// `key`: the host key (a named secret, `[trace] key`); `None` takes
/// [`KEY_ENV`](crate::key::KEY_ENV) when set, else the state folder's key file. Every host
/// on one PostgreSQL store must hold the same key.
///
/// # Errors
/// [`Target::Sqlite`] with no `state_dir`; anything the backend's own `open` refuses (a
/// state folder or database this build must not touch, an unreachable server, a foreign
/// or newer schema, no key source). No message repeats a PostgreSQL password.
pub fn open(
    target: &Target,
    state_dir: Option<&Path>,
    key: Option<TraceKey>,
) -> anyhow::Result<Arc<dyn Store>> {
    Ok(match target {
        Target::Sqlite => {
            let Some(dir) = state_dir else {
                anyhow::bail!(
                    "no state folder: the embedded store keeps {} in one; pass --state-dir, \
                     set AIRLOCK_STATE_DIR or state_dir in the configuration",
                    crate::DATABASE_FILE
                );
            };
            Arc::new(SqliteStore::open_with_key(dir, key)?)
        }
        Target::Postgres(text) => Arc::new(PostgresStore::open(text, state_dir, key)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> TraceKey {
        TraceKey::from_secret("target-test", "0123456789abcdef0123456789abcdef-target").unwrap()
    }

    #[test]
    fn a_store_setting_is_sqlite_or_a_postgres_target_and_nothing_else() {
        assert_eq!(Target::parse("sqlite").unwrap(), Target::Sqlite);
        assert_eq!(Target::parse("  sqlite\n").unwrap(), Target::Sqlite);
        assert_eq!(
            Target::parse(" postgres://airlock@localhost/airlock ").unwrap(),
            Target::Postgres("postgres://airlock@localhost/airlock".into())
        );
        assert_eq!(
            Target::parse("host=/run/postgresql dbname=airlock").unwrap(),
            Target::Postgres("host=/run/postgresql dbname=airlock".into())
        );
        for refused in ["", "SQLite", "mysql://x/y", "/var/lib/airlock/airlock.db"] {
            assert!(Target::parse(refused).is_err(), "{refused:?} accepted");
        }
        assert!(!Target::Sqlite.is_shared());
        assert!(Target::Postgres("host=/x".into()).is_shared());
        assert_eq!(Target::default(), Target::Sqlite);
    }

    #[test]
    fn a_postgres_password_is_never_shown() {
        let text = "postgres://airlock:hunter2@localhost/airlock?sslmode=require";
        let refused = format!("{:#}", Target::parse(text).unwrap_err());
        assert!(!refused.contains("hunter2"), "{refused}");
        let target = Target::parse("postgres://airlock:hunter2@localhost/airlock").unwrap();
        assert_eq!(format!("{target:?}"), "Postgres(…)");
    }

    #[test]
    fn sqlite_opens_the_state_folders_database_creating_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        let store = open(&Target::Sqlite, Some(&dir), Some(key())).unwrap();
        assert!(!store.is_shared());
        assert_eq!(store.trace_key().id(), key().id());
        store
            .connection_revision("a", &"1".repeat(64), &serde_json::json!({}))
            .unwrap();
        drop(store);
        assert!(dir.join(crate::DATABASE_FILE).is_file());
        let again = open(&Target::Sqlite, Some(&dir), Some(key())).unwrap();
        assert_eq!(again.connections().unwrap().len(), 1, "the same database");
    }

    #[test]
    fn sqlite_without_a_state_folder_is_refused_by_name() {
        let Err(refused) = open(&Target::Sqlite, None, None) else {
            panic!("opened without a state folder")
        };
        assert!(
            format!("{refused:#}").starts_with("no state folder"),
            "{refused:#}"
        );
    }

    #[test]
    fn an_unreachable_postgres_is_refused_without_its_password() {
        let tmp = tempfile::tempdir().unwrap();
        let target = Target::Postgres(format!(
            "host={} port=1 dbname=airlock user=airlock password=hunter2 connect_timeout=2",
            tmp.path().display()
        ));
        let Err(refused) = open(&target, Some(tmp.path()), Some(key())) else {
            panic!("opened a store no server answers for")
        };
        let shown = format!("{refused:#}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(
            !tmp.path().join(crate::DATABASE_FILE).exists(),
            "no SQLite file made"
        );
    }
}
